"""Scatter this step's new K/V rows into the paged cache (pure XLA).

A slot is `page * page_size + offset`. Padding tokens carry slots in page 0, the null page, which
no kernel reads through a valid length, so writing garbage there is harmless.

New rows are cast to the pool's dtype. An fp8 pool (the drafter's, EngineConfig.draft_kv_dtype)
gets them clipped to the format's finite range first: float8_e4m3fn has no infinity, so a value
past +-448 would be stored as NaN, and one NaN key poisons every query of the lane that attends
to it (the drafter would then propose garbage for the rest of the request).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    k_pages: jax.Array,  # [P, S, Hkv, D]
    v_pages: jax.Array,  # [P, S, Hkv, D]
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32
) -> tuple[jax.Array, jax.Array]:
    """Returns the pools with row `slot_mapping[t]` set to `k_new[t]` / `v_new[t]`.

    Jittable; donate the pools (`donate_argnums`) so XLA updates them in place. A slot outside
    the pool can never overwrite a live page: with several rows it is dropped, a single row
    (decode) goes to slot 0 of the null page instead (see scatter).
    """
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    num_tokens = slot_mapping.shape[0]
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        if new.shape != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(
                f"{name} has shape {new.shape}, expected {(num_tokens, num_kv_heads, head_dim)}")
    slots = slot_mapping.astype(jnp.int32)
    num_slots = num_pages * page_size

    def scatter(pages, new):
        rows = pages.reshape(num_slots, num_kv_heads, head_dim)
        new = to_pool_dtype(new, pages.dtype)
        if num_tokens == 1:
            # A decode step's single row: a plain in-place dynamic_update_slice. XLA lowers a
            # one-row scatter to one too, but keeps the scatter's bounds semantics with a select
            # against the old row: one more kernel per layer and pool (35 a step, 60 us on the
            # H100). A slot outside the pool goes to slot 0 instead, in the null page.
            slot = jnp.where((slots[0] >= 0) & (slots[0] < num_slots), slots[0], 0)
            rows = jax.lax.dynamic_update_slice(rows, new, (slot, 0, 0))
        else:
            rows = rows.at[slots].set(new, mode="drop")
        return rows.reshape(num_pages, page_size, num_kv_heads, head_dim)

    return scatter(k_pages, k_new), scatter(v_pages, v_new)


def to_pool_dtype(x: jax.Array, dtype) -> jax.Array:
    """x in the pool's dtype; 8-bit floats are clipped to their finite range first (an
    out-of-range cast gives NaN, see above). Other dtypes: a plain cast (a no-op when equal)."""
    dtype = jnp.dtype(dtype)
    if x.dtype != dtype and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8:
        big = float(jnp.finfo(dtype).max)  # 448 for e4m3fn: exact in bf16, fp16 and fp32
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)
