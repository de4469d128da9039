"""Time the row kernels of kernels/rowwise_triton.py at decode sizes, one launch each, replayed
from a CUDA graph (triton.testing.do_bench_cudagraph), as XLA's command buffers replay them.

  python3 scripts/bench_rowwise.py --out $OUT/rowwise.json [--rows 1,8] [--warps 4,8,16]

Rows: rms_norm [M, D]; add_rms_norm [M, D] + P partials; qk_norm_rope over P partials; and a
plain torch add of two [M, D] fp32 rows (the floor: one tiny kernel's launch and memory
latency). Medians in microseconds. Needs a CUDA torch build and Triton.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing

from jspec.kernels import rowwise_triton as rt


def _time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--partials", default="1,2,4")
    ap.add_argument("--warps", default="4,8,16")
    args = ap.parse_args()
    dev, D, eps = "cuda", args.hidden, 1e-6
    kernels = rt._kernels()
    results = []
    for M in map(int, args.rows.split(",")):
        x = torch.randn(M, D, device=dev)
        w = torch.randn(D, device=dev).to(torch.bfloat16)
        other = torch.randn(M, D, device=dev)
        results.append(dict(kernel="torch_add", M=M, us=_time_us(lambda: x + other)))
        for warps in map(int, args.warps.split(",")):
            plan = rt.plan_rms_norm(M, D)
            y = torch.empty(M, D, device=dev, dtype=torch.bfloat16)
            consts = rt.rms_norm_constexprs(plan, eps, False)
            us = _time_us(lambda: kernels[0][plan.grid](x, w, y, num_warps=warps, num_stages=1,
                                                        **consts))
            results.append(dict(kernel="rms_norm", M=M, warps=warps, us=us))
            for P in map(int, args.partials.split(",")):
                p = torch.randn(P, M, D, device=dev)
                total = torch.empty(M, D, device=dev)
                c = rt.add_rms_norm_constexprs(plan, eps, P)
                us = _time_us(lambda: kernels[3][plan.grid](x, p, w, total, y, num_warps=warps,
                                                            num_stages=1, **c))
                results.append(dict(kernel="add_rms_norm", M=M, P=P, warps=warps, us=us))
        for P in map(int, args.partials.split(",")):
            Hq, Hkv, hd = 32, 8, 128
            qkv = torch.randn(P, M, Hq + 2 * Hkv, hd, device=dev)
            wq, wk = (torch.randn(hd, device=dev).to(torch.bfloat16) for _ in range(2))
            cos, sin = torch.randn(M, hd // 2, device=dev), torch.randn(M, hd // 2, device=dev)
            us = _time_us(lambda: rt.qk_norm_rope_launch_torch(qkv, wq, wk, cos, sin, eps, Hq,
                                                               Hkv, torch.bfloat16))
            results.append(dict(kernel="qk_norm_rope(+alloc)", M=M, P=P, us=us))
    for r in results:
        print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
                       results=results), f, indent=1)


if __name__ == "__main__":
    main()
