"""Write a random Qwen3 checkpoint (Hugging Face layout, sharded safetensors + index).

For cost measurements only: random weights say nothing about acceptance or quality. Uses torch
(on the GPU when there is one) to draw the weights fast; never commit the output.

  python scripts/make_random_qwen3.py --preset qwen3-8b --out /tmp/qwen3-8b-random
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHARD_BYTES = 4 * 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from jspec.config import PRESETS
    from jspec.qwen3 import checkpoint_shapes

    cfg = PRESETS[args.preset].replace(dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    shards, current, size = [], {}, 0
    for name, (shape, _) in checkpoint_shapes(cfg).items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        current[name] = t.to(dtype).cpu()
        size += current[name].numel() * current[name].element_size()
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    print(f"wrote {len(weight_map)} tensors in {len(shards)} shards to {out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
