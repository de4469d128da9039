"""Step costs at Qwen3-8B shape (random bf16 weights): stock decode vs one speculative iteration
(DSpark-8B-shaped drafter: 5 layers, taps [1, 9, 17, 25, 33], Markov rank 256), plus draft-only
and verify-only times, device memory of the drafter and its cache, and the HBM bound.

  python3 scripts/bench_steps.py --out $OUT/steps.json [--lanes 1,16,32] [--contexts 512,4096]
                                [--draft-kv-dtype float8_e4m3fn] [--draft-weight-dtype int8]
                                [--draft-linear xla,triton]

`speculation_extra_bytes_at` is the issue's memory target read off the record: drafter weights
plus the drafter's KV cache for 32 lanes x 4096 tokens, in the pool's actual dtype.

Lanes sit at the given context length with random K/V; every figure is the median of timed
dispatches of `--steps` steps (or iterations) after a compile + warm-up dispatch. Results are
written to the JSON after every measurement, so a run cut short still returns what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--lanes", default="1,16,32")
    ap.add_argument("--spec-lanes", default="1,16,32")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off (Qwen3's default: 20)")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off (Qwen3's default: 0.8)")
    ap.add_argument("--candidate-top-k", type=int, default=None,
                    help="jspec.sampling.CANDIDATE_TOP_K (0: small top-k by bit search too)")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--taps", default="1,9,17,25,33")
    ap.add_argument("--skip-stock", action="store_true")
    ap.add_argument("--skip-spec", action="store_true", help="stock steps only")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig.batch_invariant")
    ap.add_argument("--draft-kv-dtype", choices=["float8_e4m3fn"],
                    help="EngineConfig.draft_kv_dtype (default: the model dtype)")
    ap.add_argument("--draft-weight-dtype", choices=["int8"],
                    help="EngineConfig.draft_weight_dtype (default: the model dtype)")
    ap.add_argument("--draft-linear", default="xla", help="EngineConfig.draft_linear, a list: "
                    "one speculative engine per route of the drafter's matmuls (xla, triton)")
    ap.add_argument("--draft-vocab", type=int, help="EngineConfig.draft_vocab: the drafter "
                    "proposes from N ids (here the first N)")
    ap.add_argument("--skip-iteration", action="store_true", help="only the draft / verify split")
    ap.add_argument("--split-lanes", default="1", help="lane counts at which draft and verify "
                    "are also timed alone (at the first context)")
    ap.add_argument("--num-draft", default="7", help="drafts verified per iteration, a list: one "
                    "speculative engine per value (the verify width's cost curve)")
    ap.add_argument("--verify-rules", default="block", help="accept rules, a list: one "
                    "speculative engine per rule and drafts count (EngineConfig.verify_rule)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jspec.config import PRESETS
    from jspec.dspark import dspark_8b_like_config, init_random_drafter
    from jspec.engine import Engine, EngineConfig
    from jspec.qwen3 import init_random
    from jspec import sampling as sampling_module
    from jspec.sampling import SamplingArrays
    if args.candidate_top_k is not None:  # before any program is traced
        sampling_module.CANDIDATE_TOP_K = args.candidate_top_k
    from jspec.steps import DecodeState

    cfg = PRESETS[args.preset].replace(dtype="bfloat16")
    rec = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "preset": args.preset,
           "attn_impl": args.attn_impl, "steps_per_dispatch": args.steps,
           "page_size": args.page_size, "temperature": args.temperature,
           "top_k": args.top_k, "top_p": args.top_p,
           "candidate_top_k": sampling_module.CANDIDATE_TOP_K,
           "draft_kv_dtype": args.draft_kv_dtype, "draft_vocab": args.draft_vocab,
           "draft_weight_dtype": args.draft_weight_dtype,
           "stock": [], "spec": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=2)

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    def median_time(fn, reps=5):
        fn()  # compile + warm-up
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return median(ts)

    def dispatch_times(call, reps=5):
        """(median s per dispatch, median s until the jitted call returned: the host's launch
        work, which sets the pace when it nears the dispatch time). call() returns the tokens."""
        returned = []

        def run():
            t = time.perf_counter()
            toks = call()
            returned.append(time.perf_counter() - t)
            toks.block_until_ready()

        return median_time(run, reps), median(returned[1:])  # [0]: the warm-up

    # The bench's own measure (in-place sweeps in one jitted loop): a one-sweep, host-timed
    # `a + 1` read 2.6-2.9 TB/s on the H200 and flattered the HBM-bound fraction.
    from jspec.bench.run import copy_bandwidth, triton_route
    bw = copy_bandwidth(2 * 2**30 if jax.default_backend() != "cpu" else 64 * 2**20)
    rec["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    t0 = time.time()
    target = init_random(cfg, seed=0)
    dcfg = dspark_8b_like_config(cfg, args.draft_layers, tuple(int(t) for t in args.taps.split(",")))
    drafter = init_random_drafter(dcfg, seed=1)
    jax.block_until_ready((nnx.state(target), nnx.state(drafter)))
    rec["init_s"] = time.time() - t0
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(nnx.state(target)))
    embed_bytes = target.embed_tokens[...].nbytes
    rec["target_weight_bytes"] = weight_bytes
    rec["drafter_weight_bytes"] = sum(a.nbytes for a in jax.tree.leaves(nnx.state(drafter)))
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    lanes_all = sorted({int(v) for v in (args.lanes + "," + args.spec_lanes).split(",")})
    contexts = [int(c) for c in args.contexts.split(",")]
    max_lanes = max(lanes_all)

    def random_caches(caches, seed):
        key = jax.random.key(seed)

        def normal(k, c):  # an fp8 pool: fp32 normals rounded (8 random bits are too coarse)
            draw = jnp.float32 if c.dtype.itemsize == 1 else c.dtype
            return jax.random.normal(k, c.shape, draw).astype(c.dtype)

        return [tuple(normal(jax.random.fold_in(key, 2 * i + j), c) for j, c in enumerate(pair))
                for i, pair in enumerate(caches)]

    def state_for(eng, lanes, ctx):
        ppl = eng.ecfg.pages_per_lane
        table = np.zeros((lanes, ppl), np.int32)
        for b in range(lanes):
            table[b] = 1 + b * ppl + np.arange(ppl)
        return DecodeState(
            tokens=jnp.asarray(np.random.default_rng(0).integers(0, 150000, lanes), jnp.int32),
            lengths=jnp.full((lanes,), ctx, jnp.int32), page_table=jnp.asarray(table),
            active=jnp.ones((lanes,), bool), remaining=jnp.full((lanes,), 10**6, jnp.int32),
            stop_on_eos=jnp.zeros((lanes,), bool),
            sampling=SamplingArrays.from_lists([args.temperature] * lanes, [args.top_k] * lanes,
                                               [args.top_p] * lanes, seed=list(range(lanes))))

    def ecfg_for(width, verify_rule="block", draft_linear="xla"):
        return EngineConfig(verify_rule=verify_rule, draft_linear=draft_linear,
                            max_lanes=max_lanes, page_size=args.page_size,
                            max_context=max(contexts) + (args.steps + 1) * width,
                            decode_steps=args.steps, attn_impl=args.attn_impl,
                            batch_invariant=args.batch_invariant,
                            draft_kv_dtype=args.draft_kv_dtype, draft_vocab=args.draft_vocab,
                            draft_weight_dtype=args.draft_weight_dtype)

    if not args.skip_stock:
        eng = Engine(cfg, target, (), ecfg_for(1))
        eng.caches = random_caches(eng.caches, 1)
        for lanes in [int(v) for v in args.lanes.split(",")]:
            for ctx in contexts:
                state = state_for(eng, lanes, ctx)

                def call():
                    eng.caches, _, toks, _ = eng.programs.decode(eng.params, eng.caches, state,
                                                                 num_steps=args.steps)
                    return toks

                t = time.perf_counter()
                dispatch_s, returned_s = dispatch_times(call)
                step_s = dispatch_s / args.steps
                step_bytes = weight_bytes - embed_bytes + lanes * ctx * kv_token_bytes
                # Until the jitted call returns: the host's launch work when it nears step_ms.
                r = {"lanes": lanes, "context": ctx, "step_ms": step_s * 1e3,
                     "call_ms_per_step": returned_s / args.steps * 1e3,
                     "tokens_per_s": lanes / step_s, "bench_s": time.perf_counter() - t,
                     "hbm_bound_ms": step_bytes / bw * 1e3,
                     "fraction_of_hbm_bound": step_bytes / bw / step_s}
                rec["stock"].append(r)
                print("stock", json.dumps(r), flush=True)
                save()
        del eng

    if args.skip_spec:
        rec["triton_route"] = triton_route()
        save()
        print(json.dumps(rec["stock"]))
        return
    def spec_engine_rows(num_draft, verify_rule, draft_linear):
        """Time the speculative iteration of an engine that verifies `num_draft` drafts,
        accepts them by `verify_rule` and runs the drafter's matmuls on `draft_linear`."""
        # Random weights have no frequencies: the draft vocabulary is the first N ids (its cost is
        # what is timed here, not its acceptance).
        eng = Engine(cfg, target, (), ecfg_for(8, verify_rule, draft_linear), drafter=drafter,
                     draft_cfg=dcfg,
                     num_draft=num_draft,
                     draft_vocab_ids=range(cfg.vocab_size))
        eng.caches = (random_caches(eng.caches[0], 2), random_caches(eng.caches[1], 3))
        # From the pools the engine built (their dtypes), not from the model dtype.
        rec["draft_cache_dtype"] = str(eng.draft_cache_shape.dtype)
        rec["draft_cache_bytes_per_token"] = eng.draft_cache_shape.token_bytes
        rec["target_cache_bytes_per_token"] = eng.cache_shape.token_bytes
        # The drafter's weights as the engine holds them (int8 with --draft-weight-dtype int8),
        # plus what it adds beside the target: a draft vocabulary's rows, an int8 head copy.
        rec["engine_drafter_weight_bytes"] = sum(a.nbytes for a in jax.tree.leaves(eng.params[1:]))
        extra_lanes, extra_ctx = 32, 4096  # the target: <= 4 GiB at 32 lanes x 4096 tokens
        extra_cache = extra_lanes * extra_ctx * rec["draft_cache_bytes_per_token"]
        rec["speculation_extra_bytes_at"] = {
            "lanes": extra_lanes, "context": extra_ctx,
            "drafter_weight_bytes": rec["engine_drafter_weight_bytes"],
            "draft_cache_bytes": extra_cache,
            "bytes": rec["engine_drafter_weight_bytes"] + extra_cache,
            "GiB": (rec["engine_drafter_weight_bytes"] + extra_cache) / 2**30}
        x = rec["speculation_extra_bytes_at"]
        print(f"speculation_extra_bytes_at {extra_lanes} lanes x {extra_ctx} tokens: {x['bytes']} "
              f"({x['GiB']:.2f} GiB = drafter weights {x['drafter_weight_bytes'] / 2**30:.2f} GiB + "
              f"drafter KV {extra_cache / 2**30:.2f} GiB at {rec['draft_cache_bytes_per_token']} "
              f"bytes/token in {rec['draft_cache_dtype']})", flush=True)
        save()
        # Caches donated and returned, as inside the iteration: otherwise every call copies the pool.
        draft_only = jax.jit(lambda p, dc, st: eng.programs.draft(*eng.programs.models(p), dc, st,
                                                                  eng.programs.draft_vocab(p),
                                                                  eng.programs.draft_head(p)),
                             donate_argnums=(1,))
        verify_only = jax.jit(lambda p, tc, st, d: eng.programs.verify(
            eng.programs.models(p)[0], tc, st, d)[:2], donate_argnums=(1,))
        for lanes in [int(v) for v in args.spec_lanes.split(",")]:
            for ctx in contexts:
                state = state_for(eng, lanes, ctx)

                def call():
                    eng.caches, _, toks, *_ = eng.programs.decode(eng.params, eng.caches, state,
                                                                    num_steps=args.steps)
                    return toks

                t = time.perf_counter()
                r = {"lanes": lanes, "context": ctx, "num_draft": num_draft, "verify_rule": verify_rule,
                     "draft_linear": draft_linear, "verify_rows": lanes * (num_draft + 1)}
                if not args.skip_iteration:
                    dispatch_s, returned_s = dispatch_times(call)
                    r["iteration_ms"] = dispatch_s / args.steps * 1e3
                    r["call_ms_per_iteration"] = returned_s / args.steps * 1e3
                split_lanes = [int(v) for v in args.split_lanes.split(",") if v]
                if lanes in split_lanes and ctx == contexts[0]:  # the split costs two more compiles
                    drafts = jnp.zeros((lanes, eng.num_draft), jnp.int32)

                    def run_draft():
                        dc, toks, _, _ = draft_only(eng.params, eng.caches[1], state)
                        eng.caches = (eng.caches[0], dc)
                        toks.block_until_ready()

                    def run_verify():
                        tc, logits = verify_only(eng.params, eng.caches[0], state, drafts)
                        eng.caches = (tc, eng.caches[1])
                        logits.block_until_ready()

                    r["draft_ms"] = median_time(run_draft) * 1e3
                    r["verify_ms"] = median_time(run_verify) * 1e3
                stock = [s for s in rec["stock"] if s["lanes"] == lanes and s["context"] == ctx]
                if stock and "iteration_ms" in r:
                    r["iteration_over_stock_step"] = r["iteration_ms"] / stock[0]["step_ms"]
                r["bench_s"] = time.perf_counter() - t
                rec["spec"].append(r)
                print("spec", json.dumps(r), flush=True)
                save()
        del eng

    for num_draft in [int(v) for v in args.num_draft.split(",")]:
        for verify_rule in args.verify_rules.split(","):
            for draft_linear in args.draft_linear.split(","):
                spec_engine_rows(num_draft, verify_rule, draft_linear)
    stats = jax.devices()[0].memory_stats() or {}
    rec["peak_device_bytes"] = stats.get("peak_bytes_in_use")
    rec["triton_route"] = triton_route()
    save()
    print("| lanes | ctx | drafts | rule | drafter matmuls | stock step ms | stock tok/s | HBM-bound fraction | spec iteration ms | draft ms | verify ms | iteration / stock step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rec["spec"] or [{}]:
        s = next((x for x in rec["stock"] if x["lanes"] == r.get("lanes") and x["context"] == r.get("context")), {})
        print(f"| {r.get('lanes', s.get('lanes'))} | {r.get('context', s.get('context'))} | {r.get('num_draft', '-')} | {r.get('verify_rule', '-')} | {r.get('draft_linear', '-')} | {s.get('step_ms', float('nan')):.2f} | "
              f"{s.get('tokens_per_s', float('nan')):.0f} | {s.get('fraction_of_hbm_bound', float('nan')):.2f} | "
              f"{r.get('iteration_ms', float('nan')):.2f} | {r.get('draft_ms', float('nan')):.2f} | "
              f"{r.get('verify_ms', float('nan')):.2f} | {r.get('iteration_over_stock_step', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
