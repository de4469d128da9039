"""Benchmark ragged paged attention on a GPU: Triton kernel vs XLA reference vs Pallas baseline.

    python scripts/bench_attention.py --out bench_attention.json            # ~1-2 min on an H200
    python scripts/bench_attention.py --out sweep.json --sweep              # + tiling sweep,
                                                      ~5-8 min, stops sweeping at --budget-s
    python scripts/bench_attention.py --out pf.json --prefill-sweep         # busy's prefill chunk

Measures device-to-device copy bandwidth first (read + write counted), then for each scenario
(Qwen3-8B attention: 32 q heads, 8 kv heads, D 128, bf16) the median time of one call, the KV
bytes the call must read (sum of kv_len x Hkv x D x 2 (K and V) x 2 bytes), the achieved KV-read
bandwidth and its fraction of the copy bandwidth. Each timed dispatch runs INNER calls on
distinct q arrays inside one jit (no host dispatch gap between kernels, nothing for XLA to
merge); the median over REPEATS dispatches is divided by INNER.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.kernels.ragged_paged_attention import ragged_paged_attention_xla

HQ, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16


def timeit(fn, *args, repeats: int = 10) -> float:
    """Median seconds of fn(*args) over warm repeats (fn already jitted)."""
    jax.block_until_ready(fn(*args))  # compile + warm
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gib: float = 2.0) -> dict:
    """The copy bandwidth (read + write counted) as `jspec bench` and bench_steps.py measure it
    (jspec.bench.run.copy_bandwidth: looped, in place), so the three report against one bound."""
    from jspec.bench.run import copy_bandwidth as looped_copy_bandwidth
    tb_s = looped_copy_bandwidth(int(gib * 2**30)) / 1e12
    return {"looped_in_place": tb_s, "best_tb_s": tb_s}


def make_inputs(num_lanes, ctx, q_len, page_size, inner, seed=0):
    """Full-length lanes (kv_len = ctx) on a shuffled page pool; `inner` distinct q arrays."""
    rng = np.random.default_rng(seed)
    pages_per_lane = -(-ctx // page_size)
    num_pages = 1 + num_lanes * pages_per_lane
    page_table = (1 + rng.permutation(num_lanes * pages_per_lane)).reshape(
        num_lanes, pages_per_lane).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed), inner + 2)
    k_pages = jax.random.normal(keys[0], (num_pages, page_size, HKV, D), DTYPE)
    v_pages = jax.random.normal(keys[1], (num_pages, page_size, HKV, D), DTYPE)
    qs = tuple(jax.random.normal(k, (num_lanes * q_len, HQ, D), DTYPE) for k in keys[2:])
    kv_lens = jnp.full((num_lanes,), ctx, jnp.int32)
    cu_q_lens = jnp.arange(num_lanes + 1, dtype=jnp.int32) * q_len
    return qs, k_pages, v_pages, kv_lens, jnp.asarray(page_table), cu_q_lens


def looped(attn):
    """One jit that runs attn once per q in qs (distinct inputs: XLA cannot merge the calls)."""
    return jax.jit(lambda qs, *rest: [attn(q, *rest) for q in qs])


def pallas_paged_attention_fn(page_size, pages_per_lane):
    """jax.experimental.pallas.ops.gpu.paged_attention (decode only; [Hkv, P, S, D] layout)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as pa
    k_splits = 16 if pages_per_lane % 16 == 0 else 1
    ppcb = max(1, min(8, pages_per_lane // k_splits))

    def attn(q, k_hpsd, v_hpsd, kv_lens, page_table):
        return pa.paged_attention(q * (D ** -0.5), k_hpsd, v_hpsd, page_table, kv_lens,
                                  k_splits=k_splits, pages_per_compute_block=ppcb)
    return attn


def run_scenario(name, num_lanes, ctx, q_len, page_size, copy_tb_s, *, inner, repeats,
                 triton_configs, with_xla=True, with_pallas=True, deadline=float("inf")):
    from jspec.kernels.ragged_paged_attention_triton import (_device_num_sms, _plan_for,
                                                             ragged_paged_attention_triton)
    qs, k_pages, v_pages, kv_lens, page_table, cu_q_lens = make_inputs(
        num_lanes, ctx, q_len, page_size, inner)
    rest = (k_pages, v_pages, kv_lens, page_table, cu_q_lens)
    kv_bytes = int(np.sum(np.asarray(kv_lens))) * HKV * D * 2 * jnp.dtype(DTYPE).itemsize
    flops = 4 * num_lanes * q_len * ctx * HQ * D  # QK^T and PV, no causal discount
    kw = dict(sm_scale=D ** -0.5, causal=True, max_q_len=q_len)
    rows = []

    def record(impl, config, t, err=None, note=""):
        row = dict(scenario=name, lanes=num_lanes, ctx=ctx, q_len=q_len, page_size=page_size,
                   impl=impl, config=config, median_us=t * 1e6, kv_bytes=kv_bytes,
                   kv_tb_s=kv_bytes / t / 1e12, frac_copy=kv_bytes / t / 1e12 / copy_tb_s,
                   tflops=flops / t / 1e12, max_abs_err_vs_xla=err, note=note)
        rows.append(row)
        print(f"  {impl:8s} {config:44s} {t * 1e6:9.1f} us  {row['kv_tb_s']:5.2f} TB/s  "
              f"{100 * row['frac_copy']:5.1f}% copy  {row['tflops']:6.1f} TFLOP/s  err {err}",
              flush=True)

    ref = None
    if with_xla:
        try:
            f = looped(functools.partial(ragged_paged_attention_xla, **kw))
            t = timeit(f, qs[:2], *rest, repeats=max(3, repeats // 3)) / 2
            ref = f(qs[:2], *rest)[0]
            record("xla", "reference", t)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory; the table says so
            print(f"  xla failed: {type(e).__name__}: {str(e)[:200]}")
    for overrides in triton_configs:
        if overrides and time.time() > deadline:
            print(f"  skipped (time budget): {overrides}")
            continue
        try:
            plan = _plan_for(qs[0].shape, k_pages.shape, page_table.shape, DTYPE, causal=True,
                             max_q_len=q_len, num_sms=_device_num_sms(), **overrides)
            config = (f"splits={plan.num_splits} bq={plan.block_q} bm={plan.block_m} "
                      f"bn={plan.block_n} w={plan.num_warps} st={plan.num_stages}")
            if overrides:
                config += " *"  # a sweep point, not the default plan
            f = looped(functools.partial(ragged_paged_attention_triton, **kw, **overrides))
            t = timeit(f, qs, *rest, repeats=repeats) / inner
            err = None
            if ref is not None:
                out = f(qs, *rest)[0]
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            record("triton", config, t, err)
        except Exception as e:  # noqa: BLE001
            print(f"  triton {overrides} failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(scenario=name, impl="triton", config=str(overrides),
                             error=f"{type(e).__name__}: {str(e)[:300]}"))
    if with_pallas and q_len == 1:
        try:
            attn = pallas_paged_attention_fn(page_size, page_table.shape[1])
            k_hpsd = jnp.transpose(k_pages, (2, 0, 1, 3))  # [Hkv, P, S, D], outside the timing
            v_hpsd = jnp.transpose(v_pages, (2, 0, 1, 3))
            f = jax.jit(lambda qs, *a: [attn(q, *a) for q in qs])
            t = timeit(f, qs, k_hpsd, v_hpsd, kv_lens, page_table, repeats=repeats) / inner
            record("pallas", "ops.gpu.paged_attention (baseline)", t)
            del k_hpsd, v_hpsd
        except Exception as e:  # noqa: BLE001 - deprecated op, may be gone or refuse a shape
            print(f"  pallas baseline unavailable: {type(e).__name__}: {str(e)[:200]}")
    return rows


def sweep_configs():
    """Splits x KV tile x warps around the default plan (stages left to the plan)."""
    configs = [{}]
    for num_splits in (2, 4, 8, 16):
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                configs.append(dict(num_splits=num_splits, block_n=block_n, num_warps=num_warps))
    return configs


def prefill_sweep_configs():
    """Query rows x KV tile x warps x stages for a 512-query prefill chunk (one split, the plan's
    choice for prefill). block_q 16 / 32 make 64- / 128-row tiles of queries x heads. Left out:
    the tiles that spill registers when compiled for sm_90 (4 warps with 64+ keys at 128 rows,
    4 warps with 128 keys at 64 rows); tests/test_kernels_attention.py compiles every one."""
    configs = [{}]
    for block_q, block_n, warps in [(16, 32, (4, 8)), (16, 64, (4, 8)), (16, 128, (8,)),
                                    (32, 32, (4, 8)), (32, 64, (8,)), (32, 128, (8,))]:
        for num_warps in warps:
            for num_stages in (2, 3):
                configs.append(dict(block_q=block_q, block_n=block_n, num_warps=num_warps,
                                    num_stages=num_stages, num_splits=1))
    return configs


PREFILL_SWEEP_SCENARIOS = [  # busy's chunks: 512 queries, page size 16, 1,024-4,096 tokens of context
    ("prefill 1x1024 chunk512 ps16", 1, 1024, 512, 16),
    ("prefill 1x3072 chunk512 ps16", 1, 3072, 512, 16),
    ("prefill 1x4096 chunk512 ps16", 1, 4096, 512, 16),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write results as JSON here")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep splits x block_n x warps at 32 x 4096 ps16 (minutes)")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only busy's 512-query prefill chunks (page size 16; 1,024, 3,072 "
                             "and 4,096 tokens of context, the chunk included), sweeping "
                             "block_q x block_n x warps x stages at each (prefill_sweep_configs)")
    # 40 calls per dispatch: at --inner 5 (2026-11-30, H200) every small scenario (1 x 4096,
    # 16 x 512, Triton and Pallas alike) sat at a 55-65 us floor, so the per-dispatch host cost
    # was likely a large share of the small rows and up to ~20% of the 32 x 4096 rows.
    parser.add_argument("--inner", type=int, default=40, help="calls per timed dispatch")
    parser.add_argument("--repeats", type=int, default=10, help="timed dispatches (median)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip remaining sweep points past this many seconds "
                             "(default 170, or 480 with --sweep)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes, no Triton: checks the script itself on a CPU")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 480.0 if (args.sweep or args.prefill_sweep) else 170.0
    if jax.default_backend() != "gpu":
        print("warning: not on a GPU; the Triton rows will fail", file=sys.stderr)

    t_start = time.time()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    copy = copy_bandwidth(1 / 16 if args.cpu_smoke else 2.0)
    print(f"copy bandwidth (read+write): {copy}", flush=True)
    best = copy["best_tb_s"]

    scenarios = [  # name, lanes, ctx, q_len, page_size
        ("decode 32x4096 ps16", 32, 4096, 1, 16),
        ("verify 32x4096 ps16", 32, 4096, 8, 16),
        ("decode 32x4096 ps64", 32, 4096, 1, 64),
        ("verify 32x4096 ps64", 32, 4096, 8, 64),
        ("decode 1x4096 ps16", 1, 4096, 1, 16),
        ("verify 1x4096 ps16", 1, 4096, 8, 16),
        ("decode 16x512 ps16", 16, 512, 1, 16),
        ("verify 16x512 ps16", 16, 512, 8, 16),
        ("prefill 1x4096 chunk512 ps64", 1, 4096, 512, 64),
    ]
    if args.prefill_sweep:
        scenarios = PREFILL_SWEEP_SCENARIOS
    if args.cpu_smoke:
        scenarios = [("smoke decode 2x256", 2, 256, 1, 16), ("smoke verify 2x256", 2, 256, 8, 16)]
    rows = []
    for name, lanes, ctx, q_len, ps in scenarios:
        print(f"{name}:", flush=True)
        configs = [{}]  # on a CPU (--cpu-smoke) this row fails cleanly: no jax-triton
        if args.sweep and lanes == 32 and ps == 16:
            configs = sweep_configs()
        if args.prefill_sweep:  # a tile is chosen for every context, so sweep each
            configs = prefill_sweep_configs()
        rows += run_scenario(name, lanes, ctx, q_len, ps, best, inner=args.inner,
                             repeats=args.repeats, triton_configs=configs,
                             with_pallas=(q_len == 1 and not args.cpu_smoke),
                             deadline=t_start + args.budget_s)

    print("\n| scenario | impl | config | median us | KV TB/s | % copy BW | TFLOP/s | max err vs xla |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['scenario']} | {r['impl']} | {r['config']} | failed | | | | |")
            continue
        err = "" if r["max_abs_err_vs_xla"] is None else f"{r['max_abs_err_vs_xla']:.3g}"
        print(f"| {r['scenario']} | {r['impl']} | {r['config']} | {r['median_us']:.1f} | "
              f"{r['kv_tb_s']:.2f} | {100 * r['frac_copy']:.1f} | {r['tflops']:.1f} | {err} |")

    # The two targets of the brief, on the default plan.
    def default(name):
        for r in rows:
            if (r["scenario"] == name and r["impl"] == "triton" and "error" not in r
                    and not r["config"].endswith("*")):
                return r
    summary = {}
    for ps in (16, 64):
        d, v = default(f"decode 32x4096 ps{ps}"), default(f"verify 32x4096 ps{ps}")
        if d and v:
            summary[f"ps{ps}"] = dict(decode_frac_copy=d["frac_copy"],
                                      verify_over_decode=v["median_us"] / d["median_us"])
            print(f"ps{ps}: decode at {100 * d['frac_copy']:.1f}% of copy BW (target >= 80%), "
                  f"verify/decode time {v['median_us'] / d['median_us']:.2f}x (target <= 1.3x)")
    with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy=copy,
                       rows=rows, summary=summary, seconds=time.time() - t_start), f, indent=1)
    print(f"wrote {args.out} in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
