"""Ragged paged attention as a Pallas TPU kernel (Mosaic), tested on CPU in TPU interpret mode.

Same contract as ragged_paged_attention_xla (see ragged_paged_attention.py); the GPU kernel's idea
(ragged_paged_attention_triton.py) in TPU form:

  * Grid (lanes, kv heads), one program per lane x kv head. The wrapper gathers the lane's queries
    with jnp ops into a dense block q[B, Hkv, R, D] whose row r = i * G + g is query i of the lane
    (i < max_q_len, static) with q head kv_head * G + g (GQA packing, as in the Triton kernel), R
    padded up to a multiple of 8 sublanes; the kernel's output block scatters back the same way.
    So each KV page is read once per lane and kv head for all queries and all G q heads.
  * kv_lens, the page table (flattened to 1-D for SMEM) and cu_q_lens are scalar-prefetched.
  * K/V pages stay in HBM (memory_space=pl.ANY). The kernel walks the lane's pages with
    lax.fori_loop up to cdiv(kv_hi, page_size) (kv_hi: the last key any of the lane's computed
    queries may see) and DMAs page p's [S, D] slice of its kv head into a VMEM buffer with
    pltpu.make_async_copy; two buffers per K and V, page p + 1's copy is started before page p is
    consumed (double buffering; one DMA semaphore per buffer slot and K/V).
  * Online softmax (running max, running sum, fp32 accumulator carried through the loop); a row
    with no visible key gets 0, never NaN. Slots at or past kv_len (stale tokens, NaN in tests)
    are masked in the scores and zeroed in V before the PV dot.
  * Page dtype: q's, or float8_e4m3fn widened to q's dtype right after the VMEM load (exact), so
    the dots (q dtype in, fp32 out) and the softmax are the bf16 / fp32 kernel's.

Validated: only in TPU interpret mode on CPU (pltpu.InterpretParams: simulated HBM/VMEM, DMAs and
semaphores), against the XLA reference (tests/test_kernels_pallas_tpu.py). NOT validated on a real
TPU: whether Mosaic accepts the layouts (the strided per-kv-head DMA k_pages[page, :, h, :], a
[S, D] VMEM buffer with S = 8 or 16 in bf16 / fp8, which want 16 / 32 sublanes; head_dim not a
multiple of 128; the 1-D SMEM page table, which must fit SMEM), compile time, and performance
(one page per DMA and per dot is a small MXU tile; no split-K for long decode lanes, so a
long-context decode with few lanes uses few cores; the q gather/scatter is done by XLA around
the call). impl="auto" on a TPU therefore stays on the XLA reference until this is run there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROW_ALIGN = 8  # sublanes: the packed q block's rows are padded to a multiple of this


def _rpa_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [B] int32
    page_table_ref,  # [B * pages_per_lane] int32
    cu_q_lens_ref,  # [B + 1] int32
    # inputs
    q_ref,  # VMEM block [R, D] (lane, kv head squeezed)
    k_hbm,  # [P, S, Hkv, D] in HBM
    v_hbm,  # [P, S, Hkv, D] in HBM
    # outputs
    o_ref,  # VMEM block [R, D]
    # scratch
    k_buf,  # VMEM [2, S, D] page dtype
    v_buf,  # VMEM [2, S, D] page dtype
    sems,  # DMA semaphores [2 (K/V), 2 (slot)]
    *,
    sm_scale: float,
    causal: bool,
    group: int,
    max_q: int,
    page_size: int,
    pages_per_lane: int,
):
    lane = pl.program_id(0)
    kv_head = pl.program_id(1)
    num_rows, head_dim = q_ref.shape
    compute_dtype = q_ref.dtype

    kv_len = kv_lens_ref[lane]
    q_start = cu_q_lens_ref[lane]
    q_len = cu_q_lens_ref[lane + 1] - q_start
    q_done = jnp.minimum(q_len, max_q)  # queries of this lane that are computed

    # Keys any computed query may see: [0, kv_hi). No queries: no pages.
    if causal:
        kv_hi = jnp.clip(kv_len - q_len + q_done, 0, kv_len)
    else:
        kv_hi = kv_len
    kv_hi = jnp.where(q_done > 0, jnp.maximum(kv_hi, 0), 0)
    num_pages = (kv_hi + page_size - 1) // page_size

    rows = lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
    row_q = rows // group  # query index within the lane
    row_valid = row_q < q_done  # [R, 1]
    q_pos = kv_len - q_len + row_q  # absolute position of each row's query

    def copies(p, slot):
        page = page_table_ref[lane * pages_per_lane + p]
        k_copy = pltpu.make_async_copy(k_hbm.at[page, :, kv_head, :], k_buf.at[slot],
                                       sems.at[0, slot])
        v_copy = pltpu.make_async_copy(v_hbm.at[page, :, kv_head, :], v_buf.at[slot],
                                       sems.at[1, slot])
        return k_copy, v_copy

    @pl.when(num_pages > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    q = q_ref[...]

    def body(p, carry):
        m_prev, l_prev, acc_prev = carry
        slot = p % 2

        @pl.when(p + 1 < num_pages)
        def _():
            for c in copies(p + 1, 1 - slot):
                c.start()

        k_copy, v_copy = copies(p, slot)
        k_copy.wait()
        v_copy.wait()
        k = k_buf[slot].astype(compute_dtype)  # [S, D]
        v = v_buf[slot].astype(compute_dtype)

        k_pos = p * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)  # [1, S]
        mask = row_valid & (k_pos < kv_len)  # [R, S]
        if causal:
            mask &= k_pos <= q_pos
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [R, S]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        prob = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
        alpha = jnp.exp(m_prev - m_safe)  # m_prev = -inf: 0
        l_new = alpha * l_prev + jnp.sum(prob, axis=1, keepdims=True)
        # Slots past kv_len may hold anything (NaN in tests): 0 * NaN would leak through the dot.
        k_valid_col = (p * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)) < kv_len
        v = jnp.where(k_valid_col, v, jnp.zeros_like(v))
        pv = jnp.dot(prob.astype(compute_dtype), v, preferred_element_type=jnp.float32)
        return m_new, l_new, alpha * acc_prev + pv

    init = (jnp.full((num_rows, 1), -jnp.inf, jnp.float32),
            jnp.zeros((num_rows, 1), jnp.float32),
            jnp.zeros((num_rows, head_dim), jnp.float32))
    _, l_fin, acc = lax.fori_loop(0, num_pages, body, init)
    out = jnp.where(l_fin > 0.0, acc / jnp.where(l_fin > 0.0, l_fin, 1.0), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def ragged_paged_attention_pallas_tpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, S, Hkv, D]
    v_pages: jax.Array,  # [P, S, Hkv, D]
    kv_lens: jax.Array,  # [B] int32
    page_table: jax.Array,  # [B, pages_per_lane] int32
    cu_q_lens: jax.Array,  # [B+1] int32
    *,
    sm_scale: float,
    causal: bool = True,
    max_q_len: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, Hq, D] in q.dtype; rows past cu_q_lens[-1] are zeros
    """The Pallas TPU kernel behind impl="pallas_tpu". interpret: False compiles for the TPU
    (Mosaic); True or a pltpu.InterpretParams runs it in TPU interpret mode (any backend, CPU in
    the tests; True means InterpretParams() with its defaults: NaN-filled uninitialized memory,
    DMAs executed on wait, out-of-bounds reads raise)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_lanes, pages_per_lane = page_table.shape
    group = num_q_heads // num_kv_heads
    max_q = num_tokens if max_q_len is None else max(1, min(max_q_len, num_tokens))
    if interpret is True:
        interpret = pltpu.InterpretParams()
    if num_lanes == 0 or num_tokens == 0:
        return jnp.zeros_like(q)

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]

    # Pack each lane's queries: [B, Qm, Hkv, G, D] -> [B, Hkv, Qm * G, D], padding rows zero.
    j = jnp.arange(max_q, dtype=jnp.int32)
    q_valid_bq = j[None, :] < q_lens[:, None]
    tok_bq = jnp.where(q_valid_bq, cu_q_lens[:-1, None] + j[None, :], 0)
    q_bq = jnp.where(q_valid_bq[:, :, None, None], q[tok_bq], jnp.zeros((), q.dtype))
    q_bkrd = (q_bq.reshape(num_lanes, max_q, num_kv_heads, group, head_dim)
              .transpose(0, 2, 1, 3, 4)
              .reshape(num_lanes, num_kv_heads, max_q * group, head_dim))
    num_rows = -(-(max_q * group) // ROW_ALIGN) * ROW_ALIGN
    if num_rows != max_q * group:
        q_bkrd = jnp.pad(q_bkrd, ((0, 0), (0, 0), (0, num_rows - max_q * group), (0, 0)))

    kernel = functools.partial(_rpa_kernel, sm_scale=float(sm_scale), causal=bool(causal),
                               group=group, max_q=max_q, page_size=page_size,
                               pages_per_lane=pages_per_lane)
    block = pl.BlockSpec((None, None, num_rows, head_dim), lambda b, h, *_: (b, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_lanes, num_kv_heads),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block,
        scratch_shapes=[pltpu.VMEM((2, page_size, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, page_size, head_dim), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))],
    )
    out_bkrd = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_lanes, num_kv_heads, num_rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(kv_lens, page_table.astype(jnp.int32).reshape(-1), cu_q_lens, q_bkrd, k_pages, v_pages)

    # Unpack: [B, Hkv, R, D] -> [B, Qm, Hq, D]; padding rows scatter out of bounds and are dropped.
    out_bqhd = (out_bkrd[:, :, :max_q * group]
                .reshape(num_lanes, num_kv_heads, max_q, group, head_dim)
                .transpose(0, 2, 1, 3, 4)
                .reshape(num_lanes, max_q, num_q_heads, head_dim))
    dest_bq = jnp.where(q_valid_bq, tok_bq, num_tokens)
    return jnp.zeros_like(q).at[dest_bq].set(out_bqhd, mode="drop")
