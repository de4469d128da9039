"""Bring trained model directories back from the GPU machine through its file limits (at most 8
files of 16 MiB): every 2-D float tensor as int8 rows with one bf16 scale per row (jspec.standin's
quantizer, so packing what comes back is lossless), 1-D tensors as bf16, side files
verbatim, split into shards.

  python scripts/standin_transfer.py save --dir target=OUT/target --dir dspark=OUT/dspark \
      --out $OUT/xfer [--max-mib 15]
  python scripts/standin_transfer.py load --src XFER --out DEST      # DEST/target, DEST/dspark, ...

`load` writes standard directories (float32 safetensors of q * scale, configs, side files). The
weights are then exactly those int8 values times their bf16 scales: what jspec ships.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jspec.standin import dequantize, quantize_rows  # noqa: E402  (the shipped format's quantizer)

SIDE = ("config.json", "generation_config.json", "tokenizer_config.json")


def save(dirs: dict[str, Path], out: Path, max_mib: float) -> None:
    from jspec.convert.safetensors_reader import index_checkpoint, read_tensor
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for name, d in dirs.items():
        for key, info in index_checkpoint(d).items():
            w = read_tensor(info).astype(np.float32)
            if w.ndim == 2:
                q, s = quantize_rows(w)
                arrays[f"{name}|{key}|q"] = q
                arrays[f"{name}|{key}|s"] = s.view(np.uint16)
            else:
                arrays[f"{name}|{key}|b"] = w.astype(ml_dtypes.bfloat16).view(np.uint16)
        for side in SIDE:
            if (d / side).is_file():
                arrays[f"{name}|{side}|txt"] = np.frombuffer((d / side).read_bytes(), np.uint8)
    shard, size, n = {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            buf = io.BytesIO()
            np.savez(buf, **shard)
            (out / f"xfer-{n:02d}.npz").write_bytes(buf.getvalue())
            n, shard, size = n + 1, {}, 0

    limit = max_mib * 2**20
    for k, v in arrays.items():
        if v.nbytes > limit:  # split big tensors by rows
            rows = max(1, int(limit // max(1, v.nbytes // len(v))) - 1)
            for i in range(0, len(v), rows):
                if size + v[i:i + rows].nbytes > limit:
                    flush()
                shard[f"{k}|part{i:09d}"] = v[i:i + rows]
                size += v[i:i + rows].nbytes
            continue
        if size + v.nbytes > limit:
            flush()
        shard[k] = v
        size += v.nbytes
    flush()
    print(f"transfer: {len(arrays)} arrays in {n} shard(s) under {out}")


def load(src: Path, dest: Path) -> list[Path]:
    from safetensors.numpy import save_file
    parts: dict[str, list] = {}
    for f in sorted(src.glob("xfer-*.npz")):
        with np.load(f) as z:
            for k in z.files:
                base, _, part = k.rpartition("|part") if "|part" in k else (k, "", "")
                parts.setdefault(base, []).append((part, z[k]))
    full = {k: np.concatenate([a for _, a in sorted(v, key=lambda t: t[0])]) if len(v) > 1 else v[0][1]
            for k, v in parts.items()}
    models: dict[str, dict] = {}
    for k, v in full.items():
        name, key, kind = k.split("|")
        models.setdefault(name, {})[(key, kind)] = v
    outs = []
    for name, items in models.items():
        d = dest / name
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for (key, kind), v in items.items():
            if kind == "txt":
                (d / key).write_bytes(v.tobytes())
            elif kind == "q":
                tensors[key] = dequantize(v, items[(key, "s")].view(ml_dtypes.bfloat16))
            elif kind == "b":
                tensors[key] = v.view(ml_dtypes.bfloat16).astype(np.float32)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        outs.append(d)
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--dir", action="append", required=True, help="NAME=DIR")
    s.add_argument("--out", required=True)
    s.add_argument("--max-mib", type=float, default=15.0)
    lo = sub.add_parser("load")
    lo.add_argument("--src", required=True)
    lo.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "save":
        save({d.split("=", 1)[0]: Path(d.split("=", 1)[1]) for d in args.dir}, Path(args.out), args.max_mib)
    else:
        for d in load(Path(args.src), Path(args.out)):
            print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
