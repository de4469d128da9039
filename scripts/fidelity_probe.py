"""Fixed-text fidelity alone (the bench's first gate, without the workloads): teacher-force fixed
texts through stock decode (q_len 1) and speculative verify (blocks of K+1) and report the mean
and max |d log p|. For trying numerics options quickly (run it under different XLA_FLAGS).

  python3 scripts/fidelity_probe.py --model standin --draft standin-dspark --texts 8 --out f.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="standin")
    ap.add_argument("--draft", default="standin-dspark")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--label", default="")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig.batch_invariant")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import jax

    from jspec.bench import workloads as W
    from jspec.engine import Engine, EngineConfig
    from jspec.loading import load_drafter, load_model
    from jspec.scoring import verify_minus_decode
    from jspec.standin import resolve_drafter, resolve_model
    from jspec.tokenizer import Tokenizer

    t0 = time.time()
    model_dir, draft_dir = resolve_model(args.model), resolve_drafter(args.draft)
    tok = Tokenizer.from_dir(model_dir)
    cfg, model = load_model(model_dir, dtype=args.dtype)
    dcfg, drafter = load_drafter(draft_dir, cfg, model)
    width = dcfg.block_size + 1
    length = -(-args.tokens // width) * width
    fixed = W.fixed_texts(tok, W.prompt_texts(), args.texts, length)
    ctx = max(len(p) + len(c) for p, c in fixed) + 2 * width
    ecfg = EngineConfig(max_lanes=1, page_size=16, max_context=ctx, attn_impl=args.attn_impl,
                        batch_invariant=args.batch_invariant)
    stock = Engine(cfg, model, tok.eos_ids, ecfg)
    spec = Engine(cfg, model, tok.eos_ids, ecfg, drafter=drafter, draft_cfg=dcfg)
    d = np.abs(verify_minus_decode(stock, spec, fixed))
    rec = {"label": args.label, "batch_invariant": args.batch_invariant,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": str(model_dir),
           "dtype": args.dtype, "texts": args.texts, "tokens": int(d.size),
           "mean": float(d.mean()), "max": float(d.max()), "exact_share": float((d == 0).mean()),
           "backend": jax.devices()[0].platform, "wall_s": time.time() - t0}
    print(json.dumps(rec))
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
