"""Ragged paged attention on CPU: a brute-force numpy oracle checks the XLA reference, the XLA
reference (and the oracle) check the Triton kernel run under Triton's CPU interpreter, plus
write_kv and the dispatch.

The Triton kernels run in ONE subprocess started with TRITON_INTERPRET=1: Triton chooses between
compiling and interpreting when a function is decorated, its own standard library included
(tl.cdiv, tl.max, ...), so the interpreter cannot be switched on inside a process that already
imported triton, and switching it on for this whole process would break `pytest -m gpu`, which
collects this file too. The worker patches two interpreter bugs, neither in our kernel:
  * triton < 3.9 turns a scalar into a Python int with int(array of shape (1,)), which numpy >= 2.4
    refuses (fixed upstream by .squeeze()); our kernel hits it in `range(tile_lo, tile_hi)`.
  * the interpreter's tl.dot multiplies bf16 operands as their raw uint16 bit patterns; the
    worker widens bf16 to fp32 first, which is what the GPU's bf16 x bf16 -> fp32 dot computes.
If triton is not installed the interpreter tests skip.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.kernels.kv_cache_write import write_kv
from triton_tools import ptxas_report, run_interpret_worker
from jspec.kernels.ragged_paged_attention import (ragged_paged_attention,
                                                  ragged_paged_attention_xla)


# ----------------------------------------------------------------------------------------------
# Cases (shared with tests/test_kernels_gpu.py)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int = 16
    num_kv_heads: int = 2
    group: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    kv_dtype: str | None = None  # the pages' dtype when not q's (float8_e4m3fn: the drafter's pool)
    causal: bool = True
    max_q_len: int | None = None
    pad_tokens: int = 3  # rows of q past cu_q_lens[-1]
    spare_pages: int = 1  # page-table entries per lane beyond the longest lane's need
    overrides: tuple = ()  # Triton plan overrides, e.g. (("num_splits", 3),)

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def page_dtype(self) -> str:
        return self.kv_dtype or self.dtype


CASES = [
    Case("decode_ps16_g4", (1, 1, 1, 0), (1, 17, 40, 9), max_q_len=1),
    Case("decode_long_ps16_heuristic_split", (1, 0), (700, 0), max_q_len=1),  # plan splits
    Case("decode_ps32_g1_split", (1, 1, 1), (33, 95, 64), page_size=32, group=1, max_q_len=1,
         overrides=(("num_splits", 3), ("block_n", 16))),
    Case("verify_ps16_g4", (8, 8, 0, 8), (8, 50, 33, 100), max_q_len=8),
    Case("verify_ps64_g8_bf16_split", (8, 8, 8), (70, 8, 129), page_size=64, group=8,
         dtype="bfloat16", max_q_len=8, overrides=(("num_splits", 4), ("block_n", 32))),
    Case("mixed_ps16_g2", (1, 5, 0, 16, 8, 3), (7, 21, 13, 16, 70, 3), group=2, max_q_len=16,
         overrides=(("block_n", 32),)),
    Case("mixed_ps32_g4_bf16_d128", (2, 16, 1, 0), (40, 31, 65, 0), page_size=32,
         head_dim=128, dtype="bfloat16", max_q_len=16, overrides=(("num_splits", 2),)),
    Case("mixed_ps64_g1_nomax", (3, 0, 9), (3, 5, 77), page_size=64, group=1),
    Case("drafter_noncausal_ps16_g4", (7, 7, 0), (30, 7, 4), causal=False, max_q_len=7,
         overrides=(("num_splits", 2),)),
    Case("drafter_noncausal_ps32_g2_bf16", (7, 7), (71, 40), page_size=32, group=2,
         dtype="bfloat16", causal=False, max_q_len=8),
    Case("prefill_chunks_ps16_g4", (40, 2, 23), (45, 130, 23), max_q_len=40,
         overrides=(("block_q", 8), ("block_n", 64))),
    Case("prefill_ps32_g8_bf16_split", (33, 1), (97, 50), page_size=32, group=8,
         dtype="bfloat16", max_q_len=40, overrides=(("block_q", 4), ("num_splits", 3))),
    Case("noncausal_ps64_g2_d128", (16, 4), (16, 200), page_size=64, group=2, head_dim=128,
         causal=False, max_q_len=16),
    # fp8 pages (EngineConfig.draft_kv_dtype): the drafter's block with bf16 queries, and a
    # split decode with fp32 queries (IEEE dots: the pages widen exactly, so fp32's tolerance).
    Case("drafter_noncausal_ps16_g4_bf16_fp8kv", (7, 7, 0), (30, 7, 4), dtype="bfloat16",
         kv_dtype="float8_e4m3fn", causal=False, max_q_len=7, overrides=(("num_splits", 2),)),
    Case("decode_ps16_g2_f32_fp8kv_split", (1, 1, 1), (17, 40, 9), group=2,
         kv_dtype="float8_e4m3fn", max_q_len=1, overrides=(("num_splits", 2), ("block_n", 16))),
]


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in `dtype`."""
    if dtype in ("bfloat16", "float8_e4m3fn"):
        return x.astype(getattr(ml_dtypes, dtype)).astype(np.float32)
    return x.astype(np.float32)


