"""What one prefill chunk costs: the engine's own prefill program, timed alone, at several chunk
sizes and cached lengths (busy prefills 64 prompts of 3,000+ tokens a pass, about 6.6 of its
11-12 s, in both engines; docs/benchmarks.md).

    python3 scripts/bench_prefill.py --out $OUT/prefill.json                 # 8B shape, stock
    python3 scripts/bench_prefill.py --out $OUT/prefill.json --spec --batch-invariant \\
        --draft-kv-dtype float8_e4m3fn --chunks 512,1024 --starts 0,1024,2048,3072

Random bf16 weights at the preset's shape, one lane whose pages hold random K/V, the chunk's
tokens written at positions start..start+chunk-1 (the same call `Engine._launch_prefill`
makes; with --spec, the speculative engine's prefill, which also writes the drafter's context).
Each row: median ms of one chunk over --reps calls queued back to back (the host does not
wait between them, as admission does not), tokens/s, and TFLOP/s by count:
  matmuls    2 x (target parameters without the embedding and the lm_head) x chunk, plus the
             lm_head for one row (the token after the chunk)
  attention  4 x chunk x (start + (chunk + 1) / 2) x q heads x head_dim x layers (causal)
The attention's share is what the chunk costs beyond its start = 0 row, as an estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def prefill_flops(cfg, chunk: int, start: int) -> dict:
    """Matmul and attention FLOPs of one chunk of `chunk` tokens after `start` cached ones."""
    d, hq, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * (hq + 2 * hkv) * hd + hq * hd * d + 3 * d * cfg.intermediate_size
    matmul = 2 * chunk * per_layer * cfg.num_layers + 2 * d * cfg.vocab_size
    attention = 4 * chunk * (start + (chunk + 1) / 2) * hq * hd * cfg.num_layers
    return {"matmul": float(matmul), "attention": float(attention)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--chunks", default="256,512,1024", help="prefill chunk sizes (rows)")
    ap.add_argument("--starts", default="0,1024,2048,3072", help="tokens already cached")
    ap.add_argument("--reps", type=int, default=10, help="chunks queued per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings (median)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--spec", action="store_true", help="the speculative engine's prefill")
    ap.add_argument("--draft-kv-dtype", choices=["float8_e4m3fn"], default=None)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--taps", default="1,9,17,25,33")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jspec.config import PRESETS
    from jspec.dspark import dspark_8b_like_config, init_random_drafter
    from jspec.engine import Engine, EngineConfig
    from jspec.qwen3 import init_random
    from jspec.sampling import SamplingArrays

    cfg = PRESETS[args.preset].replace(dtype="bfloat16")
    chunks = [int(c) for c in args.chunks.split(",")]
    starts = [int(s) for s in args.starts.split(",")]
    rec = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "preset": args.preset,
           "spec": args.spec, "batch_invariant": args.batch_invariant,
           "attn_impl": args.attn_impl, "page_size": args.page_size, "rows": []}

    target = init_random(cfg, seed=0)
    drafter = dcfg = None
    if args.spec:
        dcfg = dspark_8b_like_config(cfg, args.draft_layers,
                                     tuple(int(t) for t in args.taps.split(",")))
        drafter = init_random_drafter(dcfg, seed=1)
    jax.block_until_ready(nnx.state(target))

    for chunk in chunks:
        ecfg = EngineConfig(max_lanes=1, page_size=args.page_size,
                            max_context=max(starts) + chunk + args.page_size,
                            prefill_chunk=chunk, prefill_buckets=False, attn_impl=args.attn_impl,
                            batch_invariant=args.batch_invariant, draft_kv_dtype=args.draft_kv_dtype)
        eng = Engine(cfg, target, (), ecfg, drafter=drafter, draft_cfg=dcfg)
        row = jnp.asarray(1 + np.arange(ecfg.pages_per_lane, dtype=np.int32))
        sampling = SamplingArrays.from_lists([1.0], [0], [1.0], [0])
        tokens = jnp.asarray(np.random.default_rng(chunk).integers(0, min(cfg.vocab_size, 150000),
                                                                   chunk), jnp.int32)
        for start in starts:
            def run():
                out = None
                for _ in range(args.reps):
                    eng.caches, out, _ = eng.programs.prefill(
                        eng.params, eng.caches, tokens, jnp.int32(start), jnp.int32(chunk), row,
                        sampling)
                jax.block_until_ready(out)

            run()  # compile + warm-up
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                run()
                times.append((time.perf_counter() - t) / args.reps)
            s = statistics.median(times)
            flops = prefill_flops(cfg, chunk, start)
            r = {"chunk": chunk, "start": start, "ms": s * 1e3, "tokens_per_s": chunk / s,
                 "tflops": (flops["matmul"] + flops["attention"]) / s / 1e12,
                 "matmul_tflop": flops["matmul"] / 1e12, "attention_tflop": flops["attention"] / 1e12}
            base = next((x for x in rec["rows"] if x["chunk"] == chunk and x["start"] == 0), None)
            if base is not None and start > 0:
                r["ms_beyond_start_0"] = r["ms"] - base["ms"]
            rec["rows"].append(r)
            print(json.dumps(r), flush=True)
            with open(args.out, "w") as f:
                json.dump(rec, f, indent=1)
        del eng

    print("| chunk | cached | ms | tokens/s | TFLOP/s by count | ms beyond cached 0 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rec["rows"]:
        extra = r.get("ms_beyond_start_0")
        print(f"| {r['chunk']} | {r['start']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops']:.0f} | {'-' if extra is None else f'{extra:.2f}'} |")
    return rec


if __name__ == "__main__":
    main()
