"""Batch-invariant row reductions on the GPU (Triton through jax-triton): RMSNorm over the last
dim (alone, or with the residual add before it), logsumexp over a vocabulary row, and Qwen3's
q/k head norms fused with RoPE.

Why they exist: XLA picks a reduction's algorithm (threads per row, tree shape, whether rows are
split across blocks) by shape, so row r of a norm or a log-softmax gets different fp32 bits when
it is reduced among 1 row (stock decode) than among 8 per lane (speculative verify). An RMSNorm's
sum of squares one bit off flips the bf16 rounding of its output now and then, and that is
enough to keep the batch-invariant GEMMs (linear_triton.py) from computing the same bits in
verify and decode. Here:
  * one program reduces one row, so nothing crosses programs and the grid is just (M,);
  * within a row the order is fixed: the row is walked in BLOCK-wide steps from 0 upward, each
    lane accumulating elementwise, and the BLOCK lanes are combined by one `tl.sum` / `tl.max`
    at the end, whose tree is fixed by BLOCK and the warp count;
  * BLOCK and the warps depend on the row length only (D, the weight's length, or V), never on
    M: `plan_rms_norm` / `plan_logsumexp` below are the whole rule, module constants bound it.
The cost of one program per row is latency when M is small: a 151936-wide logsumexp at M = 1
walks its row on one SM (tens of microseconds), which batch-invariant mode accepts.
The XLA twins (today's math, not batch-invariant) are in kernels/reductions.py.

The fused q/k step (`_qk_norm_rope_kernel`) exists for launch count, not invariance: in a decode
step each of the 36 layers ran a q-norm kernel, a k-norm kernel and 3-4 small XLA fusions (RoPE,
the split and the casts) at 1-1.75 us each, about 0.25 ms of a 5.7 ms step on the H200
(docs/benchmarks.md). One program per (row, head) does a head's whole path: q and k heads are
normalised exactly as `_rms_norm_kernel` does with F32_OUT, rotated with the cos / sin rows
given, and rounded once; v heads are only rounded. It takes the qkv projection's split-K
partials and sums them in split order as it loads them (no combine kernel before it).

The residual add and the norm after it (`_add_rms_norm_kernel`) run as one kernel for the same
reason: it adds a matmul's split partials to the fp32 stream in split order (the XLA adds'
order, so the same bits), stores the sum and normalises it as `_rms_norm_kernel` does.
"""

from __future__ import annotations

import dataclasses
import os

import triton
import triton.language as tl

MAX_BLOCK_D = 4096  # RMSNorm: widest step over a row (a Qwen3-8B hidden row in one step)
BLOCK_V = 4096  # logsumexp: step over a vocabulary row (151936 = 37 steps + a masked tail)
# RMSNorm's warps (they fix its reduction tree, so its bits, the same in every row count); 8
# beat 4 by 0.1-0.3 us a launch on the H100 (docs/benchmarks.md). JSPEC_RMS_NUM_WARPS overrides
# it for tuning runs.
RMS_NUM_WARPS = int(os.environ.get("JSPEC_RMS_NUM_WARPS", "8"))
LSE_NUM_WARPS = 8


def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D: tl.constexpr, EPS: tl.constexpr,
                     BLOCK_D: tl.constexpr, F32_OUT: tl.constexpr):
    """y[row] = w * normalise(x[row]) with RMSNorm's roundings (kernels/reductions.rms_norm_xla):
    the fp32 normalised row is either rounded to the weight's dtype and scaled there (F32_OUT
    False; a bf16 product is exact in fp32, so one rounding at the store is the bf16 multiply)
    or scaled in fp32 (F32_OUT True). A row that fits one step (D <= BLOCK_D) stays in registers
    between the sum of squares and the scaling; a longer one is walked twice."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    y_row = y_ptr + row * D
    cols = tl.arange(0, BLOCK_D)
    if D <= BLOCK_D:
        ok = cols < D
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        # 0 + x * x is x * x: the same bits as the walk's first step below.
        mean_sq = tl.div_rn(tl.sum(x * x, axis=0), D * 1.0)
        _rms_scale_store(x * tl.rsqrt(mean_sq + EPS), w_ptr, y_row, cols, ok, F32_OUT)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
            acc += x * x
        mean_sq = tl.div_rn(tl.sum(acc, axis=0), D * 1.0)  # jnp.mean divides (rounded), as here
        inv_rms = tl.rsqrt(mean_sq + EPS)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            ok = d < D
            x = tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32) * inv_rms
            _rms_scale_store(x, w_ptr, y_row, d, ok, F32_OUT)


def _rms_scale_store(x_normed, w_ptr, y_row, d, ok, F32_OUT: tl.constexpr):
    """y[d] = w[d] * x_normed with RMSNorm's rounding (see _rms_norm_kernel), stored."""
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    if F32_OUT:
        y = w.to(tl.float32) * x_normed
    else:
        y = w.to(tl.float32) * x_normed.to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_row + d, y.to(y_row.dtype.element_ty), mask=ok)


