"""The batch-invariant Triton linear kernel against XLA's GEMM at Qwen3-8B shapes: time and
achieved weight bandwidth per (rows, tile width, stages), so its plan can be tuned on the GPU.
None of the swept knobs changes a result's bits (kernels/linear_triton.py).

  . scripts/device_env.sh; python3 scripts/bench_linear.py --out $OUT/linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time


def timeit(f, x, w, chain: int = 20, reps: int = 7) -> float:
    """Seconds per call: `chain` dependent calls unrolled in one jitted program (no host dispatch
    or loop sync between them), median over `reps` programs."""
    import jax

    @jax.jit
    def chained(x, w):
        acc = x
        for _ in range(chain):
            y = f(acc, w)
            acc = jax.lax.dynamic_update_slice(x, y[:1, :1].astype(x.dtype), (0, 0))
        return acc

    jax.block_until_ready(chained(x, w))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(chained(x, w))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] / chain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--block-n", default="16,32,64,128")
    ap.add_argument("--stages", default="3,4,6")
    args = ap.parse_args()
    import functools

    import jax
    import jax.numpy as jnp

    from jspec.kernels.linear import linear_xla
    from jspec.kernels.linear_triton import linear_triton, make_plan

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288)}
    out = []
    for name, (N, K) in shapes.items():
        w = jnp.ones((N, K), jnp.bfloat16) * 0.01
        for M in [int(m) for m in args.rows.split(",")]:
            x = jnp.ones((M, K), jnp.bfloat16)
            gb = (N * K + M * K) * 2 / 1e9 + M * N * 4 / 1e9
            t_xla = timeit(linear_xla, x, w)
            row = {"shape": name, "N": N, "K": K, "M": M, "xla_us": t_xla * 1e6,
                   "xla_TBps": gb / t_xla / 1e3, "default_plan": make_plan(M, N, K).block_n,
                   "triton": []}
            for bn, st in itertools.product([int(v) for v in args.block_n.split(",")],
                                            [int(v) for v in args.stages.split(",")]):
                f = functools.partial(linear_triton, block_n=bn, num_stages=st)
                try:
                    t = timeit(f, x, w)
                except Exception as e:  # noqa: BLE001 - e.g. shared memory overflow
                    row["triton"].append({"block_n": bn, "stages": st, "error": str(e)[:200]})
                    continue
                row["triton"].append({"block_n": bn, "stages": st, "us": t * 1e6,
                                      "TBps": gb / t / 1e3})
            best = min((r for r in row["triton"] if "us" in r), key=lambda r: r["us"], default=None)
            row["best"] = best
            print(json.dumps({k: row[k] for k in ("shape", "M", "xla_us", "xla_TBps", "best")}),
                  flush=True)
            out.append(row)
    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": out}, f,
                  indent=1)


if __name__ == "__main__":
    main()