def make_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ragged batch on a shuffled page pool. Everything a correct kernel must not read is
    NaN: page 0 (the null page), slots at or past kv_len, unused pages and q's padding rows."""
    rng = np.random.default_rng(seed)
    num_lanes = len(case.q_lens)
    assert len(case.kv_lens) == num_lanes
    s, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
    hq = hkv * case.group
    pages_needed = [-(-kv // s) for kv in case.kv_lens]
    pages_per_lane = max(max(pages_needed), 1) + case.spare_pages
    num_pages = 1 + sum(pages_needed) + 2  # null page + live pages + two never used
    num_tokens = sum(case.q_lens) + case.pad_tokens

    k_pages = np.full((num_pages, s, hkv, d), np.nan, np.float32)
    v_pages = np.full((num_pages, s, hkv, d), np.nan, np.float32)
    page_table = np.zeros((num_lanes, pages_per_lane), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for b, kv_len in enumerate(case.kv_lens):
        for i in range(pages_needed[b]):
            page = free.pop()
            page_table[b, i] = page
            n = min(s, kv_len - i * s)
            k_pages[page, :n] = _round(rng.standard_normal((n, hkv, d)), case.page_dtype)
            v_pages[page, :n] = _round(rng.standard_normal((n, hkv, d)), case.page_dtype)

    q = _round(rng.standard_normal((num_tokens, hq, d)), case.dtype)
    cu_q_lens = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    q[cu_q_lens[-1]:] = np.nan
    return dict(q=q, k_pages=k_pages, v_pages=v_pages,
                kv_lens=np.asarray(case.kv_lens, np.int32), page_table=page_table,
                cu_q_lens=cu_q_lens)


def bruteforce(case: Case, x: dict[str, np.ndarray]) -> np.ndarray:
    """Loop-per-query float64 attention straight from the contract; padding rows are 0."""
    q, k_pages, v_pages = x["q"], x["k_pages"], x["v_pages"]
    num_tokens, hq, d = q.shape
    s = case.page_size
    out = np.zeros((num_tokens, hq, d), np.float64)
    heads_kv = np.arange(hq) // case.group
    for b, kv_len in enumerate(case.kv_lens):
        q_len = case.q_lens[b]
        start = x["cu_q_lens"][b]
        pos = np.arange(kv_len)
        pages = x["page_table"][b, pos // s]
        k_lhd = k_pages[pages, pos % s].astype(np.float64)  # [kv_len, Hkv, D]
        v_lhd = v_pages[pages, pos % s].astype(np.float64)
        for j in range(q_len):
            n = (kv_len - q_len + j + 1) if case.causal else kv_len
            if n <= 0:
                continue
            k_ghd = k_lhd[:n][:, heads_kv]  # [n, Hq, D]
            v_ghd = v_lhd[:n][:, heads_kv]
            scores_hn = np.einsum("hd,nhd->hn", q[start + j].astype(np.float64), k_ghd)
            scores_hn *= case.sm_scale
            p_hn = np.exp(scores_hn - scores_hn.max(-1, keepdims=True))
            p_hn /= p_hn.sum(-1, keepdims=True)
            out[start + j] = np.einsum("hn,nhd->hd", p_hn, v_ghd)
    return out


def tolerance(case: Case) -> float:
    # bf16: output rounding (2^-9 relative) plus p rounded to bf16 before the PV dot in kernels.
    return 2e-2 if case.dtype == "bfloat16" else 2e-5


def to_jax(case: Case, x: dict[str, np.ndarray]) -> tuple:
    dt, pdt = jnp.dtype(case.dtype), jnp.dtype(case.page_dtype)
    return (jnp.asarray(x["q"], dt), jnp.asarray(x["k_pages"], pdt), jnp.asarray(x["v_pages"], pdt),
            jnp.asarray(x["kv_lens"]), jnp.asarray(x["page_table"]), jnp.asarray(x["cu_q_lens"]))


def assert_close(case: Case, out, expected: np.ndarray, what: str) -> None:
    out = np.asarray(jnp.asarray(out, jnp.float32)) if not isinstance(out, np.ndarray) else out
    n_valid = sum(case.q_lens)
    assert out.shape == expected.shape, what
    assert np.all(out[n_valid:] == 0.0), f"{what}: padding rows are not zero"
    err = np.max(np.abs(out - expected)) if out.size else 0.0
    assert np.isfinite(out).all() and err <= tolerance(case), f"{what}: max abs err {err}"


# ----------------------------------------------------------------------------------------------
# XLA reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_xla_reference_matches_bruteforce(case):
    x = make_inputs(case)
    # jit: eager dispatch compiles every op separately, ~6x slower on CPU.
    fn = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=case.sm_scale,
                                   causal=case.causal, max_q_len=case.max_q_len))
    out = fn(*to_jax(case, x))
    assert out.dtype == jnp.dtype(case.dtype)
    assert_close(case, out, bruteforce(case, x), "xla")


def test_dispatch_auto_is_xla_on_cpu_and_jits():
    case = CASES[2]
    x = make_inputs(case, seed=1)
    args = to_jax(case, x)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=case.sm_scale, causal=True,
                                                   max_q_len=case.max_q_len, impl="auto"))
    assert_close(case, fn(*args), bruteforce(case, x), "auto")
    # New lengths are new array values, not new shapes: no retrace.
    kv_lens = args[3].at[1].add(-3)
    fn(*args[:3], kv_lens, *args[4:])
    assert fn._cache_size() == 1