def _residual_sum(x_row, p_row, d, ok, MD, P: tl.constexpr):
    """x[d] + ((p0 + p1) + ... + p[P-1])[d] in fp32: the split partials (MD elements apart)
    combined in split order (linear_triton.combine), then added to the stream (the XLA adds'
    order)."""
    t = tl.load(p_row + d, mask=ok, other=0.0)
    for part in tl.static_range(1, P):
        t = t + tl.load(p_row + part * MD + d, mask=ok, other=0.0)
    return tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32) + t


def _add_rms_norm_kernel(x_ptr, p_ptr, w_ptr, sum_ptr, y_ptr, D: tl.constexpr, EPS: tl.constexpr,
                         BLOCK_D: tl.constexpr, P: tl.constexpr):
    """The residual add and the next RMSNorm in one program per row: sum[row] = x[row] + ((p0 +
    p1) + ...)[row], the fp32 residual stream plus a matmul's P split partials p [P, M, D]
    (linear_triton_partials) in split order, which is the XLA adds' order (x + combine(p)),
    stored; y[row] = w * normalise(sum[row]) exactly as _rms_norm_kernel rounds it. A row in one
    step stays in registers; a longer one recomputes the sum in the second pass from the same
    loads (the same adds, so the same bits) instead of reading back what this program stored.
    The grid has one program per row, so it gives M (the partials' stride) at run time: one
    compiled kernel serves every row count."""
    row = tl.program_id(0).to(tl.int64)
    MD = tl.num_programs(0).to(tl.int64) * D
    x_row = x_ptr + row * D
    p_row = p_ptr + row * D
    sum_row = sum_ptr + row * D
    y_row = y_ptr + row * D
    cols = tl.arange(0, BLOCK_D)
    if D <= BLOCK_D:
        ok = cols < D
        v = _residual_sum(x_row, p_row, cols, ok, MD, P)
        tl.store(sum_row + cols, v, mask=ok)
        mean_sq = tl.div_rn(tl.sum(v * v, axis=0), D * 1.0)  # as _rms_norm_kernel
        _rms_scale_store(v * tl.rsqrt(mean_sq + EPS), w_ptr, y_row, cols, ok, False)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            ok = d < D
            v = _residual_sum(x_row, p_row, d, ok, MD, P)
            tl.store(sum_row + d, v, mask=ok)
            acc += v * v
        mean_sq = tl.div_rn(tl.sum(acc, axis=0), D * 1.0)
        inv_rms = tl.rsqrt(mean_sq + EPS)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            ok = d < D
            v = _residual_sum(x_row, p_row, d, ok, MD, P) * inv_rms
            _rms_scale_store(v, w_ptr, y_row, d, ok, False)


