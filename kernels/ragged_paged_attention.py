"""Ragged paged attention: one interface for decode, verify and chunked prefill.

All lanes' queries are concatenated along T; lane b owns q[cu_q_lens[b]:cu_q_lens[b+1]] and its
keys/values live in the pages listed by page_table[b]. Query j of a lane with q_len queries sits
at absolute position kv_len - q_len + j (this step's K/V are already written into the cache).

Implementations behind `impl`:
  "xla"        the reference below: gather the lane's pages into a dense cache, masked softmax.
               The test oracle and the CPU path; clear rather than fast.
  "triton"     ragged_paged_attention_triton.py: split-K paged kernel through jax-triton (GPU).
  "triton_invariant"  the same kernel with its batch-invariant plan: a query's output bits do
               not depend on how many queries its lane has in the call (decode 1, verify up to
               8), so verify and decode agree exactly. The XLA reference makes no such promise.
  "pallas_tpu" ragged_paged_attention_pallas_tpu.py: one Pallas (Mosaic) program per lane x kv
               head, pages DMA'd from HBM into VMEM. Tested only in TPU interpret mode on CPU,
               not yet on a TPU. Off a TPU it refuses unless JSPEC_PALLAS_TPU_INTERPRET=1, which
               runs it in interpret mode (slow: for tests). "auto" never picks it.
  "auto"       triton on GPU (xla if jax-triton is missing), xla elsewhere.

`max_q_len` is a static bound on every lane's q_len that kernels tile by (1 decode, k+1 verify,
the chunk for prefill); None means T. Queries of a lane beyond it are not computed, so it must
really bound them. kv_len >= q_len is assumed; a query with no visible key gets zeros.

Pages are in q's dtype, or float8_e4m3fn (the drafter's fp8 pool, EngineConfig.draft_kv_dtype):
every implementation widens them to q's dtype as it reads them.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "triton", "triton_invariant", "pallas_tpu")


def check_shapes(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens) -> None:
    """Raises a ValueError that names the mismatch; shapes are static so this is free under jit."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got {q.shape}")
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages/v_pages must both be [P, S, Hkv, D], got {k_pages.shape} "
                         f"and {v_pages.shape}")
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the pages ({kv_head_dim}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [B, pages_per_lane], got {page_table.shape}")
    num_lanes = page_table.shape[0]
    if kv_lens.shape != (num_lanes,):
        raise ValueError(f"kv_lens must be [{num_lanes}], got {kv_lens.shape}")
    if cu_q_lens.shape != (num_lanes + 1,):
        raise ValueError(f"cu_q_lens must be [{num_lanes + 1}], got {cu_q_lens.shape}")


# Page dtypes other than q's: the drafter's fp8 pool, read by bf16 or fp32 queries.
NARROW_PAGE_DTYPES = {jnp.dtype("float8_e4m3fn"): (jnp.dtype("bfloat16"), jnp.dtype("float32"))}


def check_dtypes(q_dtype, k_dtype, v_dtype) -> None:
    """Pages in q's dtype, or fp8 e4m3 pages with bf16/fp32 queries (widened exactly on read)."""
    q_dtype, k_dtype, v_dtype = map(jnp.dtype, (q_dtype, k_dtype, v_dtype))
    if k_dtype != v_dtype:
        raise ValueError(f"k_pages and v_pages dtypes differ: {k_dtype}, {v_dtype}")
    if k_dtype != q_dtype and q_dtype not in NARROW_PAGE_DTYPES.get(k_dtype, ()):
        raise ValueError(f"pages in {k_dtype} with q in {q_dtype}: pages must be in q's dtype, or "
                         "float8_e4m3fn with bfloat16 / float32 queries")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, S, Hkv, D]
    v_pages: jax.Array,  # [P, S, Hkv, D]
    kv_lens: jax.Array,  # [B] int32, including this step's queries
    page_table: jax.Array,  # [B, pages_per_lane] int32
    cu_q_lens: jax.Array,  # [B+1] int32
    *,
    sm_scale: float,
    causal: bool = True,
    max_q_len: int | None = None,
    impl: str = "auto",
) -> jax.Array:  # [T, Hq, D] in q.dtype; rows past cu_q_lens[-1] are zeros
    check_shapes(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens)
    check_dtypes(q.dtype, k_pages.dtype, v_pages.dtype)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = _auto_impl()
    args = (q, k_pages, v_pages, kv_lens, page_table, cu_q_lens)
    if impl == "xla":
        return ragged_paged_attention_xla(*args, sm_scale=sm_scale, causal=causal,
                                          max_q_len=max_q_len)
    if impl in ("triton", "triton_invariant"):
        from jspec.kernels.ragged_paged_attention_triton import ragged_paged_attention_triton
        return ragged_paged_attention_triton(*args, sm_scale=sm_scale, causal=causal,
                                             max_q_len=max_q_len,
                                             invariant=impl == "triton_invariant")
    # impl == "pallas_tpu". Off a TPU only in interpret mode, and only when asked for (tests).
    import os
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and os.environ.get("JSPEC_PALLAS_TPU_INTERPRET") != "1":
        raise RuntimeError(
            f"impl='pallas_tpu' needs a TPU backend (this one is {jax.default_backend()!r}); set "
            "JSPEC_PALLAS_TPU_INTERPRET=1 to run it in Pallas TPU interpret mode (slow, for "
            "tests), or use impl='xla'")
    from jspec.kernels.ragged_paged_attention_pallas_tpu import ragged_paged_attention_pallas_tpu
    return ragged_paged_attention_pallas_tpu(*args, sm_scale=sm_scale, causal=causal,
                                             max_q_len=max_q_len, interpret=not on_tpu)


