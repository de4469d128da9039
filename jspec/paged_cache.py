"""The paged KV cache: per-layer page pools on the device, a page allocator on the host.

Device: for every layer a key pool and a value pool of shape [num_pages, page_size, Hkv, hd], in
CacheShape.dtype (the model's; the drafter's pool may be float8_e4m3fn, EngineConfig.draft_kv_dtype).
Host: a free list of page ids. Page 0 is the null page: never allocated, it is where padding and
idle lanes write, and no valid length ever reads it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_pages: int  # including the null page
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, keys and values."""
        return (2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim
                * jnp.dtype(self.dtype).itemsize)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers (in the pool's dtype)."""
        return self.page_bytes // self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def init_kv_caches(shape: CacheShape, device: jax.Device | None = None) -> list[tuple[jax.Array, jax.Array]]:
    pool = (shape.num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    # Committed to the device, like the params: mixing committed and uncommitted arguments would
    # give the programs a second compiled variant.
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    zeros = jax.jit(lambda: jnp.zeros(pool, shape.dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(shape.num_layers)]


class PageAllocator:
    """Host free list of page ids 1..num_pages-1 (O(1), deterministic order)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: lowest ids first, so runs are reproducible.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._in_use = np.zeros(num_pages, bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._in_use[pages] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == NULL_PAGE or not self._in_use[p]:
                raise RuntimeError(f"page {p} freed but not allocated (double free?)")
            self._in_use[p] = False
        self._free.extend(reversed(pages))
