"""Ragged paged attention, Triton kernel on the GPU against the brute-force oracle and the XLA
reference. Every test is marked `gpu` (deselected by default); run on the H200 with

    pytest -m gpu tests/test_kernels_gpu.py

The CPU sweep (tests/test_kernels_attention.py) already runs these kernels under Triton's
interpreter; this file checks what only the GPU can: the compiled kernel through jax-triton
(masked loads, layouts, pipelining), big Qwen3-8B shapes, and use inside jit with donation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.kv_cache_write import write_kv
from jspec.kernels.ragged_paged_attention import (ragged_paged_attention,
                                                  ragged_paged_attention_xla)
from test_kernels_attention import CASES, Case, assert_close, bruteforce, make_inputs, to_jax

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _need_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    pytest.importorskip("jax_triton")


def _triton_fn(case: Case, **overrides):
    from jspec.kernels.ragged_paged_attention_triton import ragged_paged_attention_triton
    return jax.jit(functools.partial(ragged_paged_attention_triton, sm_scale=case.sm_scale,
                                     causal=case.causal, max_q_len=case.max_q_len,
                                     **overrides))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_bruteforce(case):
    x = make_inputs(case)
    out = _triton_fn(case, **dict(case.overrides))(*to_jax(case, x))
    assert out.dtype == jnp.dtype(case.dtype)
    assert_close(case, out, bruteforce(case, x), "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_triton_tilings_agree(num_splits, block_n):
    """Split counts above the tile count, tiles spanning pages and pages spanning tiles."""
    case = Case("tilings", (1, 8, 0, 3, 16, 1), (300, 77, 5, 64, 129, 1), page_size=32,
                group=4, head_dim=128, dtype="bfloat16", max_q_len=16)
    x = make_inputs(case, seed=block_n + num_splits)
    out = _triton_fn(case, num_splits=num_splits, block_n=block_n)(*to_jax(case, x))
    assert_close(case, out, bruteforce(case, x), f"splits={num_splits} block_n={block_n}")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_triton_sweep_small(page_size, group, dtype):
    """Mixed q_len 0..16 in one call, lengths off page boundaries, causal and non-causal."""
    for causal in (True, False):
        case = Case("sweep", (1, 16, 0, 7, 8, 2), (1, 16 + page_size, 3, page_size - 1, 200, 2),
                    page_size=page_size, group=group, dtype=dtype, causal=causal,
                    max_q_len=16)
        x = make_inputs(case, seed=page_size * group)
        out = _triton_fn(case)(*to_jax(case, x))
        assert_close(case, out, bruteforce(case, x), f"causal={causal}")


def _big_inputs(num_lanes, ctx, q_len, page_size, seed=0, ragged=True, dtype=jnp.bfloat16):
    """Qwen3-8B attention shape (32 q heads, 8 kv heads, D 128) on a shuffled page pool."""
    rng = np.random.default_rng(seed)
    hq, hkv, d = 32, 8, 128
    kv_lens = (rng.integers(ctx * 3 // 4, ctx + 1, num_lanes) if ragged
               else np.full(num_lanes, ctx)).astype(np.int32)
    kv_lens = np.maximum(kv_lens, q_len)
    pages_per_lane = -(-ctx // page_size)
    num_pages = 1 + num_lanes * pages_per_lane
    page_table = (1 + rng.permutation(num_lanes * pages_per_lane)).reshape(
        num_lanes, pages_per_lane).astype(np.int32)
    for b in range(num_lanes):  # unused entries point at the null page
        page_table[b, -(-kv_lens[b] // page_size):] = 0
    num_tokens = num_lanes * q_len
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (num_tokens, hq, d), dtype)
    k_pages = jax.random.normal(kk, (num_pages, page_size, hkv, d), dtype)
    v_pages = jax.random.normal(kv, (num_pages, page_size, hkv, d), dtype)
    cu_q_lens = jnp.arange(num_lanes + 1, dtype=jnp.int32) * q_len
    return (q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(page_table), cu_q_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_lanes,ctx,q_len,page_size", [
    (32, 4096, 1, 16), (32, 4096, 8, 16), (32, 4096, 1, 64), (32, 4096, 8, 64),
    (1, 4096, 1, 16), (1, 4096, 8, 64), (16, 512, 8, 16), (1, 4096, 512, 64)])
def test_triton_matches_xla_qwen3_8b_shapes(num_lanes, ctx, q_len, page_size):
    args = _big_inputs(num_lanes, ctx, q_len, page_size)
    kw = dict(sm_scale=128 ** -0.5, causal=True, max_q_len=q_len)
    ref = jax.jit(functools.partial(ragged_paged_attention_xla, **kw))(*args)
    out = jax.jit(functools.partial(ragged_paged_attention, impl="triton", **kw))(*args)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert err < 2e-2, err


@pytest.mark.gpu
def test_triton_noncausal_drafter_block():
    """The drafter's block of 7 queries attends to the context plus all 7 block keys."""
    args = _big_inputs(8, 1024, 7, 16, seed=2)
    kw = dict(sm_scale=128 ** -0.5, causal=False, max_q_len=7)
    ref = jax.jit(functools.partial(ragged_paged_attention_xla, **kw))(*args)
    out = jax.jit(functools.partial(ragged_paged_attention, impl="triton", **kw))(*args)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))) < 2e-2