@functools.lru_cache(maxsize=None)
def _auto_impl() -> str:
    if jax.default_backend() == "gpu":
        try:
            import jax_triton  # noqa: F401
            import triton  # noqa: F401
            return "triton"
        except ImportError as e:
            warnings.warn(f"jax-triton is not importable ({e}); ragged_paged_attention falls "
                          "back to the slow XLA reference on GPU")
    return "xla"


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, S, Hkv, D]
    v_pages: jax.Array,  # [P, S, Hkv, D]
    kv_lens: jax.Array,  # [B]
    page_table: jax.Array,  # [B, pages_per_lane]
    cu_q_lens: jax.Array,  # [B+1]
    *,
    sm_scale: float,
    causal: bool = True,
    max_q_len: int | None = None,
) -> jax.Array:
    """Reference: per lane, gather pages to a dense cache and run masked attention in fp32.

    Memory is O(B * max_q_len * pages_per_lane * page_size * Hq): fine for tests and CPU, not for
    long prefill on an accelerator.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_lanes, pages_per_lane = page_table.shape
    group = num_q_heads // num_kv_heads
    max_q = num_tokens if max_q_len is None else max(1, min(max_q_len, num_tokens))
    kv_cap = pages_per_lane * page_size

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]

    # Dense per-lane K/V: [B, pages_per_lane, S, Hkv, D] -> [B, L, Hkv, D] (s indexes L). Slots
    # at or past kv_len (stale tokens, the null page) are zeroed so NaN there cannot leak via p*v.
    s = jnp.arange(kv_cap, dtype=jnp.int32)
    kv_valid_bs = s[None, :] < kv_lens[:, None]
    # Pages are read in the query's dtype, as the Triton kernel reads them: a no-op for pages in
    # the model dtype; exact for an fp8 pool (every float8_e4m3fn value is a bf16/fp16/fp32 one).
    k_bskd = k_pages[page_table].reshape(num_lanes, kv_cap, num_kv_heads, head_dim).astype(q.dtype)
    v_bskd = v_pages[page_table].reshape(num_lanes, kv_cap, num_kv_heads, head_dim).astype(q.dtype)
    k_bskd = jnp.where(kv_valid_bs[:, :, None, None], k_bskd.astype(jnp.float32), 0.0)
    v_bskd = jnp.where(kv_valid_bs[:, :, None, None], v_bskd.astype(jnp.float32), 0.0)

    # Per-lane queries [B, Qm, Hkv, G, D]; rows j >= q_len are padding (masked, never written).
    j = jnp.arange(max_q, dtype=jnp.int32)
    q_valid_bq = j[None, :] < q_lens[:, None]  # [B, Qm]
    tok_bq = jnp.where(q_valid_bq, cu_q_lens[:-1, None] + j[None, :], 0)
    q_bqkgd = q[tok_bq].reshape(num_lanes, max_q, num_kv_heads, group, head_dim)

    scores_bkgqs = jnp.einsum("bqkgd,bskd->bkgqs", q_bqkgd.astype(jnp.float32), k_bskd) * sm_scale

    q_pos_bq = kv_lens[:, None] - q_lens[:, None] + j[None, :]  # absolute query positions
    mask_bqs = jnp.broadcast_to(kv_valid_bs[:, None, :], (num_lanes, max_q, kv_cap))
    if causal:
        mask_bqs &= s[None, None, :] <= q_pos_bq[:, :, None]
    mask_bkgqs = mask_bqs[:, None, None, :, :]
    scores_bkgqs = jnp.where(mask_bkgqs, scores_bkgqs, -jnp.inf)

    # Softmax that gives 0 (not NaN) to a row with no visible key.
    m = jnp.max(scores_bkgqs, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask_bkgqs, jnp.exp(scores_bkgqs - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out_bqkgd = jnp.einsum("bkgqs,bskd->bqkgd", p, v_bskd)

    # Back to [T, Hq, D]; padding rows of each lane scatter out of bounds and are dropped.
    out_bqhd = out_bqkgd.reshape(num_lanes, max_q, num_q_heads, head_dim).astype(q.dtype)
    dest_bq = jnp.where(q_valid_bq, tok_bq, num_tokens)
    out = jnp.zeros_like(q)
    return out.at[dest_bq].set(out_bqhd, mode="drop")
