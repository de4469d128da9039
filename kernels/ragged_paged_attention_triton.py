"""Ragged paged attention as a Triton kernel, called from JAX through jax-triton (GPU).

Import this module only where `triton` is installed; jax_triton itself is imported lazily (it
refuses to import on a CPU-only jaxlib), so the kernels can also run under Triton's interpreter
on CPU for tests (`launch_torch` in a process started with TRITON_INTERPRET=1).

Design (one program = one lane x one q block x one kv head x one KV split):
  * GQA packing: the tile's rows are (query, q head) pairs of one kv head, row r = i * G + g for
    query i of the block and head kv_head * G + g. A verify step (8 queries, G = 4) is one 32-row
    tile, so each KV page is read once per lane and kv head for all its queries and heads, and
    q_len 8 costs about what q_len 1 costs while the kernel is bound by the KV read.
  * Paging: KV is walked in tiles of BLOCK_N tokens; each token's page comes from the page table,
    so BLOCK_N and the page size are independent (a tile may span pages or part of one).
  * Split-K ("flash decoding"): the lane's KV range is cut into NUM_SPLITS equal pieces computed
    from the lane's actual length (so short lanes are not mostly idle splits). Each split writes
    fp32 partial outputs and a base-2 log-sum-exp; a second small kernel merges them. With one
    split the kernel writes the final output directly and no merge runs.
  * Masking: key position k is visible to query position p when k < kv_len and (causal) k <= p.
    A row with no visible key gets output 0 (never NaN).
  * Page dtype: q's, or float8_e4m3fn (the drafter's fp8 pool) widened to q's dtype right after
    each load, so the dots and the softmax are the bf16 / fp32 kernel's.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import triton
import triton.language as tl

NUM_SMS_DEFAULT = 132  # H100 / H200
INVARIANT_BLOCK_Q = 8  # the batch-invariant plan's queries per tile: DSpark's verify block (K = 7)


# ----------------------------------------------------------------------------------------------
# Kernels: plain functions, wrapped by triton.jit in _kernels() (compiled for the GPU, or run by
# the interpreter under TRITON_INTERPRET=1). Self-contained: no calls to helper functions.
# ----------------------------------------------------------------------------------------------

def _rpa_fwd_kernel(
    # inputs
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [P, S, Hkv, D]
    v_ptr,  # [P, S, Hkv, D]
    kv_lens_ptr,  # [B] int32
    page_table_ptr,  # [B, PAGES_PER_LANE] int32
    cu_q_lens_ptr,  # [B+1] int32
    # outputs
    o_ptr,  # NUM_SPLITS == 1: [T, Hq, D] in q's dtype; else [NUM_SPLITS, T, Hq, D] fp32
    lse_ptr,  # NUM_SPLITS == 1: unused; else [NUM_SPLITS, T, Hq] fp32, base-2 log-sum-exp
    # static (jax-triton would pass a Python float scalar as fp64, so the scale is static too)
    SM_SCALE: tl.constexpr,
    NUM_TOKENS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES_PER_LANE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # queries per tile
    BLOCK_M: tl.constexpr,  # rows per tile: next power of two >= max(16, BLOCK_Q * GROUP)
    BLOCK_N: tl.constexpr,  # keys per inner step
    Q_BLOCKS: tl.constexpr,  # q blocks per lane: cdiv(max_q_len, BLOCK_Q)
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of TF32
    SPLIT_TILES: tl.constexpr,  # > 0: splits start at fixed tile multiples (batch-invariant plan)
):
    lane_qblock = tl.program_id(0)  # axis 0: the only grid axis allowed more than 65535
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    lane = lane_qblock // Q_BLOCKS
    q_block = lane_qblock % Q_BLOCKS

    q_start = tl.load(cu_q_lens_ptr + lane)
    q_len = tl.load(cu_q_lens_ptr + lane + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + lane)

    # Row r of the tile is query r // GROUP of this block with q head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    row_q = rows // GROUP
    q_idx = q_block * BLOCK_Q + row_q  # query index within the lane
    row_valid = (row_q < BLOCK_Q) & (q_idx < q_len)
    token = q_start + q_idx
    head = kv_head * GROUP + rows % GROUP
    q_pos = kv_len - q_len + q_idx  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM)

    q_off = token[:, None] * (NUM_Q_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None], other=0.0)

    # Keys this q block can see: [0, kv_hi). Causal: up to the block's last query.
    if CAUSAL:
        last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_hi = tl.minimum(kv_len - q_len + last_q + 1, kv_len)
    else:
        kv_hi = kv_len
    kv_hi = tl.maximum(kv_hi, 0)
    num_tiles = tl.cdiv(kv_hi, BLOCK_N)
    if SPLIT_TILES > 0:
        tiles_per_split = SPLIT_TILES  # boundaries fixed by position, not by this block's length
    else:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    qk_scale = SM_SCALE * 1.4426950408889634  # softmax in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    page_row_ptr = page_table_ptr + lane * PAGES_PER_LANE

    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + offs_n
        k_valid = k_pos < kv_hi
        page = tl.load(page_row_ptr + k_pos // PAGE_SIZE, mask=k_valid, other=0)
        # int64: page * page stride overflows int32 for pools above 2^31 elements.
        kv_off = (page.to(tl.int64) * (PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM)
                  + (k_pos % PAGE_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM)
        # Pages are widened to q's dtype as they are loaded: exact for fp8 e4m3 pages (the
        # drafter's fp8 pool), a no-op when they are already in q's dtype.
        k_dn = tl.load(k_ptr + kv_off[None, :] + dims[:, None], mask=k_valid[None, :], other=0.0)
        k_dn = k_dn.to(q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, k_dn, input_precision="ieee")
        else:
            s = tl.dot(q, k_dn)
        s = s * qk_scale
        if CAUSAL:
            visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        else:
            visible = k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked row: no NaN
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_nd = tl.load(v_ptr + kv_off[:, None] + dims[None, :], mask=k_valid[:, None], other=0.0)
        v_nd = v_nd.to(q.dtype)
        if IEEE_DOT:
            pv = tl.dot(p.to(v_nd.dtype), v_nd, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_nd.dtype), v_nd)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Every split writes every valid row (an empty split writes o = 0, lse = -inf).
        tl.store(o_ptr + split * (NUM_TOKENS * NUM_Q_HEADS * HEAD_DIM) + q_off, out,
                 mask=row_valid[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(lse_ptr + split * (NUM_TOKENS * NUM_Q_HEADS) + token * NUM_Q_HEADS + head, lse,
                 mask=row_valid)


def _rpa_merge_kernel(
    o_part_ptr,  # [NUM_SPLITS, T, Hq, D] fp32
    lse_ptr,  # [NUM_SPLITS, T, Hq] fp32, base 2
    cu_q_lens_ptr,  # [B+1] int32
    o_ptr,  # [T, Hq, D] output dtype
    NUM_TOKENS: tl.constexpr,
    NUM_LANES: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_Q_HEADS
):
    """One program per token: merge the splits' partials by log-sum-exp; padding rows get 0."""
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    head_valid = heads < NUM_Q_HEADS
    hd_off = token * (NUM_Q_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    lse_off = token * NUM_Q_HEADS + heads

    num_valid_tokens = tl.load(cu_q_lens_ptr + NUM_LANES)
    if token >= num_valid_tokens:
        zeros = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        tl.store(o_ptr + hd_off, zeros.to(o_ptr.dtype.element_ty), mask=head_valid[:, None])
        return

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for split in range(NUM_SPLITS):
        lse = tl.load(lse_ptr + split * (NUM_TOKENS * NUM_Q_HEADS) + lse_off, mask=head_valid,
                      other=float("-inf"))
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)

    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        lse = tl.load(lse_ptr + split * (NUM_TOKENS * NUM_Q_HEADS) + lse_off, mask=head_valid,
                      other=float("-inf"))
        w = tl.math.exp2(lse - m)
        o = tl.load(o_part_ptr + split * (NUM_TOKENS * NUM_Q_HEADS * HEAD_DIM) + hd_off,
                    mask=head_valid[:, None], other=0.0)
        acc += w[:, None] * o
        denom += w
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(o_ptr + hd_off, out.to(o_ptr.dtype.element_ty), mask=head_valid[:, None])