@pytest.mark.gpu
def test_auto_is_triton_and_no_recompile():
    from jspec.kernels.ragged_paged_attention import _auto_impl
    assert _auto_impl() == "triton"
    args = _big_inputs(4, 256, 8, 16, seed=1)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.1, max_q_len=8))
    a = fn(*args)
    b = fn(*args[:3], args[3] - 1, *args[4:])  # new lengths: values, not shapes
    jax.block_until_ready((a, b))
    assert fn._cache_size() == 1
    assert not np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_write_then_attend_in_one_jit_with_donation():
    """Decode step as the engine runs it: write_kv into donated pools, then attention."""
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens = _big_inputs(4, 512, 1, 16, seed=3)
    page_size = k_pages.shape[1]
    # This step's token sits at position kv_len - 1 of each lane.
    pos = np.asarray(kv_lens) - 1
    slots = np.asarray(page_table)[np.arange(4), pos // page_size] * page_size + pos % page_size
    k_new = jax.random.normal(jax.random.PRNGKey(7), (4, 8, 128), jnp.bfloat16)
    v_new = jax.random.normal(jax.random.PRNGKey(8), (4, 8, 128), jnp.bfloat16)

    def step(k_pages, v_pages, impl):
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, jnp.asarray(slots))
        out = ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                                     sm_scale=0.1, max_q_len=1, impl=impl)
        return out, k_pages, v_pages

    ref, _, _ = jax.jit(functools.partial(step, impl="xla"))(k_pages, v_pages)
    out, k2, _ = jax.jit(functools.partial(step, impl="triton"), donate_argnums=(0, 1))(
        k_pages, v_pages)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))) < 2e-2
    np.testing.assert_array_equal(
        np.asarray(k2.reshape(-1, 8, 128)[slots].astype(jnp.float32)),
        np.asarray(k_new.astype(jnp.float32)))


def test_triton_kernels_take_the_ffi_target_with_the_legacy_bits():
    """kernels/triton_ffi.py: on this jaxlib the probe picks the FFI custom call (command-buffer
    compatible), the lowered module names it, and the batch-invariant linear gives the same bits
    as through jax-triton's legacy custom call (the same kernel and proto, another wrapper)."""
    from jspec.kernels import triton_ffi
    from jspec.kernels.linear_triton import linear_triton

    assert triton_ffi.route() == "ffi"
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 512), jnp.bfloat16)
    w = jax.random.normal(kw, (384, 512), jnp.bfloat16)
    assert triton_ffi.FFI_TARGET in jax.jit(linear_triton).lower(x, w).as_text()
    y_ffi = np.asarray(jax.jit(lambda x, w: linear_triton(x, w))(x, w))
    try:
        triton_ffi._register(False)
        legacy = jax.jit(lambda x, w: linear_triton(x, w) + 0.0)
        assert triton_ffi.FFI_TARGET not in legacy.lower(x, w).as_text()
        y_legacy = np.asarray(legacy(x, w))
    finally:
        triton_ffi._register(True)
    np.testing.assert_array_equal(y_ffi, y_legacy)
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(y_ffi, ref, rtol=2e-2, atol=2e-2)
