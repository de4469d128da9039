"""Batch-invariant linear layer on the GPU: y[M, N] = x[M, K] @ w[N, K]^T in fp32 (Triton through
jax-triton).

Why it exists: XLA chooses a GEMM algorithm by shape, so row r of x @ w^T gets different fp32 bits
when the GEMM has 1 row (stock decode) than when it has 8 (speculative verify): measured on the
H200 for 88-99 % of the outputs, whatever the XLA flags (docs/benchmarks.md). Rounded to bf16 at
the next matmul input, those bits make verify and decode drift apart by ~3e-3 nats per token.
Here every output element is accumulated in one order whatever M is:
  * K is walked from 0 upward in BLOCK_K steps, one `tl.dot` of a BLOCK_M = 16-row tile each
    (mma.sync m16n8k16 on sm_90: wgmma, used for >= 64-row tiles, would be another instruction),
    into an fp32 accumulator; no split-K, so no cross-program reduction.
  * BLOCK_M and BLOCK_K are module constants, never chosen from the shape. BLOCK_N, the warps,
    the stages and the grid may depend on the shape: they decide which program computes an
    element and when, not how.
Rows past M are masked to zero and never stored. The XLA twin is `kernels.linear.linear_xla`
(jnp.einsum with fp32 accumulation: the same math, not batch-invariant).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile: fixed (see module docstring)
BLOCK_K = 128  # reduction step: fixed (see module docstring)
NUM_SMS_DEFAULT = 132  # H100 / H200


def _linear_kernel(x_ptr, w_ptr, y_ptr,
                   M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE_DOT: tl.constexpr):
    """One program = BLOCK_M rows x BLOCK_N columns of y; grid axis 0 walks the row tiles so the
    programs that read the same weight columns run side by side (the weights come from L2)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


_KERNEL = None


def _kernel():
    """triton.jit at first use (Triton decides between compiling and interpreting then)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = triton.jit(_linear_kernel)
    return _KERNEL


@dataclasses.dataclass(frozen=True)
class Plan:
    M: int
    N: int
    K: int
    block_n: int
    num_warps: int
    num_stages: int
    ieee_dot: bool

    @property
    def grid(self) -> tuple[int, int]:
        return (-(-self.M // BLOCK_M), -(-self.N // self.block_n))

    def constexprs(self) -> dict:
        return dict(M=self.M, N=self.N, K=self.K, BLOCK_M=BLOCK_M, BLOCK_N=self.block_n,
                    BLOCK_K=BLOCK_K, IEEE_DOT=self.ieee_dot)


def make_plan(M: int, N: int, K: int, *, ieee_dot: bool = False, block_n: int | None = None,
              num_sms: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> Plan:
    """Widest column tile that still gives two programs per SM (a skinny decode GEMM is bound by
    how many weight bytes are in flight, so it needs many programs), 16..128 columns."""
    if min(M, N, K) < 1:
        raise ValueError(f"linear: empty operand (M={M}, N={N}, K={K})")
    if block_n is None:
        want = 2 * (num_sms or NUM_SMS_DEFAULT)
        row_tiles = -(-M // BLOCK_M)
        block_n = 16
        for bn in (128, 64, 32):
            if row_tiles * -(-N // bn) >= want:
                block_n = bn
                break
    if block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    # Shared memory per stage: x [16, 128] + w [128, block_n], 2 bytes (4 with IEEE fp32).
    stage_bytes = (BLOCK_M + block_n) * BLOCK_K * (4 if ieee_dot else 2)
    if num_stages is None:
        num_stages = max(2, min(4, (160 * 1024) // stage_bytes))
    return Plan(M=M, N=N, K=K, block_n=block_n, num_warps=num_warps or 4, num_stages=num_stages,
                ieee_dot=bool(ieee_dot))


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def linear_triton(x, w, *, block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None):
    """x [M, K], w [N, K] (same dtype) -> fp32 [M, N] on an NVIDIA GPU, batch-invariant. The
    keyword overrides (tile width, warps, stages) are for tuning: none changes a result's bits."""
    import jax
    import jax.numpy as jnp
    import jax_triton as jt

    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x must be [M, K] and w [N, K], got {x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"linear: x and w dtypes differ ({x.dtype}, {w.dtype})")
    M, K = x.shape
    N = w.shape[0]
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 0)) or None
    except Exception:  # noqa: BLE001 - a heuristic input only
        sms = None
    plan = make_plan(M, N, K, ieee_dot=np.dtype(x.dtype) == np.float32, block_n=block_n,
                     num_sms=sms, num_warps=num_warps, num_stages=num_stages)
    return jt.triton_call(
        x, w, kernel=_kernel(), name="linear_bi",
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **plan.constexprs())


def launch_torch(x, w, *, block_n: int | None = None):
    """The same kernel and plan on torch tensors: Triton's CPU interpreter (tests; the process
    must start with TRITON_INTERPRET=1) or a CUDA torch build."""
    import torch

    if x.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("CPU tensors run only under Triton's interpreter: start the process "
                           "with TRITON_INTERPRET=1")
    M, K = x.shape
    N = w.shape[0]
    plan = make_plan(M, N, K, ieee_dot=x.dtype == torch.float32, block_n=block_n)
    y = torch.full((M, N), float("nan"), dtype=torch.float32, device=x.device)
    _kernel()[plan.grid](x.contiguous(), w.contiguous(), y, num_warps=plan.num_warps,
                         num_stages=plan.num_stages, **plan.constexprs())
    return y
