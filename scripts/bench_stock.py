"""Stock (non-speculative) decode throughput of the paged engine at Qwen3-8B shape, random bf16
weights, against the HBM bound measured in the same run.

  python3 scripts/bench_stock.py --out $OUT/stock.json [--lanes 1,16,32] [--contexts 512,4096]

Decode rate: lanes sit at the given context length (pages allocated, cache contents random) and
`decode_steps` tokens per lane run per dispatch; tokens/s = lanes x steps / median dispatch time.
Bytes a batch-1 step must read = every weight except the embedding table (a gather of one row)
+ the K/V of the context. Copy bandwidth = a device-to-device copy (read + write counted).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")


def copy_bandwidth(jax, jnp, gib=4):
    x = jnp.ones((gib * 2**30 // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))  # one read + one write of every byte
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--lanes", default="1,16,32")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jspec.config import PRESETS
    from jspec.engine import Engine, EngineConfig
    from jspec.qwen3 import init_random
    from jspec.sampling import SamplingArrays
    from jspec.steps import DecodeState

    cfg = PRESETS[args.preset].replace(dtype="bfloat16")
    rec = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "preset": args.preset,
           "attn_impl": args.attn_impl, "decode_steps": args.decode_steps,
           "page_size": args.page_size, "temperature": args.temperature, "runs": []}
    bw = copy_bandwidth(jax, jnp)
    rec["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    t0 = time.time()
    model = init_random(cfg, seed=0)
    params = nnx.state(model)
    jax.block_until_ready(params)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    embed_bytes = model.embed_tokens[...].nbytes
    rec["weight_bytes"] = weight_bytes
    rec["init_s"] = time.time() - t0
    lanes_list = [int(x) for x in args.lanes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2

    # One engine (one pool) for every context, so each lane count compiles once.
    max_lanes = max(lanes_list)
    ecfg = EngineConfig(max_lanes=max_lanes, page_size=args.page_size,
                        max_context=max(contexts) + args.decode_steps + args.page_size,
                        decode_steps=args.decode_steps, attn_impl=args.attn_impl)
    eng = Engine(cfg, model, eos_ids=(), engine_cfg=ecfg)
    # Random K/V so attention reads real-looking data (never time on zeros).
    key = jax.random.key(1)
    eng.caches = [tuple(jax.random.normal(jax.random.fold_in(key, i), c.shape, c.dtype)
                        for c in pair) for i, pair in enumerate(eng.caches)]
    ppl = ecfg.pages_per_lane
    for ctx in contexts:
        for lanes in lanes_list:
            page_table = np.zeros((max_lanes, ppl), np.int32)
            for b in range(lanes):
                page_table[b] = 1 + b * ppl + np.arange(ppl)
            active = np.arange(max_lanes) < lanes
            # A program with exactly `lanes` lanes (what a batch-1 server runs).
            page_table, active = page_table[:lanes], active[:lanes]
            n = len(active)
            state = DecodeState(
                tokens=jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, n), jnp.int32),
                lengths=jnp.full((n,), ctx, jnp.int32),
                page_table=jnp.asarray(page_table),
                active=jnp.asarray(active),
                remaining=jnp.full((n,), 10**6, jnp.int32),
                stop_on_eos=jnp.zeros((n,), bool),
                sampling=SamplingArrays.from_lists([args.temperature] * n, seed=list(range(n))),
            )
            caches = eng.caches
            t = time.perf_counter()
            caches, _, toks, _ = eng.programs.decode(eng.params, caches, state, num_steps=args.decode_steps)
            toks.block_until_ready()
            compile_s = time.perf_counter() - t
            times = []
            for _ in range(5):
                t = time.perf_counter()
                caches, _, toks, _ = eng.programs.decode(eng.params, caches, state,
                                                         num_steps=args.decode_steps)
                toks.block_until_ready()
                times.append(time.perf_counter() - t)
            eng.caches = caches
            step_s = sorted(times)[len(times) // 2] / args.decode_steps
            step_bytes = weight_bytes - embed_bytes + lanes * ctx * kv_bytes_per_token
            run = {"lanes": lanes, "context": ctx, "step_ms": step_s * 1e3,
                   "tokens_per_s": lanes / step_s, "compile_s": compile_s,
                   "bytes_per_step": step_bytes, "hbm_bound_step_ms": step_bytes / bw * 1e3,
                   "fraction_of_hbm_bound": (step_bytes / bw) / step_s}
            rec["runs"].append(run)
            print(json.dumps(run), flush=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=2)
    print("| lanes | context | step ms | tokens/s | HBM-bound ms | fraction of bound |")
    print("|---|---|---|---|---|---|")
    for r in rec["runs"]:
        print(f"| {r['lanes']} | {r['context']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['hbm_bound_step_ms']:.2f} | {r['fraction_of_hbm_bound']:.2f} |")


if __name__ == "__main__":
    main()