def test_dispatch_rejects_bad_input():
    case = CASES[0]
    args = to_jax(case, make_inputs(case))
    with pytest.raises(ValueError, match="impl"):
        ragged_paged_attention(*args, sm_scale=1.0, impl="cuda")
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(*args[:5], args[5][:-1], sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention(args[0][:, :3], *args[1:], sm_scale=1.0)
    # Pages in another dtype than q's: only fp8 e4m3 pages under bf16 / fp32 queries.
    with pytest.raises(ValueError, match="pages in bfloat16 with q in float32"):
        ragged_paged_attention(args[0], args[1].astype(jnp.bfloat16), args[2].astype(jnp.bfloat16),
                               *args[3:], sm_scale=1.0)
    with pytest.raises(ValueError, match="float8_e4m3fn with bfloat16 / float32 queries"):
        ragged_paged_attention(args[0].astype(jnp.float16), args[1].astype(jnp.float8_e4m3fn),
                               args[2].astype(jnp.float8_e4m3fn), *args[3:], sm_scale=1.0)
    with pytest.raises(ValueError, match="k_pages and v_pages dtypes differ"):
        ragged_paged_attention(args[0], args[1].astype(jnp.float8_e4m3fn), *args[2:], sm_scale=1.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_xla_reference_fp8_pages_are_the_rounded_pages(dtype):
    """fp8 pages are read exactly: the same bits as pages pre-rounded to fp8 and stored in q's
    dtype (so an fp8 drafter pool costs only the rounding of what is written)."""
    case = Case("fp8", (7, 1, 7), (30, 17, 7), dtype=dtype, causal=False, max_q_len=7)
    q, k_pages, v_pages, *rest = to_jax(case, make_inputs(case, seed=5))
    k8, v8 = k_pages.astype(jnp.float8_e4m3fn), v_pages.astype(jnp.float8_e4m3fn)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=case.sm_scale, causal=False,
                                   max_q_len=7, impl="xla"))
    out8 = np.asarray(fn(q, k8, v8, *rest).astype(jnp.float32))
    ref = np.asarray(fn(q, k8.astype(q.dtype), v8.astype(q.dtype), *rest).astype(jnp.float32))
    assert np.isfinite(out8).all()
    np.testing.assert_array_equal(out8, ref)


