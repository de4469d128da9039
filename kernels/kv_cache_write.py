"""Scatter this step's new K/V rows into the paged cache (pure XLA).

A slot is `page * page_size + offset`. Padding tokens carry slots in page 0, the null page, which
no kernel reads through a valid length, so writing garbage there is harmless.
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

    Jittable; donate the pools (`donate_argnums`) so XLA updates them in place. Slots outside the
    pool are dropped rather than clamped, so a bad slot can never overwrite a live page.
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

    def scatter(pages, new):
        rows = pages.reshape(num_pages * page_size, num_kv_heads, head_dim)
        rows = rows.at[slots].set(new.astype(pages.dtype), mode="drop")
        return rows.reshape(num_pages, page_size, num_kv_heads, head_dim)

    return scatter(k_pages, k_new), scatter(v_pages, v_new)
