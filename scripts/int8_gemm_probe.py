"""Does XLA read an int8 weight at one byte a weight? One drafter-sized GEMM, bf16 weight against
int8 values + a channel scale (jspec.draft_weights.int8_linear, the engine's route), timed, with
the optimized HLO searched for a bf16 copy of the weight (a fusion whose output has the weight's
shape means the convert was not fused into the GEMM).

  python3 scripts/int8_gemm_probe.py [--rows 1,8,64,256] [--n 24576] [--k 4096] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--n", type=int, default=24576, help="output channels (DSpark-8B gate_up)")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jspec.draft_weights import int8_linear, quantize_int8
    from jspec.kernels.linear import linear_xla

    w = (jax.random.normal(jax.random.key(0), (args.n, args.k), jnp.float32) * 0.02).astype(jnp.bfloat16)
    q = quantize_int8(w, (1,))
    bf16 = jax.jit(lambda x, w: linear_xla(x, w))
    int8 = jax.jit(lambda x, v, s: int8_linear(x, type(q)(v, s, q.dtype), "xla"))
    copy_shape = re.compile(rf"bf16\[{args.n},{args.k}\]")

    def timed(fn, *a):
        fn(*a).block_until_ready()
        t = time.perf_counter()
        for _ in range(args.iters):
            y = fn(*a)
        y.block_until_ready()
        return (time.perf_counter() - t) / args.iters * 1e6

    rows = []
    for m in [int(v) for v in args.rows.split(",")]:
        x = jax.random.normal(jax.random.key(m), (m, args.k), jnp.bfloat16)
        hlo = int8.lower(x, q.values, q.scale).compile().as_text()
        r = {"rows": m, "bf16_us": timed(bf16, x, w), "int8_us": timed(int8, x, q.values, q.scale),
             "weight_mb_bf16": w.nbytes / 1e6, "weight_mb_int8": q.nbytes / 1e6,
             # a bf16 [N, K] value in the optimized program: the weight widened in memory
             "bf16_copy_in_hlo": bool(copy_shape.search(hlo)),
             "triton_gemm_in_hlo": "__triton_gemm" in hlo or "triton_gemm" in hlo}
        r["bf16_GBps"] = r["weight_mb_bf16"] / r["bf16_us"] * 1e3  # MB / us = TB/s
        r["int8_GBps"] = r["weight_mb_int8"] / r["int8_us"] * 1e3
        rows.append(r)
        print(json.dumps(r), flush=True)
        if m == 8:
            ops = [l.strip()[:220] for l in hlo.splitlines()
                   if " fusion(" in l or "custom-call(" in l]
            print("\n".join(ops[:16]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n": args.n, "k": args.k, "device": str(jax.devices()[0]),
                       "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
