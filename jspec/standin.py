"""The shipped stand-in pair: its compact int8 package, its names, and the directories built from it.

Names (accepted wherever a model or drafter directory is: `load_model`, `load_drafter`, `LLM`,
`jspec generate | bench | demo`, `Tokenizer.from_dir`):

    standin          the small Qwen3 target S            -> a standard HF Qwen3 directory
    standin-dspark   S's DSpark drafter                  -> a DeepSpec-layout drafter directory
    standin-dflash   S's DFlash drafter (the ablation)   -> a DeepSpec-layout drafter directory

Each resolves to a directory with the full Qwen3 vocabulary (151936 ids; embedding, lm_head and
Markov rows of id t are S's rows sigma(t), see convert/graft.py `vocab_law` and
convert/expand_vocab.py), built once into the cache ($JSPEC_CACHE, default ~/.cache/jspec) under a
name holding a hash of the packed files. Any other string is a path and passes through unchanged
(a local directory literally named `standin` is reached as `./standin`).

The package (jspec/assets/standin, or $JSPEC_STANDIN_DIR): one directory per model (target/,
dspark/, dflash/), each holding

    config.json              S's compact Hugging Face config, unchanged (jspec_shared_row,
                             jspec_id_to_row; the drafters' vocab_size / mask_token_id are S's rows)
    weights.safetensors      every 2-D weight W [rows, cols] as `<key>.q` int8 [rows, cols] and
                             `<key>.scale` bfloat16 [rows]; every 1-D tensor as `<key>` bfloat16
    generation_config.json   EOS ids (Qwen3 ids), when the source had one

The weights ARE q * scale (row-wise): that product is the model, exactly. q * scale is exact in
float32 (7 + 8 significant bits), but NOT in general in bfloat16 (8 bits): e.g. 127 x 1.0078125 =
127.9921875 needs 14. So the built directories are float32 (exact), and a compact directory is
bfloat16 only when every product happens to fit (as with `--pow2-scales`, where each scale is a
power of two and q * scale needs 7 bits; that costs up to one bit of int8 resolution).

Scales: each row's scale is the least bfloat16 >= max|w_row| / 127 (so |q| <= 127), unless the row
already is exactly q * s for an int8 q and a bfloat16 s (weights that came back through
scripts/standin_transfer.py, or an earlier package): then that q and s are kept, so re-packing
int8 weights is lossless. The drafters' copies of the target's embedding / lm_head are not
stored; neither is the tokenizer (the Qwen3 tokenizer ships in jspec/assets).

    python -m jspec.standin pack --target DIR --dspark DIR [--dflash DIR] --out DIR [--check] [--force]
    python -m jspec.standin path standin|standin-dspark|standin-dflash [--compact]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from jspec.atomic import atomic_dir
from jspec.config import ConfigError

BF16 = ml_dtypes.bfloat16
FORMAT = "jspec-standin-int8"
FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"
COMPLETE_MARKER = ".jspec-standin-complete"  # written last inside a cache entry
QWEN3_VOCAB = 151936
QWEN3_MASK_ID = 151669
EXPANDED_DTYPE = "float32"  # the built directories: exact q * s, and XLA's fast CPU path

# name -> (kind, subdirectory of the package)
NAMES = {"standin": "target", "standin-dspark": "dspark", "standin-dflash": "dflash"}
DRAFTERS = ("dspark", "dflash")


# ---- locations ------------------------------------------------------------------------------------

def package_dir() -> Path:
    """Where the packed pair lives: $JSPEC_STANDIN_DIR, else the package's assets/standin."""
    env = os.environ.get("JSPEC_STANDIN_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "assets" / "standin"


def cache_root() -> Path:
    env = os.environ.get("JSPEC_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "jspec") / "standin"


def is_standin_name(name_or_path) -> bool:
    return isinstance(name_or_path, (str, os.PathLike)) and os.fspath(name_or_path) in NAMES


def _looks_like_name(s: str) -> bool:
    return (s == "standin" or s.startswith("standin-")) and "/" not in s and os.sep not in s


def check_name(name: str) -> str:
    """The kind (target, dspark, dflash) of a known name; a one-line error for any other."""
    if name not in NAMES:
        raise ConfigError(f"unknown stand-in name {name!r} (known: {', '.join(NAMES)})")
    return NAMES[name]


# ---- quantisation ---------------------------------------------------------------------------------

def pow2_ceil(x: np.ndarray) -> np.ndarray:
    """The least power of two >= x (elementwise, x > 0), exactly."""
    mant, exp = np.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    return np.ldexp(1.0, np.where(mant == 0.5, exp - 1, exp))


def bf16_ceil(x: np.ndarray) -> np.ndarray:
    """The least bfloat16 value >= x (elementwise, x >= 0), as float64."""
    b = x.astype(np.float32).astype(BF16)
    low = b.astype(np.float64) < x
    if low.any():
        bits = b.view(np.uint16).copy()
        bits[low] += 1  # positive values: the next bf16 up
        b = bits.view(BF16)
    return b.astype(np.float64)


def exact_int8_scales(w: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Per row: a bfloat16 s with w_row = q * s exactly for integers |q| <= 127 (taken as
    max|w_row| / k for the largest such k in 127..64), or NaN where there is none."""
    scale = np.full(w.shape[0], np.nan)
    todo = amax > 0
    for k in range(127, 63, -1):
        s = amax / k
        cand = np.flatnonzero(todo & (s.astype(np.float32).astype(BF16).astype(np.float64) == s))
        if cand.size:
            r = w[cand] / s[cand, None]
            ok = cand[np.all(r == np.rint(r), axis=1)]
            scale[ok], todo[ok] = s[ok], False
    return scale


def quantize_rows(w: np.ndarray, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: (q int8 [rows, cols], scale bf16 [rows]) with |q| <= 127 and
    scale >= max|w_row| / 127: the least bfloat16 (pow2: the least power of two) such, except on
    rows that already are int8 x bfloat16 exactly, which keep that form. A zero row: scale 0."""
    w = np.asarray(w, np.float64)
    if w.ndim != 2:
        raise ValueError(f"quantize_rows wants a 2-D array, got shape {list(w.shape)}")
    amax = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0])
    if not np.isfinite(amax).all():
        raise ValueError("weights hold inf or NaN")
    need = amax / 127.0
    scale = exact_int8_scales(w, amax)
    if pow2:  # keep only what bfloat16 holds exactly
        scale[~np.all(w.astype(np.float32).astype(BF16).astype(np.float64) == w, axis=1)] = np.nan
    fresh = np.isnan(scale) & (need > 0)
    scale[np.isnan(scale)] = 0.0
    scale[fresh] = pow2_ceil(need[fresh]) if pow2 else bf16_ceil(need[fresh])
    nz = scale > 0
    if not np.array_equal(scale.astype(BF16).astype(np.float64), scale):
        raise ValueError("a row's scale is outside bfloat16's normal range")
    safe = np.where(nz, scale, 1.0)[:, None]
    q = np.rint(w / safe)
    assert np.abs(q).max(initial=0) <= 127, "scale rounding let |q| exceed 127"
    return q.astype(np.int8), scale.astype(BF16)


def dequantize(q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """The weight the package defines: q * scale row-wise (exact in float32; rounded to `dtype`)."""
    w = q.astype(np.float32) * scale.astype(np.float32)[:, None]
    return w.astype(dtype)


def exact_in(w32: np.ndarray, dtype) -> bool:
    return bool(np.array_equal(w32.astype(dtype).astype(np.float32), w32))


# ---- packing --------------------------------------------------------------------------------------

def _expected_keys(src: Path, kind: str) -> tuple[dict, dict[str, tuple], frozenset]:
    """(config.json, key -> shape, keys that may be present and are dropped)."""
    from jspec.config import Qwen3Config
    from jspec.dspark import DSparkConfig, SHARED_WITH_TARGET, drafter_checkpoint_shapes
    from jspec.qwen3 import checkpoint_shapes
    if not (src / CONFIG_FILE).is_file():
        raise ConfigError(f"{src} is not a model directory (no config.json)")
    hf = json.loads((src / CONFIG_FILE).read_text())
    if kind == "target":
        if "target_layer_ids" in hf:
            raise ConfigError(f"{src} is a drafter; --target wants S's target model")
        cfg = Qwen3Config.from_hf_dict(hf, dtype="float32")
        shapes = {k: v[0] for k, v in checkpoint_shapes(cfg).items()}
        drop = frozenset({"lm_head.weight"} if cfg.tie_word_embeddings else ())
    else:
        if "target_layer_ids" not in hf:
            raise ConfigError(f"{src} is not a DSpark/DFlash drafter (no target_layer_ids)")
        cfg = DSparkConfig.from_hf_dict(hf, dtype="float32")
        shapes = {k: v[0] for k, v in drafter_checkpoint_shapes(cfg).items()}
        drop = frozenset(SHARED_WITH_TARGET)
    return hf, shapes, drop


def _pack_one(src: Path, dst: Path, kind: str, pow2: bool = False) -> list[dict]:
    from safetensors.numpy import save_file

    from jspec.convert.safetensors_reader import CheckpointError, index_checkpoint, read_tensor
    hf, shapes, drop = _expected_keys(src, kind)
    infos = index_checkpoint(src)
    missing = sorted(set(shapes) - set(infos))
    extra = sorted(set(infos) - set(shapes) - drop)
    if missing or extra:
        raise CheckpointError(f"{src}: missing {missing[:8]} / unexpected {extra[:8]} tensor(s)")
    tensors, report = {}, []
    for key, shape in shapes.items():
        info = infos[key]
        if tuple(info.shape) != tuple(shape):
            raise CheckpointError(f"{src}: {key!r} has shape {list(info.shape)}, expected {list(shape)}")
        w = read_tensor(info).astype(np.float64)
        if w.ndim == 2:
            q, s = quantize_rows(w, pow2=pow2)
            tensors[key + ".q"], tensors[key + ".scale"] = q, s
            back = dequantize(q, s).astype(np.float64)
            nbytes = q.nbytes + s.nbytes
        elif w.ndim == 1:
            tensors[key] = w.astype(np.float32).astype(BF16)
            back = tensors[key].astype(np.float64)
            nbytes = tensors[key].nbytes
        else:
            raise CheckpointError(f"{src}: {key!r} has {w.ndim} dimensions (1 or 2 expected)")
        err = np.abs(w - back)
        rows = w.reshape(w.shape[0], -1) if w.ndim == 2 else w.reshape(1, -1)
        amax = np.abs(rows).max(axis=1, keepdims=True)
        rel_row = err.reshape(rows.shape) / np.where(amax > 0, amax, 1.0)
        report.append({"model": kind, "tensor": key, "shape": list(w.shape), "bytes": nbytes,
                       "max_rel_err": float(rel_row.max(initial=0.0)),
                       "rel_fro_err": float(np.linalg.norm(err) / max(np.linalg.norm(w), 1e-300))})
    dst.mkdir(parents=True)
    save_file(tensors, dst / WEIGHTS_FILE, metadata={"format": FORMAT, "version": str(FORMAT_VERSION),
                                                    "scales": "pow2" if pow2 else "bf16"})
    (dst / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    if (src / GENERATION_CONFIG).is_file():
        shutil.copy2(src / GENERATION_CONFIG, dst / GENERATION_CONFIG)
    for f in dst.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; package data is world-readable
    return report


def _check_pair(target: Path, drafters: dict[str, Path]) -> None:
    """The drafters fit the target and the vocabulary law expands to Qwen3's ids."""
    from jspec.config import Qwen3Config
    from jspec.convert.graft import GraftError, vocab_law
    from jspec.dspark import DSparkConfig
    hf = json.loads((target / CONFIG_FILE).read_text())
    cfg = Qwen3Config.from_hf_dict(hf, dtype="float32")
    masks = set()
    for kind, d in drafters.items():
        dcfg = DSparkConfig.from_dir(d, dtype="float32")
        try:
            dcfg.check_fits(cfg)
        except ConfigError as e:
            raise ConfigError(f"--{kind} {d}: {e}") from None
        if (kind == "dflash") != dcfg.is_dflash:
            raise ConfigError(f"--{kind} {d} is a {'DFlash' if dcfg.is_dflash else 'DSpark'} drafter")
        masks.add(dcfg.mask_token_id)
    if len(masks) != 1:
        raise ConfigError(f"the drafters' mask rows differ: {sorted(masks)}")
    try:
        vocab_law(hf, cfg.vocab_size, QWEN3_VOCAB, masks.pop(), QWEN3_MASK_ID)
    except GraftError as e:
        raise ConfigError(f"{target}: the compact vocabulary does not expand to Qwen3's: {e}") from None


def pack(target: str | Path, dspark: str | Path, out: str | Path, dflash: str | Path | None = None,
         *, pow2: bool = False, force: bool = False) -> list[dict]:
    """Pack S and its drafters into out/{target,dspark[,dflash]}; atomic. Returns the per-tensor
    report (quantisation errors relative to each row's max |w|, bytes)."""
    srcs = {"target": Path(target), "dspark": Path(dspark)}
    if dflash is not None:
        srcs["dflash"] = Path(dflash)
    _check_pair(srcs["target"], {k: v for k, v in srcs.items() if k != "target"})
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    report = []
    with atomic_dir(out) as tmp:
        for kind, src in srcs.items():
            report += _pack_one(src, tmp / kind, kind, pow2)
    return report


def packed_size(pack_dir: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(pack_dir).rglob("*") if f.is_file())


# ---- reading the package --------------------------------------------------------------------------

def _pack_files(kind: str) -> list[Path]:
    """The packed files of one model; a missing one is named."""
    d = package_dir() / kind
    files = [d / CONFIG_FILE, d / WEIGHTS_FILE]
    for f in files:
        if not f.is_file():
            where = ("$JSPEC_STANDIN_DIR" if os.environ.get("JSPEC_STANDIN_DIR")
                     else "the installed package")
            raise FileNotFoundError(f"stand-in file {f} is missing (the packed pair in {where}; "
                                    "`python -m jspec.standin pack` writes it)")
    if (d / GENERATION_CONFIG).is_file():
        files.append(d / GENERATION_CONFIG)
    return files


_HASHES: dict[tuple, str] = {}


def _file_hash(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _pack_hash(kind: str) -> str:
    return _key(f"{FORMAT}/{FORMAT_VERSION}",
                *(f"{f.name}:{_file_hash(f)}" for f in _pack_files(kind)))


def read_packed(kind: str, dtype=np.float32) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, key -> weight in `dtype`) of one packed model, weights = q * scale."""
    from safetensors.numpy import load_file
    files = _pack_files(kind)
    hf = json.loads(files[0].read_text())
    raw = load_file(files[1])
    out = {}
    for name, value in raw.items():
        if name.endswith(".scale"):
            continue
        if name.endswith(".q"):
            key = name[:-2]
            if key + ".scale" not in raw:
                raise ValueError(f"{files[1]}: {name!r} has no {key + '.scale'!r}")
            out[key] = dequantize(value, raw[key + ".scale"], dtype)
        else:
            out[name] = value.astype(np.float32).astype(dtype)
    return hf, out


# ---- the cache ------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cached(label: str, key: str, build) -> Path:
    """cache_root()/label-key, made by build(dir) once. build writes into a fresh temporary
    directory that is renamed into place only when complete (with its marker), so an interrupted
    or concurrent build never leaves a directory that is later used."""
    root = cache_root()
    final = root / f"{label}-{key}"
    if (final / COMPLETE_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".tmp-{label}-{key}-*"):  # left by a build whose process is gone
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    if final.exists():  # not ours (no marker): never used
        shutil.rmtree(final, ignore_errors=True)
    tmp = root / f".tmp-{label}-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        d = tmp / "d"
        build(d)
        (d / COMPLETE_MARKER).write_text(json.dumps({"name": label, "key": key,
                                                     "format": FORMAT_VERSION}) + "\n")
        try:
            os.rename(d, final)
        except OSError:
            if not (final / COMPLETE_MARKER).is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_compact(kind: str, d: Path) -> None:
    from safetensors.numpy import save_file

    from jspec.tokenizer import write_qwen3_tokenizer
    hf, weights = read_packed(kind, np.float32)
    dtype, name = (BF16, "bfloat16") if all(exact_in(w, BF16) for w in weights.values()) \
        else (np.float32, "float32")
    d.mkdir(parents=True)
    save_file({k: w.astype(dtype) for k, w in weights.items()}, d / "model.safetensors",
              metadata={"format": "pt"})
    hf = dict(hf, torch_dtype=name)
    if "dtype" in hf:
        hf["dtype"] = name
    (d / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    src = package_dir() / kind / GENERATION_CONFIG
    if src.is_file():
        shutil.copy2(src, d / GENERATION_CONFIG)
    if kind == "target":
        write_qwen3_tokenizer(d)


def compact_dir(name: str) -> Path:
    """The dequantized compact Hugging Face directory of a stand-in name (S's own rows: config.json
    unchanged but for its dtype, model.safetensors = q * scale in bfloat16 when exact there, else
    float32; the target's also with generation_config.json and the Qwen3 tokenizer). This is what
    the 8B graft grafts from (its default bfloat16 output rounds float32 weights)."""
    kind = check_name(name)
    return _cached(f"compact-{kind}", _pack_hash(kind), lambda d: _write_compact(kind, d))


def _expand_source_hash() -> str:
    import jspec.convert.expand_vocab as ev
    return _file_hash(Path(ev.__file__))


def expanded_dir(name: str) -> Path:
    """The standard directory of a stand-in name, with the full Qwen3 vocabulary."""
    from jspec.convert import expand_vocab
    kind = check_name(name)
    base = [f"{FORMAT}/{FORMAT_VERSION}", EXPANDED_DTYPE, _expand_source_hash(), _pack_hash("target")]
    if kind == "target":
        src = compact_dir("standin")
        return _cached(name, _key(*base), lambda d: expand_vocab.expand_target(
            src, d, vocab_size=QWEN3_VOCAB, dtype=EXPANDED_DTYPE))
    target_src, src = compact_dir("standin"), compact_dir(name)
    return _cached(name, _key(*base, _pack_hash(kind)), lambda d: expand_vocab.expand_drafter(
        src, d, target_src, vocab_size=QWEN3_VOCAB, mask_token_id=QWEN3_MASK_ID,
        dtype=EXPANDED_DTYPE))


def resolve(name_or_path) -> Path:
    """A stand-in name -> its built directory; anything else is a path, returned as a Path."""
    s = os.fspath(name_or_path)
    if s in NAMES:
        return expanded_dir(s)
    if _looks_like_name(s) and not Path(s).exists():
        check_name(s)  # raises: an unknown name
    return Path(name_or_path)


def resolve_model(name_or_path) -> Path:
    s = os.fspath(name_or_path)
    if s in NAMES and NAMES[s] != "target":
        raise ConfigError(f"{s!r} is a drafter; the stand-in target is 'standin'")
    return resolve(name_or_path)


def resolve_drafter(name_or_path) -> Path:
    s = os.fspath(name_or_path)
    if s in NAMES and NAMES[s] == "target":
        raise ConfigError("'standin' is the target; its drafters are 'standin-dspark' and "
                          "'standin-dflash'")
    return resolve(name_or_path)


def source_dir(name_or_path) -> Path:
    """For tools that work on S's own rows (the 8B graft): a name -> compact_dir, else the path."""
    s = os.fspath(name_or_path)
    if s in NAMES:
        return compact_dir(s)
    if _looks_like_name(s) and not Path(s).exists():
        check_name(s)
    return Path(name_or_path)


# ---- demo prompts ---------------------------------------------------------------------------------

DEMO_PROMPTS = Path(__file__).resolve().parent / "assets" / "humaneval_demo.jsonl"


def demo_prompts() -> list[str]:
    """HumanEval/0, /2 and /4 (openai/human-eval, MIT) as user turns, the lines of
    ../shared/data/prompts/humaneval.jsonl (DeepSpec's conversion) that the benchmark uses."""
    return [json.loads(line)["turns"][0] for line in DEMO_PROMPTS.read_text().splitlines() if line]


# ---- command line ---------------------------------------------------------------------------------

def _print_report(report: list[dict], out: Path) -> None:
    print(f"{'model':7} {'tensor':48} {'shape':>14} {'max rel err':>12} {'rel fro err':>12}")
    for r in report:
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['model']:7} {r['tensor']:48} {shape:>14} {r['max_rel_err']:12.3e} "
              f"{r['rel_fro_err']:12.3e}")
    worst = max(report, key=lambda r: r["max_rel_err"])
    print(f"worst max relative error {worst['max_rel_err']:.3e} ({worst['model']} {worst['tensor']})")
    for sub in sorted(p for p in out.iterdir() if p.is_dir()):
        print(f"{sub.name}: {packed_size(sub) / 1e6:.2f} MB")
    print(f"total {packed_size(out) / 1e6:.2f} MB in {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jspec.standin", description="The stand-in pair's "
                                "int8 package: pack it, or print the directories its names resolve to.")
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="S + drafters (HF / DeepSpec directories, compact vocabulary) "
                        "-> the int8 package")
    pk.add_argument("--target", required=True, help="S: the compact Qwen3 target directory")
    pk.add_argument("--dspark", required=True, help="S's DSpark drafter directory")
    pk.add_argument("--dflash", help="S's DFlash drafter directory (optional)")
    pk.add_argument("--out", required=True, help="output directory (e.g. jspec/assets/standin)")
    pk.add_argument("--check", action="store_true", help="print each tensor's quantisation error "
                    "and the sizes")
    pk.add_argument("--pow2-scales", action="store_true", help="scales rounded up to a power of "
                    "two instead of to bfloat16: q * s then exact in bfloat16 too, at up to one "
                    "bit less int8 resolution")
    pk.add_argument("--force", action="store_true", help="replace an existing --out")
    pa = sub.add_parser("path", help="build (once) and print the directory a name resolves to")
    pa.add_argument("name", choices=list(NAMES))
    pa.add_argument("--compact", action="store_true", help="the dequantized compact directory "
                    "(S's rows) instead of the full-vocabulary one")
    args = p.parse_args(argv)
    try:
        if args.command == "pack":
            report = pack(args.target, args.dspark, args.out, args.dflash,
                          pow2=args.pow2_scales, force=args.force)
            if args.check:
                _print_report(report, Path(args.out))
            else:
                print(f"wrote {args.out} ({packed_size(args.out) / 1e6:.2f} MB)")
        else:
            print(compact_dir(args.name) if args.compact else expanded_dir(args.name))
        return 0
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"standin: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