_KERNELS: tuple | None = None


def _kernels():
    """(fwd, merge) wrapped by triton.jit: compiled for the GPU, or interpreted when the process
    was started with TRITON_INTERPRET=1 (Triton decides at decoration time, for its own
    standard-library helpers too, so the interpreter cannot be switched on after import)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = (triton.jit(_rpa_fwd_kernel), triton.jit(_rpa_merge_kernel))
    return _KERNELS


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# Launch plan: everything static about a call, shared by the JAX and the interpreter launchers.
# ----------------------------------------------------------------------------------------------

def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Plan:
    num_tokens: int
    num_lanes: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_lane: int
    block_q: int
    block_m: int
    block_n: int
    q_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int
    causal: bool
    ieee_dot: bool
    split_tiles: int = 0  # > 0: the batch-invariant plan's fixed split size, in BLOCK_N tiles

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_lanes * self.q_blocks, self.num_kv_heads, self.num_splits)

    def fwd_constexprs(self) -> dict:
        return dict(
            NUM_TOKENS=self.num_tokens, NUM_Q_HEADS=self.num_q_heads,
            NUM_KV_HEADS=self.num_kv_heads, GROUP=self.group, HEAD_DIM=self.head_dim,
            PAGE_SIZE=self.page_size, PAGES_PER_LANE=self.pages_per_lane, BLOCK_Q=self.block_q,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, Q_BLOCKS=self.q_blocks,
            NUM_SPLITS=self.num_splits, CAUSAL=self.causal, IEEE_DOT=self.ieee_dot,
            SPLIT_TILES=self.split_tiles)

    def merge_constexprs(self) -> dict:
        return dict(
            NUM_TOKENS=self.num_tokens, NUM_LANES=self.num_lanes, NUM_Q_HEADS=self.num_q_heads,
            HEAD_DIM=self.head_dim, NUM_SPLITS=self.num_splits,
            BLOCK_H=_next_pow2(self.num_q_heads))


def make_plan(
    *, num_tokens: int, num_lanes: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    page_size: int, pages_per_lane: int, max_q_len: int | None, causal: bool, ieee_dot: bool,
    block_q: int | None = None, block_n: int | None = None, num_splits: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, num_sms: int | None = None,
    invariant: bool = False,
) -> Plan:
    """Tile sizes and split count. Overrides (None = heuristic) are for benchmarks and tests.

    invariant=True: a query's output bits do not depend on how many queries its lane brings
    (decode's 1 vs verify's up to INVARIANT_BLOCK_Q) nor on how many tokens the call has. The
    tile shape is the same for both (block_q = INVARIANT_BLOCK_Q, so decode computes a tile of
    mostly padding rows), and splits start at fixed multiples of `split_tiles`, chosen from the
    lanes, kv heads and cache capacity only. Keys past a query's position are masked to exact
    zeros, so the extra tiles and splits a longer block visits change nothing for it."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    max_q = num_tokens if max_q_len is None else max(1, min(max_q_len, num_tokens))

    # Rows per tile: all of a verify block's queries x heads in one tile (<= 64 rows); long
    # prefill blocks take 128 rows of queries x heads (64 in fp32, whose FMA dots spill).
    # Only decode- and verify-sized calls need it (a prefill chunk is computed alike by every
    # engine), and long blocks would pay for many fp32 partials.
    invariant = invariant and max_q <= INVARIANT_BLOCK_Q
    if block_q is None and invariant:
        block_q = INVARIANT_BLOCK_Q
    if block_q is None:
        block_q = max_q if max_q * group <= 64 else max(1, (64 if ieee_dot else 128) // group)
    if not invariant:
        block_q = max(1, min(block_q, max_q))
    block_m = max(16, _next_pow2(block_q * group))
    q_blocks = -(-max_q // block_q)

    if block_n is None:
        # K+V tiles x pipeline stages must fit in shared memory, the acc in registers.
        block_n = 64 if block_m <= 64 and not ieee_dot else 32
    if block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")

    kv_cap = pages_per_lane * page_size
    max_tiles = max(1, -(-kv_cap // block_n))
    split_tiles = 0
    if invariant and num_splits is None:
        sms = num_sms or NUM_SMS_DEFAULT
        want = min(64, max(1, -(-8 * sms // (num_lanes * num_kv_heads))))
        split_tiles = max(2, _next_pow2(-(-max_tiles // want)))
        num_splits = -(-max_tiles // split_tiles)
        if num_splits * num_tokens * num_q_heads * head_dim >= 2**31:  # int32 offsets
            split_tiles, num_splits = max_tiles, 1
    if num_splits is None:
        # Flash decoding: enough equal programs for several waves over the SMs, so the last wave
        # is a small share of the time (a 32-lane x 8-kv-head decode is only 256 programs).
        # Splits of at least 2 KV tiles, and the merge's fp32 partials (written and read back:
        # 8 bytes per T x Hq x D element per split, mostly L2-resident) at most half the KV bytes
        # (2 x 2 per cached element): many splits for decode, fewer for verify, one for prefill.
        sms = num_sms or NUM_SMS_DEFAULT
        base_programs = num_lanes * q_blocks * num_kv_heads
        kv_bytes = 4 * num_lanes * kv_cap * num_kv_heads * head_dim
        partial_bytes = 8 * num_tokens * num_q_heads * head_dim
        num_splits = min(-(-8 * sms // base_programs), max_tiles // 2, 64,
                         kv_bytes // (2 * partial_bytes))
        if num_splits * num_tokens * num_q_heads * head_dim >= 2**31:  # int32 offsets
            num_splits = 1
        num_splits = max(1, num_splits)
    num_splits = max(1, min(num_splits, max_tiles))

    if num_warps is None:
        # ptxas on sm_90 (offline, see tests): bf16 decode 120 registers, verify 186, prefill
        # (128 rows, 8 warps) 136, no spills; fp32 (IEEE dots) needs 8 warps not to spill much.
        num_warps = 8 if block_m >= 128 or ieee_dot else 4
    if num_stages is None:
        num_stages = 3 if block_m <= 64 else 2
    return Plan(num_tokens=num_tokens, num_lanes=num_lanes, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                pages_per_lane=pages_per_lane, block_q=block_q, block_m=block_m,
                block_n=block_n, q_blocks=q_blocks, num_splits=num_splits, num_warps=num_warps,
                num_stages=num_stages, causal=bool(causal), ieee_dot=bool(ieee_dot),
                split_tiles=split_tiles)


def _plan_for(q_shape, pages_shape, page_table_shape, q_dtype, *, causal, max_q_len, **overrides):
    num_tokens, num_q_heads, head_dim = q_shape
    _, page_size, num_kv_heads, _ = pages_shape
    num_lanes, pages_per_lane = page_table_shape
    return make_plan(num_tokens=num_tokens, num_lanes=num_lanes, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     pages_per_lane=pages_per_lane, max_q_len=max_q_len, causal=causal,
                     ieee_dot=np.dtype(q_dtype) == np.float32, **overrides)


# ----------------------------------------------------------------------------------------------
# JAX entry point (GPU).
# ----------------------------------------------------------------------------------------------

def _device_num_sms() -> int | None:
    try:
        import jax
        return int(getattr(jax.devices()[0], "core_count", 0)) or None
    except Exception:  # noqa: BLE001 - a heuristic input only
        return None


def ragged_paged_attention_triton(
    q,  # [T, Hq, D]
    k_pages,  # [P, S, Hkv, D]
    v_pages,  # [P, S, Hkv, D]
    kv_lens,  # [B] int32
    page_table,  # [B, pages_per_lane] int32
    cu_q_lens,  # [B+1] int32
    *,
    sm_scale: float,
    causal: bool = True,
    max_q_len: int | None = None,
    **overrides,  # block_q, block_n, num_splits, num_warps, num_stages: for benchmarks
):
    """Same contract as ragged_paged_attention(impl="xla"); runs on an NVIDIA GPU."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.triton_ffi import triton_call

    from jspec.kernels.ragged_paged_attention import check_dtypes

    check_dtypes(q.dtype, k_pages.dtype, v_pages.dtype)  # q's dtype, or fp8 pages (widened on load)
    overrides.setdefault("num_sms", _device_num_sms())
    plan = _plan_for(q.shape, k_pages.shape, page_table.shape, q.dtype, causal=causal,
                     max_q_len=max_q_len, **overrides)
    fwd, merge = _kernels()
    num_tokens, num_q_heads, head_dim = q.shape
    inputs = (q, k_pages, v_pages, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
              cu_q_lens.astype(jnp.int32))
    common = dict(grid=plan.grid, num_warps=plan.num_warps, num_stages=plan.num_stages,
                  SM_SCALE=float(sm_scale), **plan.fwd_constexprs())
    if plan.num_splits == 1:
        # Rows past cu_q_lens[-1] are never visited by a program: zero the output first.
        out, _ = triton_call(
            *inputs, kernel=fwd, name="rpa_fwd",
            out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                       jax.ShapeDtypeStruct((1,), jnp.float32)),
            zeroed_outputs=(0,), **common)
        return out
    o_part, lse = triton_call(
        *inputs, kernel=fwd, name="rpa_fwd_split",
        out_shape=(
            jax.ShapeDtypeStruct((plan.num_splits, num_tokens, num_q_heads, head_dim),
                                 jnp.float32),
            jax.ShapeDtypeStruct((plan.num_splits, num_tokens, num_q_heads), jnp.float32)),
        **common)
    return triton_call(
        o_part, lse, cu_q_lens.astype(jnp.int32), kernel=merge, name="rpa_merge",
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(num_tokens,), num_warps=4,
        num_stages=1, **plan.merge_constexprs())


# ----------------------------------------------------------------------------------------------
# torch launcher: the same kernels and plan on torch tensors, for Triton's CPU interpreter
# (tests) or a CUDA torch build. Not used by the engine.
# ----------------------------------------------------------------------------------------------

def launch_torch(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, *, sm_scale: float,
                 causal: bool = True, max_q_len: int | None = None, **overrides):
    """CPU tensors need a process started with TRITON_INTERPRET=1 (see _kernels)."""
    import torch

    if q.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("CPU tensors run only under Triton's interpreter: start the process "
                           "with TRITON_INTERPRET=1")
    from jspec.kernels.ragged_paged_attention import check_dtypes
    check_dtypes(*(str(t.dtype).removeprefix("torch.") for t in (q, k_pages, v_pages)))

    dtype_np = np.float32 if q.dtype == torch.float32 else np.float16  # only fp32-ness matters
    plan = _plan_for(tuple(q.shape), tuple(k_pages.shape), tuple(page_table.shape), dtype_np,
                     causal=causal, max_q_len=max_q_len, **overrides)
    fwd, merge = _kernels()
    num_tokens, num_q_heads, head_dim = q.shape
    ints = [t.to(torch.int32).contiguous() for t in (kv_lens, page_table, cu_q_lens)]
    out = torch.zeros_like(q)
    if plan.num_splits == 1:
        lse = torch.empty((1,), dtype=torch.float32, device=q.device)
        fwd[plan.grid](q, k_pages, v_pages, *ints, out, lse, num_warps=plan.num_warps,
                       num_stages=plan.num_stages, SM_SCALE=float(sm_scale),
                       **plan.fwd_constexprs())
        return out
    # NaN-filled partials: a row the kernel forgot to write shows up in the test.
    o_part = torch.full((plan.num_splits, num_tokens, num_q_heads, head_dim), float("nan"),
                        dtype=torch.float32, device=q.device)
    lse = torch.full((plan.num_splits, num_tokens, num_q_heads), float("nan"),
                     dtype=torch.float32, device=q.device)
    fwd[plan.grid](q, k_pages, v_pages, *ints, o_part, lse, num_warps=plan.num_warps,
                   num_stages=plan.num_stages, SM_SCALE=float(sm_scale), **plan.fwd_constexprs())
    out = torch.full_like(q, float("nan"))
    merge[(num_tokens,)](o_part, lse, ints[2], out, num_warps=4, num_stages=1,
                         **plan.merge_constexprs())
    return out