# ----------------------------------------------------------------------------------------------
# write_kv
# ----------------------------------------------------------------------------------------------

def test_write_kv_round_trip():
    rng = np.random.default_rng(0)
    num_pages, s, hkv, d = 6, 16, 2, 8
    k_pages = jnp.zeros((num_pages, s, hkv, d), jnp.bfloat16)
    v_pages = jnp.zeros((num_pages, s, hkv, d), jnp.bfloat16)
    # Two lanes: lane 0 appends 3 tokens at positions 14..16 of pages [3, 1]; lane 1 writes
    # 2 tokens at 0..1 of page [5]; one padding token goes to the null page.
    slots = np.array([3 * s + 14, 3 * s + 15, 1 * s + 0, 5 * s + 0, 5 * s + 1, 0], np.int32)
    k_new = rng.standard_normal((6, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((6, hkv, d)).astype(np.float32)
    fn = jax.jit(write_kv, donate_argnums=(0, 1))
    k_out, v_out = fn(k_pages, v_pages, jnp.asarray(k_new, jnp.bfloat16),
                      jnp.asarray(v_new, jnp.bfloat16), jnp.asarray(slots))
    k_out = np.asarray(k_out.astype(jnp.float32))
    v_out = np.asarray(v_out.astype(jnp.float32))
    for t, slot in enumerate(slots):
        np.testing.assert_array_equal(k_out[slot // s, slot % s], _round(k_new[t], "bfloat16"))
        np.testing.assert_array_equal(v_out[slot // s, slot % s], _round(v_new[t], "bfloat16"))
    written = np.zeros((num_pages, s), bool)
    written[slots // s, slots % s] = True
    assert np.all(k_out[~written] == 0) and np.all(v_out[~written] == 0)


@pytest.mark.parametrize("slot", [3 * 16 + 5, 0, -1, 6 * 16, 10**6])
def test_write_kv_single_row(slot):
    """A decode step's one row (an in-place dynamic_update_slice): written where its slot says;
    a slot outside the pool writes only into the null page (page 0), never a live page."""
    num_pages, s, hkv, d = 6, 16, 2, 8
    rng = np.random.default_rng(1)
    k_pages = jnp.asarray(rng.standard_normal((num_pages, s, hkv, d)), jnp.float32)
    v_pages = k_pages + 1.0
    new = jnp.asarray(rng.standard_normal((1, hkv, d)), jnp.float32)
    k_out, v_out = jax.jit(write_kv)(k_pages, v_pages, new, new * 2, jnp.asarray([slot], jnp.int32))
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)
    inside = 0 <= slot < num_pages * s
    target = slot if inside else 0
    np.testing.assert_array_equal(k_out[target // s, target % s], np.asarray(new[0]))
    np.testing.assert_array_equal(v_out[target // s, target % s], np.asarray(new[0] * 2))
    keep = np.ones((num_pages, s), bool)
    keep[target // s, target % s] = False
    np.testing.assert_array_equal(k_out[keep], np.asarray(k_pages)[keep])
    np.testing.assert_array_equal(v_out[keep], np.asarray(v_pages)[keep])
    if not inside:  # live pages (1..5) untouched
        np.testing.assert_array_equal(k_out[1:], np.asarray(k_pages)[1:])


def test_write_kv_then_attend():
    """Decode step: write this step's K/V through write_kv, then attention sees it."""
    case = Case("wk", (1, 1), (20, 5), max_q_len=1, pad_tokens=0)
    x = make_inputs(case, seed=3)
    # Blank out the last token of each lane and write it back through write_kv.
    s = case.page_size
    slots, k_new, v_new = [], [], []
    for b, kv_len in enumerate(case.kv_lens):
        page, off = x["page_table"][b, (kv_len - 1) // s], (kv_len - 1) % s
        slots.append(page * s + off)
        k_new.append(x["k_pages"][page, off].copy())
        v_new.append(x["v_pages"][page, off].copy())
    expected = bruteforce(case, x)
    for slot in slots:
        x["k_pages"][slot // s, slot % s] = 0.0
        x["v_pages"][slot // s, slot % s] = 0.0
    q, k_pages, v_pages, *rest = to_jax(case, x)
    k_pages, v_pages = write_kv(k_pages, v_pages, jnp.asarray(np.stack(k_new)),
                                jnp.asarray(np.stack(v_new)), jnp.asarray(slots, jnp.int32))
    out = jax.jit(functools.partial(ragged_paged_attention, sm_scale=case.sm_scale, max_q_len=1))(
        q, k_pages, v_pages, *rest)
    assert_close(case, out, expected, "write_kv+attention")


def test_write_kv_into_fp8_pool_clips_to_its_finite_range():
    """float8_e4m3fn has no infinity: 1e4 cast plainly is NaN. write_kv stores +-448 instead, and
    in-range values as the plain cast rounds them."""
    k_pages = jnp.zeros((2, 4, 1, 4), jnp.float8_e4m3fn)
    new = jnp.asarray([[[1e4, -1e4, 460.0, 0.3]], [[447.0, -3.0, 1e-3, 1e30]]], jnp.float32)
    assert np.isnan(np.asarray(new.astype(jnp.float8_e4m3fn).astype(jnp.float32))).any()
    for dt in (jnp.float32, jnp.bfloat16):
        k_out, v_out = jax.jit(write_kv)(k_pages, k_pages, new.astype(dt), new.astype(dt),
                                         jnp.asarray([5, 2], jnp.int32))
        assert k_out.dtype == v_out.dtype == jnp.float8_e4m3fn
        rows = np.asarray(k_out.astype(jnp.float32)).reshape(8, 4)
        np.testing.assert_array_equal(rows[5], [448.0, -448.0, 448.0, 0.3125])
        np.testing.assert_array_equal(
            rows[2], np.asarray(jnp.asarray([448.0, -3.0, 1e-3, 448.0], dt)
                                .astype(jnp.float8_e4m3fn).astype(jnp.float32)))
        assert np.isfinite(rows).all()


def test_write_kv_rejects_bad_shapes():
    pages = jnp.zeros((2, 4, 2, 8))
    with pytest.raises(ValueError, match="k_new"):
        write_kv(pages, pages, jnp.zeros((3, 1, 8)), jnp.zeros((3, 2, 8)),
                 jnp.zeros((3,), jnp.int32))


# ----------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (one subprocess for all cases)
# ----------------------------------------------------------------------------------------------

def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def interpreted_outputs(tmp_path_factory):
    if not _triton_available():
        pytest.skip("triton (and torch) not installed: the Triton interpreter tests need them")
    work = tmp_path_factory.mktemp("triton_interp")
    spec = []
    arrays = {}
    for i, case in enumerate(CASES):
        for key, value in make_inputs(case).items():
            arrays[f"{i}.{key}"] = value
        spec.append(dict(index=i, dtype=case.dtype, page_dtype=case.page_dtype,
                         sm_scale=case.sm_scale, causal=case.causal,
                         max_q_len=case.max_q_len, overrides=dict(case.overrides)))
    np.savez(work / "in.npz", **arrays)
    (work / "spec.json").write_text(json.dumps(spec))
    run_interpret_worker(__file__, work)
    with np.load(work / "out.npz") as out:
        return {i: out[str(i)] for i in range(len(CASES))}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_triton_interpreted_matches_bruteforce(interpreted_outputs, index):
    case = CASES[index]
    assert_close(case, interpreted_outputs[index], bruteforce(case, make_inputs(case)),
                 "triton (interpreted)")


def test_triton_plan_heuristics():
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.ragged_paged_attention_triton import make_plan

    common = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, causal=True, ieee_dot=False,
                  num_sms=132)
    # The CPU case that relies on the heuristic really splits.
    c = next(c for c in CASES if c.name == "decode_long_ps16_heuristic_split")
    p = make_plan(num_tokens=sum(c.q_lens) + c.pad_tokens, num_lanes=2, num_q_heads=8,
                  num_kv_heads=2, head_dim=64, page_size=16, pages_per_lane=45, max_q_len=1,
                  causal=True, ieee_dot=True)
    assert p.num_splits > 1
    # Verify: all 8 queries x 4 heads of a kv head in one 32-row tile, one q block per lane.
    p = make_plan(num_tokens=256, num_lanes=32, page_size=16, pages_per_lane=256, max_q_len=8,
                  **common)
    assert (p.block_q, p.block_m, p.q_blocks) == (8, 32, 1)
    # Decode at batch 1: flash decoding splits the 4k context over many programs.
    p = make_plan(num_tokens=1, num_lanes=1, page_size=16, pages_per_lane=256, max_q_len=1,
                  **common)
    assert p.block_m == 16 and p.num_splits >= 16
    assert p.grid[0] * p.grid[1] * p.grid[2] >= 132
    # Big batch: one lane's KV still splits a little so the last wave over the SMs is small.
    p = make_plan(num_tokens=32, num_lanes=32, page_size=16, pages_per_lane=256, max_q_len=1,
                  **common)
    assert 2 <= p.num_splits <= 16
    # Prefill chunk: 128-row tiles over 16 q blocks, no split (partials would cost more than
    # the KV read).
    p = make_plan(num_tokens=512, num_lanes=1, page_size=64, pages_per_lane=64, max_q_len=512,
                  **common)
    assert (p.block_m, p.q_blocks, p.num_splits) == (128, 16, 1)


def _compile_sm90(plan, dtype: str, page_dtype: str | None = None):
    """Ahead-of-time compile of the fwd kernel for an H100/H200 (sm_90) with the real Triton
    compiler and the ptxas bundled in the triton wheel: no GPU needed. Pointer arguments carry
    the 16-byte divisibility that jax-triton declares for XLA buffers."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jspec.kernels.ragged_paged_attention_triton import _kernels

    fwd, merge = _kernels()
    target = GPUTarget("cuda", 90, 32)
    if plan.num_splits > 1:  # the merge kernel must compile too
        merge_constexprs = plan.merge_constexprs()
        merge_signature = dict(o_part_ptr="*fp32", lse_ptr="*fp32", cu_q_lens_ptr="*i32",
                               o_ptr=f"*{dtype}", **{k: "constexpr" for k in merge_constexprs})
        triton.compile(ASTSource(fn=merge, signature=merge_signature, constexprs=merge_constexprs,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in range(4)}),
                       target=target, options=dict(num_warps=4, num_stages=1))
    names = ["q_ptr", "k_ptr", "v_ptr", "kv_lens_ptr", "page_table_ptr", "cu_q_lens_ptr",
             "o_ptr", "lse_ptr"]
    types = [f"*{dtype}"] + [f"*{page_dtype or dtype}"] * 2 + ["*i32"] * 3 + [
        f"*{dtype}" if plan.num_splits == 1 else "*fp32", "*fp32"]
    constexprs = dict(SM_SCALE=0.088, **plan.fwd_constexprs())
    signature = dict(zip(names, types), **{k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    compiled = triton.compile(
        ASTSource(fn=fwd, signature=signature, constexprs=constexprs, attrs=attrs),
        target=target, options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    ptx = compiled.asm["ptx"]
    info = ptxas_report(ptx, "rpa")
    return dict(shared=compiled.metadata.shared,
                vector_copies=len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", ptx)),
                spills="bytes spill" in info and not re.search(r"\b0 bytes spill stores", info),
                ptxas=info)


@pytest.mark.parametrize("max_q_len,num_tokens,num_lanes", [(1, 32, 32), (8, 256, 32),
                                                            (512, 512, 1)],
                         ids=["decode", "verify", "prefill"])
def test_triton_compiles_for_sm90(max_q_len, num_tokens, num_lanes):
    """The GPU compiler (not the interpreter) accepts the kernel for the Qwen3-8B shape, K/V tiles
    stream through 16-byte cp.async (coalesced, pipelined), nothing spills, shared memory fits."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.ragged_paged_attention_triton import interpreter_enabled, make_plan
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set for this process")
    plan = make_plan(num_tokens=num_tokens, num_lanes=num_lanes, num_q_heads=32, num_kv_heads=8,
                     head_dim=128, page_size=16, pages_per_lane=256, max_q_len=max_q_len,
                     causal=True, ieee_dot=False, num_sms=132)
    try:
        result = _compile_sm90(plan, "bf16")
    except ImportError as e:  # a triton build without the NVIDIA backend
        pytest.skip(f"no NVIDIA backend in this triton: {e}")
    assert result["shared"] <= 227 * 1024
    assert result["vector_copies"] > 0
    assert not result["spills"], result["ptxas"]


@pytest.mark.parametrize("max_q_len,causal", [(1, True), (7, False)], ids=["decode", "draft_block"])
def test_triton_compiles_for_sm90_with_fp8_pages(max_q_len, causal):
    """The drafter's fp8 pool (fp8e4nv, jax-triton's name for float8_e4m3fn) under bf16 queries:
    the sm_90 compiler converts the loaded tiles, K/V still stream through cp.async, no spills."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.ragged_paged_attention_triton import interpreter_enabled, make_plan
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set for this process")
    plan = make_plan(num_tokens=32 * max_q_len, num_lanes=32, num_q_heads=32, num_kv_heads=8,
                     head_dim=128, page_size=16, pages_per_lane=256, max_q_len=max_q_len,
                     causal=causal, ieee_dot=False, num_sms=132)
    try:
        result = _compile_sm90(plan, "bf16", page_dtype="fp8e4nv")
    except ImportError as e:  # a triton build without the NVIDIA backend
        pytest.skip(f"no NVIDIA backend in this triton: {e}")
    assert result["shared"] <= 227 * 1024
    assert result["vector_copies"] > 0
    assert not result["spills"], result["ptxas"]


# ----------------------------------------------------------------------------------------------
# Interpreter worker (runs in the subprocess)
# ----------------------------------------------------------------------------------------------

def _patch_interpreter() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original_patch_tensor = interp._patch_lang_tensor

    def patch_tensor(tensor, scope):
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch_tensor

    original_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        def widen(h):
            if h.dtype == tl.bfloat16:  # stored as uint16 bit patterns
                return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                           tl.float32)
            return h
        return original_dot(self, widen(a), widen(b), d, *args)

    interp.InterpreterBuilder.create_dot = create_dot

    original_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        # Triton 3.6's interpreter casts an integer to bf16 with numpy's astype(uint16), the
        # bit pattern type it stores bf16 in (an int8 weight widened in-kernel, linear_triton).
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar.is_int():
            bits = src.data.astype(np.float32).view(np.uint32)
            nearest_even = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return interp.TensorHandle(nearest_even.astype(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl


def _interpret_worker(work: Path) -> None:
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    _patch_interpreter()
    from jspec.kernels.ragged_paged_attention_triton import launch_torch

    spec = json.loads((work / "spec.json").read_text())
    outputs = {}
    with np.load(work / "in.npz") as arrays:
        for item in spec:
            i = item["index"]
            q, k, v = (torch.from_numpy(arrays[f"{i}.{n}"]).to(getattr(torch, item[dt]))
                       for n, dt in (("q", "dtype"), ("k_pages", "page_dtype"),
                                     ("v_pages", "page_dtype")))
            ints = [torch.from_numpy(arrays[f"{i}.{n}"])
                    for n in ("kv_lens", "page_table", "cu_q_lens")]
            out = launch_torch(q, k, v, *ints, sm_scale=item["sm_scale"], causal=item["causal"],
                               max_q_len=item["max_q_len"], **item["overrides"])
            outputs[str(i)] = out.float().numpy()
    np.savez(work / "out.npz", **outputs)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interpret-worker":
    _interpret_worker(Path(sys.argv[2]))


def test_prefill_sweep_tiles_compile_for_sm90_without_spills():
    """Every tile scripts/bench_attention.py --prefill-sweep times on the GPU compiles for sm_90
    (a 512-query chunk, Qwen3-8B heads, page size 16) with no register spills and fits shared
    memory, so device time is not spent on tiles that could not win."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from script_loader import load_script

    from jspec.kernels.ragged_paged_attention_triton import interpreter_enabled, make_plan
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set for this process")
    configs = load_script("bench_attention").prefill_sweep_configs()
    assert configs[0] == {} and len(configs) > 10
    for overrides in configs:
        plan = make_plan(num_tokens=512, num_lanes=1, num_q_heads=32, num_kv_heads=8,
                         head_dim=128, page_size=16, pages_per_lane=256, max_q_len=512,
                         causal=True, ieee_dot=False, num_sms=132, **overrides)
        key = (plan.block_q, plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits)
        assert all(getattr(plan, k) == v for k, v in overrides.items()), (overrides, plan)
        try:
            result = _compile_sm90(plan, "bf16")
        except ImportError as e:  # a triton build without the NVIDIA backend
            pytest.skip(f"no NVIDIA backend in this triton: {e}")
        assert result["shared"] <= 227 * 1024, key
        assert not result["spills"], (key, result["ptxas"])