def _logsumexp_kernel(x_ptr, lse_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """lse[row] = log sum exp x[row], one pass: every lane keeps its own running max and its
    sum of exp(x - max) (rescaled when the max grows); the lanes are merged once at the end."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        x = tl.load(x_row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # A lane that has seen only -inf (the masked tail) keeps s = 0 instead of exp(nan).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    m_row = tl.max(m, axis=0)
    shift_row = tl.where(m_row == float("-inf"), 0.0, m_row)
    total = tl.sum(s * tl.exp(m - shift_row), axis=0)
    tl.store(lse_ptr + row, shift_row + tl.log(total))


def _qk_norm_rope_kernel(x_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, y_ptr, H: tl.constexpr,
                         HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, EPS: tl.constexpr,
                         P: tl.constexpr):
    """y[row, h] for one head of the fused qkv projection, given as its P split partials x [P, M,
    H = HQ + 2 HKV, HD] (fp32; linear_triton_partials), summed here in split order ((x0 + x1) +
    ...: linear_triton.combine's adds, so the same bits as combining first): a q head (h < HQ)
    or a k head gets RMSNorm with its weight (wq or wk [HD]: q_norm, k_norm) in fp32, then
    rotate-half RoPE with cos / sin [M, HD / 2]; a v head is copied. One rounding, at the store.
    Each lane also normalises its rotation partner (lane d pairs with d +- HD / 2) from a second
    load, rather than shuffling registers: the same ops on the same values give the partner's
    exact bits. The grid is (M, H), so the partials' stride comes from it at run time."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = HD // 2
    part_stride = tl.num_programs(0).to(tl.int64) * H * HD
    base = (row * H + h) * HD
    cols = tl.arange(0, HD)
    x = tl.load(x_ptr + base + cols).to(tl.float32)
    for part in tl.static_range(1, P):
        x = x + tl.load(x_ptr + part * part_stride + base + cols)
    if h < HQ + HKV:
        partner = (cols + HALF) % HD
        x_partner = tl.load(x_ptr + base + partner).to(tl.float32)
        for part in tl.static_range(1, P):
            x_partner = x_partner + tl.load(x_ptr + part * part_stride + base + partner)
        mean_sq = tl.div_rn(tl.sum(x * x, axis=0), HD * 1.0)  # as _rms_norm_kernel
        inv_rms = tl.rsqrt(mean_sq + EPS)
        is_k = h >= HQ  # both weights are read (256 bytes each): no pointer select needed
        w = tl.where(is_k, tl.load(wk_ptr + cols), tl.load(wq_ptr + cols)).to(tl.float32)
        w_partner = tl.where(is_k, tl.load(wk_ptr + partner), tl.load(wq_ptr + partner))
        y = w * (x * inv_rms)
        y_partner = w_partner.to(tl.float32) * (x_partner * inv_rms)
        c = tl.load(cos_ptr + row * HALF + cols % HALF)
        s = tl.load(sin_ptr + row * HALF + cols % HALF)
        # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (the partner is x2, x1)
        out = y * c + y_partner * tl.where(cols < HALF, -s, s)
    else:
        out = x
    tl.store(y_ptr + base + cols, out.to(y_ptr.dtype.element_ty))


_KERNELS = None
_HELPERS = ("_rms_scale_store", "_residual_sum")  # device functions the kernels call


def _kernels():
    """(rms_norm, logsumexp, qk_norm_rope, add_rms_norm), triton.jit at first use (Triton decides
    then between compiling and interpreting)."""
    global _KERNELS
    if _KERNELS is None:
        module = globals()  # the kernels look their helpers up here, by name, when compiled
        for name in _HELPERS:
            module[name] = triton.jit(module[name])
        _KERNELS = (triton.jit(_rms_norm_kernel), triton.jit(_logsumexp_kernel),
                    triton.jit(_qk_norm_rope_kernel), triton.jit(_add_rms_norm_kernel))
    return _KERNELS


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One program per row; `block` and `num_warps` fix a row's reduction order and are chosen
    from the row length alone."""
    M: int
    length: int
    block: int
    num_warps: int

    @property
    def grid(self) -> tuple[int]:
        return (self.M,)


def _check_rows(M: int, length: int, what: str) -> None:
    if M < 1 or length < 1:
        raise ValueError(f"{what}: empty operand (M={M}, length={length})")


def plan_rms_norm(M: int, D: int) -> RowPlan:
    """The smallest power-of-two step that holds the row, capped at MAX_BLOCK_D (a head_dim-128
    row takes one 128-wide step; a 5120-wide row two 4096-wide steps)."""
    _check_rows(M, D, "rms_norm")
    return RowPlan(M=M, length=D, block=min(MAX_BLOCK_D, triton.next_power_of_2(D)),
                   num_warps=RMS_NUM_WARPS)


def plan_add_rms_norm(M: int, D: int) -> RowPlan:
    """add_rms_norm walks a row as rms_norm does: the same plan."""
    return plan_rms_norm(M, D)


def plan_logsumexp(M: int, V: int) -> RowPlan:
    _check_rows(M, V, "logsumexp")
    return RowPlan(M=M, length=V, block=BLOCK_V, num_warps=LSE_NUM_WARPS)


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The fused q/k step: one program per (row, head); nothing depends on M but the grid."""
    M: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_warps: int = RMS_NUM_WARPS

    @property
    def num_heads(self) -> int:
        return self.num_q_heads + 2 * self.num_kv_heads

    @property
    def grid(self) -> tuple[int, int]:
        return (self.M, self.num_heads)


def plan_qk_norm_rope(M: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> HeadPlan:
    _check_rows(M, head_dim, "qk_norm_rope")
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"qk_norm_rope: need q and kv heads, got {num_q_heads} and {num_kv_heads}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_rope: head_dim must be a power of two >= 2, got {head_dim}")
    return HeadPlan(M=M, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def qk_norm_rope_constexprs(plan: HeadPlan, eps: float, partials: int = 1) -> dict:
    return dict(H=plan.num_heads, HQ=plan.num_q_heads, HKV=plan.num_kv_heads,
                HD=plan.head_dim, EPS=float(eps), P=_check_partials(partials))


def rms_norm_constexprs(plan: RowPlan, eps: float, f32_out: bool) -> dict:
    return dict(D=plan.length, EPS=float(eps), BLOCK_D=plan.block, F32_OUT=bool(f32_out))


def add_rms_norm_constexprs(plan: RowPlan, eps: float, partials: int) -> dict:
    return dict(D=plan.length, EPS=float(eps), BLOCK_D=plan.block, P=_check_partials(partials))


MAX_PARTIALS = 8  # split partials a fused kernel sums (linear_triton's splits are at most 4)


def _check_partials(partials: int) -> int:
    if not 1 <= partials <= MAX_PARTIALS:
        raise ValueError(f"partials must be 1..{MAX_PARTIALS}, got {partials}")
    return int(partials)


def logsumexp_constexprs(plan: RowPlan) -> dict:
    return dict(V=plan.length, BLOCK_V=plan.block)


# ---- jax (through jax-triton) ------------------------------------------------------------------

def rms_norm_triton(x, w, eps: float, f32_out: bool = False):
    """x [M, D] (fp32 or bf16), w [D] -> [M, D] in w's dtype (fp32 with f32_out),
    batch-invariant."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.triton_ffi import triton_call

    if x.ndim != 2 or w.ndim != 1 or x.shape[1] != w.shape[0]:
        raise ValueError(f"rms_norm: x must be [M, D] and w [D], got {x.shape} and {w.shape}")
    plan = plan_rms_norm(*x.shape)
    out_dtype = jnp.float32 if f32_out else w.dtype
    return triton_call(
        x, w, kernel=_kernels()[0], name="rms_norm_bi",
        out_shape=jax.ShapeDtypeStruct(x.shape, out_dtype), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=1, **rms_norm_constexprs(plan, eps, f32_out))


def _check_add_operands(x, partials, w) -> RowPlan:
    if x.ndim != 2 or partials.ndim != 3 or tuple(partials.shape[1:]) != tuple(x.shape) \
            or tuple(w.shape) != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x must be [M, D], the partials [P, M, D] and w [D], got "
                         f"{tuple(x.shape)}, {tuple(partials.shape)} and {tuple(w.shape)}")
    _check_partials(partials.shape[0])
    return plan_add_rms_norm(*x.shape)


def add_rms_norm_triton(x, partials, w, eps: float):
    """x fp32 [M, D] (the residual stream), partials fp32 [P, M, D] (a matmul's split partials),
    w [D] -> (x + sum of the partials in split order, fp32 [M, D]; its RMSNorm in w's dtype),
    batch-invariant: one program per row, rms_norm's walk."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.triton_ffi import triton_call

    plan = _check_add_operands(x, partials, w)
    return triton_call(
        x.astype(jnp.float32), partials.astype(jnp.float32), w, kernel=_kernels()[3],
        name="add_rms_norm_bi",
        out_shape=(jax.ShapeDtypeStruct(x.shape, jnp.float32),
                   jax.ShapeDtypeStruct(x.shape, w.dtype)),
        grid=plan.grid, num_warps=plan.num_warps, num_stages=1,
        **add_rms_norm_constexprs(plan, eps, partials.shape[0]))


def logsumexp_triton(x):
    """x [M, V] (fp32 or bf16) -> fp32 [M], batch-invariant."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.triton_ffi import triton_call

    if x.ndim != 2:
        raise ValueError(f"logsumexp: x must be [M, V], got {x.shape}")
    plan = plan_logsumexp(*x.shape)
    return triton_call(
        x, kernel=_kernels()[1], name="logsumexp_bi",
        out_shape=jax.ShapeDtypeStruct((x.shape[0],), jnp.float32), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=1, **logsumexp_constexprs(plan))


def _check_qk_operands(x, wq, wk, cos, sin, num_q_heads: int, num_kv_heads: int) -> HeadPlan:
    """x is [M, H, hd] or its split partials [P, M, H, hd]."""
    if x.ndim not in (3, 4) or x.shape[-2] != num_q_heads + 2 * num_kv_heads:
        raise ValueError(f"qk_norm_rope: x must be [M, {num_q_heads} + 2 x {num_kv_heads} heads, "
                         f"head_dim] (or [P, ...] split partials), got {tuple(x.shape)}")
    if x.ndim == 4:
        _check_partials(x.shape[0])
    M, _, hd = x.shape[-3:]
    plan = plan_qk_norm_rope(M, num_q_heads, num_kv_heads, hd)
    for name, w in (("wq", wq), ("wk", wk)):
        if tuple(w.shape) != (hd,):
            raise ValueError(f"qk_norm_rope: {name} must be [{hd}], got {tuple(w.shape)}")
    for name, a in (("cos", cos), ("sin", sin)):
        if tuple(a.shape) != (M, hd // 2):
            raise ValueError(f"qk_norm_rope: {name} must be [{M}, {hd // 2}], got {tuple(a.shape)}")
    return plan


def qk_norm_rope_triton(x, wq, wk, cos, sin, eps: float, num_q_heads: int, num_kv_heads: int,
                        out_dtype):
    """x fp32 [M, Hq + 2 Hkv, hd] (the fused qkv projection) or its split partials [P, M, ...]
    (linear_triton_partials; summed in split order in the kernel), wq / wk [hd] (q_norm,
    k_norm), cos / sin fp32 [M, hd / 2] -> out_dtype [M, Hq + 2 Hkv, hd]: q and k normed and
    rotated, v as is; batch-invariant (one program per row and head)."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.triton_ffi import triton_call

    plan = _check_qk_operands(x, wq, wk, cos, sin, num_q_heads, num_kv_heads)
    return triton_call(
        x.astype(jnp.float32), wq, wk, cos.astype(jnp.float32), sin.astype(jnp.float32),
        kernel=_kernels()[2], name="qk_norm_rope_bi",
        out_shape=jax.ShapeDtypeStruct(x.shape[-3:], out_dtype), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=1,
        **qk_norm_rope_constexprs(plan, eps, x.shape[0] if x.ndim == 4 else 1))


# ---- torch twins: Triton's CPU interpreter (tests) or a CUDA torch build -----------------------

def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_torch_device(x) -> None:
    if x.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("CPU tensors run only under Triton's interpreter: start the process "
                           "with TRITON_INTERPRET=1")


def rms_norm_launch_torch(x, w, eps: float, f32_out: bool = False):
    import torch

    _check_torch_device(x)
    plan = plan_rms_norm(*x.shape)
    y = torch.full(x.shape, float("nan"), dtype=torch.float32 if f32_out else w.dtype,
                   device=x.device)
    _kernels()[0][plan.grid](x.contiguous(), w.contiguous(), y, num_warps=plan.num_warps,
                             num_stages=1, **rms_norm_constexprs(plan, eps, f32_out))
    return y


def logsumexp_launch_torch(x):
    import torch

    _check_torch_device(x)
    plan = plan_logsumexp(*x.shape)
    lse = torch.full((x.shape[0],), float("nan"), dtype=torch.float32, device=x.device)
    _kernels()[1][plan.grid](x.contiguous(), lse, num_warps=plan.num_warps, num_stages=1,
                             **logsumexp_constexprs(plan))
    return lse


def qk_norm_rope_launch_torch(x, wq, wk, cos, sin, eps: float, num_q_heads: int, num_kv_heads: int,
                              out_dtype):
    import torch

    _check_torch_device(x)
    plan = _check_qk_operands(x, wq, wk, cos, sin, num_q_heads, num_kv_heads)
    y = torch.full(x.shape[-3:], float("nan"), dtype=out_dtype, device=x.device)
    _kernels()[2][plan.grid](x.float().contiguous(), wq.contiguous(), wk.contiguous(),
                             cos.float().contiguous(), sin.float().contiguous(), y,
                             num_warps=plan.num_warps, num_stages=1,
                             **qk_norm_rope_constexprs(plan, eps, x.shape[0] if x.ndim == 4 else 1))
    return y


def add_rms_norm_launch_torch(x, partials, w, eps: float):
    import torch

    _check_torch_device(x)
    plan = _check_add_operands(x, partials, w)
    total = torch.full(x.shape, float("nan"), dtype=torch.float32, device=x.device)
    y = torch.full(x.shape, float("nan"), dtype=w.dtype, device=x.device)
    _kernels()[3][plan.grid](x.float().contiguous(), partials.float().contiguous(), w.contiguous(),
                             total, y, num_warps=plan.num_warps, num_stages=1,
                             **add_rms_norm_constexprs(plan, eps, partials.shape[0]))
    return total, y
