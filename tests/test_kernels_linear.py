"""The batch-invariant kernels on CPU (the linear layer; the attention kernel's invariant plan): run under Triton's interpreter (one subprocess, as in
test_kernels_attention.py) against a float64 oracle over a sweep of shapes, plus the property it
exists for: a row computed alone and among other rows comes out with the same bits. On the GPU
the same checks run in tests/test_kernels_gpu.py."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from test_kernels_attention import _triton_available
from triton_tools import run_interpret_worker

# (M, N, K, dtype, block_n, block_m, dot_m[, split_k]): K not a multiple of BLOCK_K, N not of
# block_n, M of 1..100 rows; None: the plan's choice. At these tiny N the plan keeps 16-row tiles
# (wider ones would leave SMs idle), so five force wide row tiles: several row blocks per program
# (dot_m < block_m), some partly or wholly past M, fp32 FMA dots, one 64-row dot (2-warp route).
# The last five split K (at these short K the plan would not): 2 and 4 splits of K = 512 (4
# steps of 128), K = 500 and 300 (the last split's last step masked), with wide row tiles too.
SHAPES = [(1, 48, 200, "float32", None, None, None), (3, 64, 128, "float32", 16, None, None),
          (17, 40, 300, "float32", 32, None, None), (8, 128, 256, "bfloat16", None, None, None),
          (40, 24, 96, "bfloat16", 16, None, None), (1, 16, 1, "float32", None, None, None),
          (40, 40, 200, "bfloat16", 32, 64, 32), (70, 24, 300, "bfloat16", 16, 64, 16),
          (100, 24, 160, "bfloat16", 16, 128, 32), (20, 24, 160, "float32", 16, 32, 16),
          (50, 40, 130, "bfloat16", 64, 64, 64),
          (5, 40, 512, "bfloat16", 16, None, None, 2),
          (3, 24, 512, "bfloat16", None, None, None, 4),
          (17, 40, 500, "bfloat16", 32, None, None, 2), (9, 24, 300, "float32", 16, None, None, 3),
          (40, 40, 512, "bfloat16", 32, 64, 32, 4)]
INVARIANCE_ROWS = (1, 5, 16, 33, 70)  # the same first row inside GEMMs of these many rows
INV_N, INV_K = 48, 384
INV_SPLITS = (2, 4)  # the same, split: K = 512 (4 steps) in 2 or 4 runs
INV_K_SPLIT = 512
# (M, N, K, split): serial walks against the split grid where K ends inside the last split's
# last step (500 = 2 runs of 2 steps, 300 = 3 runs of 1 step) and M inside a row tile.
SERIAL_RAGGED = [(70, 40, 500, 2), (33, 24, 300, 3)]
# (block_m, dot_m, block_n): row tilings of all 70 rows, 16..128-row tiles of 1..4 row blocks.
TILINGS = [(16, 16, 16), (16, 16, 64), (32, 32, 32), (32, 16, 16), (64, 32, 64), (64, 16, 32),
           (64, 64, 16), (128, 32, 32), (128, 64, 64), (128, 128, 16)]
SPLIT_TILINGS = [(16, 16, 16), (32, 16, 32), (64, 32, 64), (128, 64, 16)]  # with INV_SPLITS
# int8 weights (the drafter's weight-only int8): (M, N, K, x dtype, plan overrides): the decode
# tile, a 2-way split, wide row tiles of two row blocks, the serial split walk, a v3 (wgmma)
# tile, fp32 FMA dots.
INT8_CASES = [(5, 40, 300, "bfloat16", dict(block_n=16)),
              (7, 24, 512, "bfloat16", dict(block_n=16, split_k=2)),
              (40, 40, 200, "bfloat16", dict(block_m=64, dot_m=32, block_n=32)),
              (70, 24, 300, "bfloat16", dict(block_m=64, dot_m=64, block_n=16, split_k=3,
                                             split_serial=True, num_warps=2)),
              (70, 24, 300, "bfloat16", dict(mma="v3")),
              (3, 48, 200, "float32", {})]
# The DSpark-8B drafter's int8 weights as its GEMMs read them ([N, K]: qkv apart, o, gate_up,
# down, fc, Markov W2, the head rows) at 1, 16 and 32 lanes of 7 block rows.
DRAFTER_8B = {"q": (4096, 4096), "kv": (1024, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288), "fc": (4096, 20480), "markov_w2": (151936, 256),
              "head": (151936, 4096)}
DRAFTER_ROWS = (7, 112, 224)
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
            "down": (4096, 12288), "lm_head": (151936, 4096)}
PLAN_ROWS = (1, 8, 16, 32, 64, 128, 256)  # decode at 1..16 lanes, verify (8-row blocks) up to 32


def _inputs(i, M, N, K, dtype):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(M, K)).astype(np.float32)
    w = (rng.normal(size=(N, K)) * 0.1).astype(np.float32)
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x, w


@pytest.fixture(scope="module", autouse=True)
def _v2_family():
    """The tests below that do not name a family are v2's (mma.sync tiles, 16..128-row row
    tiles); the default "mixed" and v3 are tested by name. Set in the environment too, for the
    interpreter's worker process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JSPEC_LINEAR_MMA", "v2")
        if _triton_available():
            import jspec.kernels.linear_triton as lt
            mp.setattr(lt, "MMA_FAMILY", "v2")
        yield


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not _triton_available():
        pytest.skip("triton (and torch) not installed")
    work = tmp_path_factory.mktemp("linear_interp")
    run_interpret_worker(__file__, work)
    with np.load(work / "out.npz") as out:
        return {k: out[k] for k in out.files}


@pytest.mark.parametrize("index", range(len(SHAPES)),
                         ids=[f"M{m}_N{n}_K{k}_{d}_bn{bn}_bm{bm}_dm{dm}" + "".join(
                              f"_sk{sk}" for sk in rest) for m, n, k, d, bn, bm, dm, *rest
                              in SHAPES])
def test_linear_interpreted_matches_float64(interpreted, index):
    M, N, K, dtype = SHAPES[index][:4]
    x, w = _inputs(index, M, N, K, dtype)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = interpreted[str(index)]
    assert got.shape == (M, N) and np.isfinite(got).all()  # every element written
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_linear_rows_are_batch_invariant(interpreted):
    """Row 0 alone and among 5, 16, 33 or 70 rows: the same bits (the interpreter multiplies tiles
    with numpy, so this checks the tiling contract: fixed row tile and reduction steps)."""
    first = interpreted["inv1"][0]
    for m in INVARIANCE_ROWS[1:]:
        np.testing.assert_array_equal(interpreted[f"inv{m}"][0], first)


def test_linear_row_tilings_give_the_same_bits(interpreted):
    """All 70 rows through every row tiling (16..128-row tiles of 1..4 row blocks, 16..128-row
    dots, 16..64 columns): the default plan's bits, and the right values. Under the interpreter's
    row-exact dot this holds by construction once every row block is loaded, masked and stored
    where it belongs, which is what it checks. That the GPU's MMA also gives a row the same bits
    in every tiling is the H200's part (tests/test_batch_invariance_gpu.py, passed there); the sm_90
    compile checks below pin the instruction it relies on."""
    base = interpreted["inv70"]
    x, w = _inputs(99, max(INVARIANCE_ROWS), INV_N, INV_K, "bfloat16")
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(base, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for bm, dm, bn in TILINGS:
        got = interpreted[f"tiling_{bm}_{dm}_{bn}"]
        assert got.shape == base.shape and np.isfinite(got).all()
        np.testing.assert_array_equal(got, base, err_msg=f"block_m={bm} dot_m={dm} block_n={bn}")


def _int8_inputs(i, M, N, K, dtype):
    rng = np.random.default_rng(200 + i)
    x = rng.normal(size=(M, K)).astype(np.float32)
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x, rng.integers(-127, 128, size=(N, K)).astype(np.int8)


@pytest.mark.parametrize("index", range(len(INT8_CASES)),
                         ids=[f"M{c[0]}_N{c[1]}_K{c[2]}_{c[3]}_" + "_".join(
                              f"{k}{v}" for k, v in c[4].items()) for c in INT8_CASES])
def test_int8_weights_are_widened_exactly_in_the_kernel(interpreted, index):
    """int8 weight values go through the kernel as they are (the drafter's weight-only int8,
    jspec/draft_weights.py): each tile widened to x's dtype as it is loaded, so the result has
    the bits of the same kernel on the values widened beforehand, in every plan shape (split,
    serial, wide tiles, wgmma, fp32), and the right values: x @ values^T, unscaled."""
    M, N, K, dtype, _ = INT8_CASES[index]
    x, v = _int8_inputs(index, M, N, K, dtype)
    got, widened = interpreted[f"int8_{index}"], interpreted[f"int8_{index}_widened"]
    assert got.shape == (M, N) and np.isfinite(got).all()
    np.testing.assert_array_equal(got, widened)
    want = x.astype(np.float64) @ v.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_linear_refuses_a_weight_of_another_float_dtype():
    """x and w share a dtype, or w holds int8 values: anything else is refused by name."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import jax.numpy as jnp

    from jspec.kernels.linear_triton import linear_triton_partials
    with pytest.raises(ValueError, match="int8 values"):
        linear_triton_partials(jnp.zeros((2, 16), jnp.bfloat16), jnp.zeros((4, 16), jnp.float32))


def test_v3_family_plans_tile_every_row_count(interpreted):
    """The wgmma family's plans (64-row single-dot tiles, or 128 rows; decode's rows padded into
    one tile) store every row of 1..70-row GEMMs where it belongs, with the values the v2 plan
    gives under the interpreter's row-exact dot (on the GPU the two families give different
    bits: another MMA instruction)."""
    base = interpreted["inv70"]
    for m in INVARIANCE_ROWS:
        got = interpreted[f"v3_inv{m}"]
        assert got.shape == (m, INV_N)
        np.testing.assert_array_equal(got, base[:m], err_msg=f"{m} rows")
    np.testing.assert_array_equal(interpreted["v3_tile128_bn32"], base)


@pytest.mark.parametrize("split", INV_SPLITS)
def test_split_k_rows_are_batch_invariant(interpreted, split):
    """With K split (fixed by the shape, never by M): row 0 alone and among 5, 16, 33 or 70 rows,
    and all 70 rows through 16..128-row tiles, give the same bits; the values are right."""
    base = interpreted[f"sk{split}_inv70"]
    for m in INVARIANCE_ROWS:
        np.testing.assert_array_equal(interpreted[f"sk{split}_inv{m}"][0], base[0],
                                      err_msg=f"{m} rows")
    for bm, dm, bn in SPLIT_TILINGS:
        got = interpreted[f"sk{split}_tiling_{bm}_{dm}_{bn}"]
        assert got.shape == base.shape and np.isfinite(got).all()
        np.testing.assert_array_equal(got, base, err_msg=f"block_m={bm} dot_m={dm} block_n={bn}")
    x, w = _inputs(98, max(INVARIANCE_ROWS), INV_N, INV_K_SPLIT, "bfloat16")
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(base, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("split", INV_SPLITS)
def test_split_k_is_the_ordered_sum_of_fixed_walks(interpreted, split):
    """What the invariance argument says the split computes, bit for bit: split s is the unsplit
    walk over its own K range (K / S, whole 128-steps), and y = ((p_0 + p_1) + ...) + p_{S-1}
    in fp32, in that order. Each p_s is the unsplit kernel run on the K slice alone. Controls:
    2 runs of 2 steps, (d0 + d1) + (d2 + d3), differ from the unsplit walk ((d0 + d1) + d2) + d3
    somewhere; 4 runs of 1 step are that very walk, so they equal it to the bit."""
    base = interpreted[f"sk{split}_inv70"]
    parts = [interpreted[f"sk{split}_part{s}"] for s in range(split)]
    y = parts[0]
    for p in parts[1:]:
        y = (y + p).astype(np.float32)
    np.testing.assert_array_equal(base, y)
    if split > 2:  # another order of the same partials: (p0 + p1) + (p2 + p3) differs somewhere
        other = (parts[0] + parts[1]) + (parts[2] + parts[3])
        assert (other != base).any()
    for bm in (16, 64):  # the serial walk (wide GEMMs): the same ordered sum, bit for bit
        np.testing.assert_array_equal(interpreted[f"sk{split}_serial_{bm}"], base,
                                      err_msg=f"serial, {bm}-row tiles")
    unsplit = interpreted["sk1_inv70"]
    if split < INV_K_SPLIT // 128:
        assert (unsplit != base).any()
        np.testing.assert_allclose(unsplit, base, rtol=1e-5, atol=1e-5 * np.abs(base).max())
    else:
        np.testing.assert_array_equal(unsplit, base)


@pytest.mark.parametrize("case", SERIAL_RAGGED, ids=lambda c: f"M{c[0]}_K{c[2]}_sk{c[3]}")
def test_serial_split_walk_equals_the_split_grid_at_ragged_k(interpreted, case):
    """The serial walk (one program, the runs in turn) stores the split grid's bits when K ends
    inside the last run's last step and M inside the last row tile; both are the product."""
    M, N, K, sk = case
    grid = interpreted[f"ragged_{M}_{K}_{sk}_False"]
    serial = interpreted[f"ragged_{M}_{K}_{sk}_True"]
    assert serial.shape == (M, N) and np.isfinite(serial).all()
    np.testing.assert_array_equal(serial, grid)
    x, w = _inputs(97, M, N, K, "bfloat16")
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(serial, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _legacy_plan(M, N, K, sms=132):
    """The plan before wide row tiles, which FORCE_BLOCK_M = 16 must give back."""
    block_n = next((bn for bn in (128, 64, 32) if -(-M // 16) * -(-N // bn) >= 2 * sms), 16)
    return dict(block_m=16, dot_m=16, block_n=block_n, num_warps=4,
                num_stages=max(2, min(4, (160 * 1024) // ((16 + block_n) * 128 * 2))))


def _plan_fields(plan):
    return {k: getattr(plan, k) for k in ("block_m", "dot_m", "block_n", "num_warps", "num_stages")}


QWEN3_8B_SPLITS = {"qkv": 2, "o": 2, "gate_up": 1, "down": 3, "lm_head": 1}


def test_split_k_depends_on_n_and_k_only(monkeypatch):
    """The K splits are fixed by (N, K): the same for every row count (the invariance), fp32 or
    bf16, any SM count and any tile override; 1 for the wide gate_up and lm_head. Splits cut the
    ceil(K / 128) steps evenly, else the rule falls back to fewer (o wants 3 of 32 steps: 2) and
    an override is refused; short K is not split."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import jspec.kernels.linear_triton as lt
    from jspec.kernels.linear_triton import BLOCK_K, MAX_SPLIT_K, SPLIT_MIN_STEPS, _split_k
    assert lt.FORCE_SPLIT_K is None  # the default since the H200 timed it: plans take the rule
    for name, (N, K) in QWEN3_8B.items():
        want = QWEN3_8B_SPLITS[name]
        assert _split_k(N, K) == want, name
        for M in PLAN_ROWS + (2, 3, 5, 7, 9, 100, 200, 255):
            for kw in ({}, dict(ieee_dot=True), dict(num_sms=114), dict(block_m=16),
                       dict(block_n=128), dict(num_warps=8), dict(mma="v3"), dict(mma="mixed")):
                plan = lt.make_plan(M, N, K, **kw)
                assert plan.split_k == want, (name, M, kw)
                # The serial walk (no partials) only for wide GEMMs of the v3 family.
                serial = want > 1 and M >= lt.V3_SERIAL_MIN_ROWS and plan.mma == "v3"
                assert plan.split_serial == serial, (name, M, kw)
                assert plan.partials == (1 if serial else want)
                assert plan.constexprs()["SPLIT_SERIAL"] == serial
                grid = plan.grid
                assert grid[2:] == ((want,) if plan.partials > 1 else ())
                assert plan.out_shape == ((M, N) if plan.partials == 1 else (want, M, N))
        if want > 1:  # whole steps, each split long enough
            assert K % (want * BLOCK_K) == 0 and K // want // BLOCK_K >= SPLIT_MIN_STEPS
    # The rule's fallback: o (32 steps) would take 3 splits for 528 programs; 3 does not divide
    # 32, so 2. Too short a K is not split; N small asks for at most MAX_SPLIT_K.
    assert -(-lt.SPLIT_PROGRAMS // (4096 // 16)) == 3 and _split_k(4096, 4096) == 2
    assert _split_k(4096, 2048) == 1 and _split_k(1024, 1024) == 1
    assert _split_k(512, 65536) == MAX_SPLIT_K
    assert _split_k(4096, 4096 + 128) == 1  # 33 steps: 3 runs of 11 too short, 2 uneven
    # Overrides: any split that cuts the steps evenly (other bits, as invariant); else refused.
    assert lt.make_plan(1, 4096, 4096, split_k=4).split_k == 4
    assert lt.make_plan(256, 48, 500, block_m=16, block_n=16, split_k=2).grid == (16, 3, 2)
    assert lt.make_plan(1, 4096, 4096, split_k=1).grid == (1, 256)
    assert lt.make_plan(1, 4096, 4096, split_k=1).constexprs()["SPLIT_K"] == 1
    for bad in (0, 3, 5):
        with pytest.raises(ValueError, match="split_k"):
            lt.make_plan(1, 4096, 4096, split_k=bad)
    # A serial walk needs one row block; an unsplit plan is never serial.
    with pytest.raises(ValueError, match="serial"):
        lt.make_plan(256, 4096, 4096, mma="v2", split_serial=True)
    assert lt.make_plan(256, 4096, 4096, mma="v2", block_m=16, split_serial=True).grid[2:] == ()
    assert not lt.make_plan(512, 24576, 4096, mma="v3", split_serial=True).split_serial
    # FORCE_SPLIT_K = 1: the unsplit walk everywhere (the bits of before split-K).
    monkeypatch.setattr(lt, "FORCE_SPLIT_K", 1)
    for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS):
        plan = lt.make_plan(M, N, K, mma="mixed")
        assert plan.split_k == 1 and not plan.split_serial and plan.grid[2:] == ()


def test_plan_depends_on_the_shape_only_where_it_may(monkeypatch):
    if not _triton_available():
        pytest.skip("triton not installed")
    import jspec.kernels.linear_triton as lt
    from jspec.kernels.linear_triton import BLOCK_K, MMA_M, SMEM_BUDGET, make_plan
    for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS):
        plan = make_plan(M, N, K)
        assert plan.constexprs()["BLOCK_K"] == BLOCK_K  # never from the shape
        assert plan.block_m % plan.dot_m == 0 and plan.dot_m % MMA_M == 0
        assert plan.dot_m < 64 or plan.num_warps < 4  # else wgmma (module docstring)
        assert plan.num_stages * (plan.block_m + plan.block_n) * BLOCK_K * 2 <= SMEM_BUDGET
        if M <= 16:  # decode: the 16-row tile, exactly as before wide row tiles
            assert _plan_fields(plan) == _legacy_plan(M, N, K), (M, N, K)
    decode = make_plan(1, 4096, 4096)
    verify = make_plan(256, 4096, 4096)
    # A skinny GEMM takes the narrowest tile so that every SM has programs; a wide one wider tiles.
    assert decode.block_n == 16 and decode.grid[0] * decode.grid[1] >= 132
    assert make_plan(1, 24576, 4096).block_n == 64
    assert verify.block_n > decode.block_n
    # Verify at 32 lanes (256 rows) reads each weight tile 2-4 times instead of 16.
    # The tiles measured fastest on the H200 (docs/benchmarks.md): 64 x 128, two 32-row dots.
    assert (verify.block_m, verify.dot_m, verify.block_n, verify.num_warps) == (64, 32, 128, 4)
    gate_up = make_plan(256, 24576, 4096)
    assert (gate_up.block_m, gate_up.dot_m, gate_up.block_n, gate_up.num_warps) == (64, 32, 128, 4)
    assert (make_plan(32, 6144, 4096).block_m, make_plan(32, 6144, 4096).block_n) == (32, 64)
    assert make_plan(256, 24576, 4096, ieee_dot=True).block_m == 16  # fp32: FMA dots, kept small
    # The one-line fallback: FORCE_BLOCK_M = 16 gives back the fixed 16-row tile everywhere.
    monkeypatch.setattr(lt, "FORCE_BLOCK_M", 16)
    for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS):
        assert _plan_fields(make_plan(M, N, K)) == _legacy_plan(M, N, K), (M, N, K)
    monkeypatch.undo()
    # Overrides: a 64+-row dot only with 1-2 warps, at most 4 row blocks, powers of two.
    assert make_plan(256, 4096, 4096, block_m=64, num_warps=2).dot_m == 64
    assert make_plan(256, 4096, 4096, block_m=128, num_warps=4).dot_m == 32
    with pytest.raises(ValueError, match="wgmma"):
        make_plan(256, 4096, 4096, block_m=64, dot_m=64, num_warps=4)
    with pytest.raises(ValueError, match="row blocks"):
        make_plan(256, 4096, 4096, block_m=128, dot_m=16)
    with pytest.raises(ValueError, match="block_m"):
        make_plan(256, 4096, 4096, block_m=48)
    with pytest.raises(ValueError, match="empty"):
        make_plan(0, 8, 8)


def test_v3_plans_are_one_wgmma_tile_whatever_the_rows(monkeypatch):
    """The v3 (wgmma) family: at every Qwen3-8B shape and row count one 64-row dot with 4 warps
    per program (the row tile never follows M, so a row sits at r % 64 of its fragment in decode
    and verify alike), K walked as in v2; fp32 inputs keep v2's FMA plan; JSPEC_LINEAR_MMA's
    module default picks the family; bad families and tiles are refused by name."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import jspec.kernels.linear_triton as lt
    from jspec.kernels.linear_triton import BLOCK_K, SMEM_BUDGET, make_plan
    for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS):
        p = make_plan(M, N, K, mma="v3")
        tuned = 16 < M <= lt.V3_TUNED_MAX_ROWS  # the measured verify tiles
        split = p.split_k
        assert p.split_serial == (split > 1 and M >= lt.V3_SERIAL_MIN_ROWS), (M, N, K)
        grid_split = split > 1 and not p.split_serial  # the split axis: 17..64 rows
        long_walk = grid_split and K // BLOCK_K // split >= 32  # down: 3 runs of 32 steps
        if tuned and grid_split:  # 128 columns unless too few programs (o at 64 rows: 64)
            enough = -(-M // 64) * -(-N // 128) * split >= lt.V3_SPLIT_MIN_PROGRAMS
            assert p.block_n == (128 if enough else 64), (M, N, K)
        elif M > 16:  # unsplit or serial: the unsplit plan's tiles
            assert p.block_n == (64 if tuned and N <= 4096 else 128), (M, N, K)
        warps = 8 if tuned and (N >= lt.V3_WIDE_N or long_walk) else 4
        if p.split_serial and split > 2 and p.block_n >= 128:  # the running total's registers
            warps = 8
        assert (p.mma, p.block_m, p.dot_m, p.num_warps) == ("v3", 64, 64, warps), (M, N, K)
        assert p.constexprs()["BLOCK_K"] == BLOCK_K and p.split_k == make_plan(M, N, K).split_k
        assert p.num_stages * (p.block_m + p.block_n) * BLOCK_K * 2 <= SMEM_BUDGET
        assert p.grid[0] == -(-M // 64)
    assert make_plan(1, 4096, 4096, mma="v3").grid == (1, 256, 2)  # decode: 16 columns, 2 splits
    assert make_plan(256, 4096, 4096, ieee_dot=True, mma="v3").mma == "v2"
    assert make_plan(256, 4096, 4096, mma="v3", block_m=128).num_warps == 8
    for bad, match in ((dict(block_m=32), "64- or 128-row"), (dict(dot_m=32), "one dot"),
                       (dict(num_warps=2), "warpgroups"), (dict(block_n=512), "block_n")):
        with pytest.raises(ValueError, match=match):
            make_plan(256, 4096, 4096, mma="v3", **bad)
    with pytest.raises(ValueError, match="mma family"):
        make_plan(8, 4096, 4096, mma="v4")
    monkeypatch.setattr(lt, "MMA_FAMILY", "mixed")  # the default (mma_family_from_env below)
    assert make_plan(8, 4096, 4096).mma == "v2" and make_plan(128, 4096, 4096).mma == "v3"
    monkeypatch.setattr(lt, "MMA_FAMILY", "v3")
    assert make_plan(8, 4096, 4096).mma == "v3"
    # "mixed": v2's plan up to MIXED_V2_MAX_ROWS rows, v3's above, tile for tile.
    for M in PLAN_ROWS:
        mixed = make_plan(M, 4096, 4096, mma="mixed")
        fam = "v2" if M <= lt.MIXED_V2_MAX_ROWS else "v3"
        assert mixed == make_plan(M, 4096, 4096, mma=fam), M
    assert make_plan(lt.MIXED_V2_MAX_ROWS + 1, 4096, 4096, mma="mixed").mma == "v3"
    assert make_plan(256, 4096, 4096, ieee_dot=True, mma="mixed").mma == "v2"
    from jspec.kernels.linear import MMA_ENV, mma_family_from_env
    monkeypatch.delenv(MMA_ENV, raising=False)
    assert mma_family_from_env() == "mixed"
    monkeypatch.setenv(MMA_ENV, "v3")
    assert mma_family_from_env() == "v3"  # what the module reads at import, and records name


def test_combine_is_the_ordered_chain_of_adds():
    """The JAX combine of the split partials (what linear_triton runs after the kernel) is the
    left-to-right chain ((p0 + p1) + p2) + p3 for every M, as compiled by XLA (here the CPU
    backend; the GPU's algebraic simplifier is the same): no reduce over the split axis, whose
    order XLA could pick by shape, and the same bits as numpy's fp32 chain."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import jax
    import jax.numpy as jnp

    from jspec.kernels.linear_triton import combine
    rng = np.random.default_rng(3)
    for S, M in itertools.product((2, 3, 4), (1, 8, 256)):
        p = rng.normal(size=(S, M, 64)) * 10.0 ** rng.integers(-3, 4, size=(S, M, 64))
        p = p.astype(np.float32)
        f = jax.jit(lambda a, S=S: combine(a, S))
        hlo = f.lower(jnp.asarray(p)).compile().as_text()
        assert " reduce(" not in hlo and "reduce-window" not in hlo
        want = p[0]
        for s in range(1, S):
            want = want + p[s]
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(p))), want, err_msg=f"S={S} M={M}")
        if S == 4:  # the test can tell orders apart
            assert ((p[0] + p[1]) + (p[2] + p[3]) != want).any()


def test_linear_interface_and_xla_twin():
    import jax.numpy as jnp

    from jspec.kernels.linear import check_impl, linear
    x, w = _inputs(7, 3, 10, 20, "float32")
    y = linear(jnp.asarray(x).reshape(1, 3, 20), jnp.asarray(w))
    assert y.shape == (1, 3, 10) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y)[0], x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl"):
        linear(jnp.asarray(x), jnp.asarray(w), impl="cuda")
    with pytest.raises(ValueError, match="GPU"):
        check_impl("triton")  # this is the CPU suite


def _row_exact_dot() -> None:
    """Make the interpreter's tl.dot independent of where a row sits in its tile, as the GPU's
    MMA is: numpy's matmul is not (its BLAS kernels treat edge rows differently), so products
    are summed in float64 and rounded once to the accumulator's fp32."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    def wide(h):
        if h.dtype == tl.bfloat16:  # stored as uint16 bit patterns
            return (h.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return h.data.astype(np.float64)

    def create_dot(self, a, b, d, *args):
        prod = np.matmul(wide(a), wide(b))
        return interp.TensorHandle((prod.astype(d.data.dtype) + d.data), d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot


def _interpret_worker(work: Path) -> None:
    import torch

    from test_kernels_attention import _patch_interpreter
    _patch_interpreter()  # bf16 widening and the scalar __index__ fix
    _row_exact_dot()
    from jspec.kernels.linear_triton import launch_torch

    out = {}
    for i, (M, N, K, dtype, block_n, block_m, dot_m, *split) in enumerate(SHAPES):
        x, w = _inputs(i, M, N, K, dtype)
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        out[str(i)] = launch_torch(torch.from_numpy(x).to(tdt), torch.from_numpy(w).to(tdt),
                                   block_n=block_n, block_m=block_m, dot_m=dot_m,
                                   num_warps=2 if (dot_m or 0) >= 64 else None,
                                   split_k=split[0] if split else None).numpy()
    x, w = (torch.from_numpy(a).to(torch.bfloat16)
            for a in _inputs(99, max(INVARIANCE_ROWS), INV_N, INV_K, "bfloat16"))
    for m in INVARIANCE_ROWS:
        out[f"inv{m}"] = launch_torch(x[:m], w, block_n=16).numpy()
        out[f"v3_inv{m}"] = launch_torch(x[:m], w, mma="v3").numpy()  # one 64-row tile or two
    out["v3_tile128_bn32"] = launch_torch(x, w, mma="v3", block_m=128, block_n=32).numpy()
    for bm, dm, bn in TILINGS:  # the interpreter ignores the warps; 2 let a 64+-row dot through
        out[f"tiling_{bm}_{dm}_{bn}"] = launch_torch(x, w, block_m=bm, dot_m=dm, block_n=bn,
                                                     num_warps=2 if dm >= 64 else None).numpy()
    x, w = (torch.from_numpy(a).to(torch.bfloat16)
            for a in _inputs(98, max(INVARIANCE_ROWS), INV_N, INV_K_SPLIT, "bfloat16"))
    out["sk1_inv70"] = launch_torch(x, w, block_n=16, split_k=1).numpy()
    for sk in INV_SPLITS:
        for m in INVARIANCE_ROWS:
            out[f"sk{sk}_inv{m}"] = launch_torch(x[:m], w, block_n=16, split_k=sk).numpy()
        for bm, dm, bn in SPLIT_TILINGS:
            out[f"sk{sk}_tiling_{bm}_{dm}_{bn}"] = launch_torch(
                x, w, block_m=bm, dot_m=dm, block_n=bn, split_k=sk,
                num_warps=2 if dm >= 64 else None).numpy()
        for bm in (16, 64):  # the splits in turn in one program: the grid's bits, no partials
            out[f"sk{sk}_serial_{bm}"] = launch_torch(
                x, w, block_m=bm, dot_m=bm, block_n=16, split_k=sk, split_serial=True,
                num_warps=2 if bm >= 64 else None).numpy()
        ks = INV_K_SPLIT // sk
        for s in range(sk):  # each split's walk alone: the unsplit kernel on its K slice
            out[f"sk{sk}_part{s}"] = launch_torch(x[:, s * ks:(s + 1) * ks].contiguous(),
                                                  w[:, s * ks:(s + 1) * ks].contiguous(),
                                                  block_n=16, split_k=1).numpy()
    for M, N, K, sk in SERIAL_RAGGED:  # the last split's last step masked at K
        x, w = (torch.from_numpy(a).to(torch.bfloat16) for a in _inputs(97, M, N, K, "bfloat16"))
        for serial in (False, True):
            out[f"ragged_{M}_{K}_{sk}_{serial}"] = launch_torch(
                x, w, block_m=64, dot_m=64, block_n=16, split_k=sk, split_serial=serial,
                num_warps=2).numpy()
    for i, (M, N, K, dtype, kw) in enumerate(INT8_CASES):
        x, v = _int8_inputs(i, M, N, K, dtype)
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        x, v = torch.from_numpy(x).to(tdt), torch.from_numpy(v)
        out[f"int8_{i}"] = launch_torch(x, v, **kw).numpy()
        out[f"int8_{i}_widened"] = launch_torch(x, v.to(tdt), **kw).numpy()
    _attention_worker(out)
    np.savez(work / "out.npz", **out)


# ---- sm_90 compile checks: the instruction the invariance argument rests on ---------------------

def _sm90_cases():
    """(id, M, N, K, overrides), one per distinct kernel configuration: every plan make_plan makes
    at Qwen3-8B's shapes for 1..256 rows, with the split rule's splits (2 and 3) and unsplit, the
    1-2-warp route to a 64/128-row dot (override) and a 4-way split of o (override)."""
    try:
        from jspec.kernels.linear_triton import make_plan
    except Exception:  # noqa: BLE001 - no triton: the tests skip
        return [("no_triton", 1, 16, 16, {})]
    cases = {}
    wanted = [((M, N, K), {}) for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS)]
    # The unsplit walk (FORCE_SPLIT_K = 1, the fallback), by explicit override.
    wanted += [((M, N, K), dict(split_k=1))
               for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS)]
    wanted += [((256, 4096, 4096), dict(block_m=64, block_n=64, num_warps=2)),
               ((256, 4096, 4096), dict(block_m=128, block_n=32, num_warps=2)),
               ((1, 4096, 4096), dict(split_k=4))]
    for (M, N, K), kw in wanted:
        p = make_plan(M, N, K, mma="v2", **kw)
        key = (f"bm{p.block_m}_dm{p.dot_m}_bn{p.block_n}_w{p.num_warps}_s{p.num_stages}"
               f"_sk{p.split_k}")
        cases.setdefault(key, (key, M, N, K, kw))
    return sorted(cases.values())


def _compile_sm90(constexprs, num_warps, num_stages, dtype="bf16", w_dtype=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jspec.kernels.linear_triton import _kernel, interpreter_enabled
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set for this process")
    signature = dict(x_ptr=f"*{dtype}", w_ptr=f"*{w_dtype or dtype}", y_ptr="*fp32",
                     **{k: "constexpr" for k in constexprs})
    try:
        return triton.compile(
            ASTSource(fn=_kernel(), signature=signature, constexprs=constexprs,
                      attrs={(i,): [["tt.divisibility", 16]] for i in range(3)}),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages))
    except ImportError as e:
        pytest.skip(f"no NVIDIA backend in this triton: {e}")


def _spill_bytes(cubin: bytes) -> int | None:
    """Local-memory stack of the compiled kernel (spills), from cuobjdump; None without it."""
    import tempfile

    import triton
    try:
        tool = triton.knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 - an optional check
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True)
    m = re.search(r"STACK:(\d+)", res.stdout)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("case", _sm90_cases(), ids=lambda c: c[0])
def test_linear_compiles_for_sm90(case):
    """Every v2 kernel configuration a plan can take, split or not, compiles for the H200 to mma.sync
    m16n8k16 (bf16 in, fp32 accumulate) and nothing else, never wgmma; shared memory fits, no
    spills."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.linear_triton import make_plan
    _, M, N, K, kw = case
    plan = make_plan(M, N, K, mma="v2", **kw)
    compiled = _compile_sm90(plan.constexprs(), plan.num_warps, plan.num_stages)
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert "wgmma" not in ptx
    mmas = re.findall(r"\bmma\.\S+", ptx)
    assert mmas and set(mmas) == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}
    # Only a split kernel reads grid axis 2 (split 1 is the unsplit kernel, its branches gone).
    assert ("%ctaid.z" in ptx) == (plan.partials > 1)
    spills = _spill_bytes(compiled.asm["cubin"])
    assert spills in (None, 0), f"{spills} bytes of spills"


def _sm90_v3_cases():
    """(id, M, N, K): one per distinct v3 kernel configuration at Qwen3-8B's shapes, 1..256 rows."""
    try:
        from jspec.kernels.linear_triton import make_plan
    except Exception:  # noqa: BLE001 - no triton: the tests skip
        return [("no_triton", 1, 16, 16)]
    cases = {}
    for (N, K), M in itertools.product(QWEN3_8B.values(), PLAN_ROWS + (512,)):
        p = make_plan(M, N, K, mma="v3")
        key = (f"bm{p.block_m}_bn{p.block_n}_w{p.num_warps}_s{p.num_stages}_sk{p.split_k}"
               + ("_serial" if p.split_serial else ""))
        cases.setdefault(key, (M, N, K))
    return sorted((k, *v) for k, v in cases.items())


@pytest.mark.parametrize("case", _sm90_v3_cases(), ids=lambda c: c[0])
def test_v3_plans_compile_to_wgmma_for_sm90(case):
    """Every v3 plan compiles for the H200 to wgmma.m64nNk16 (bf16 in, fp32 accumulate), N the
    column tile of one warpgroup, and no mma.sync: the instruction the v3 family's invariance rests on."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.linear_triton import make_plan
    _, M, N, K = case
    plan = make_plan(M, N, K, mma="v3")
    compiled = _compile_sm90(plan.constexprs(), plan.num_warps, plan.num_stages)
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert "mma.sync" not in ptx
    # 8 warps over 64 rows: the two warpgroups split the columns (m64 n/2 each); the k walk of
    # an output element is the same instruction chain either way.
    per_group = plan.block_n // max(1, plan.num_warps // 4 // (plan.block_m // 64))
    assert set(re.findall(r"\bwgmma\.mma_async\S+", ptx)) == {
        f"wgmma.mma_async.sync.aligned.m64n{per_group}k16.f32.bf16.bf16"}
    assert ("%ctaid.z" in ptx) == (plan.partials > 1)  # a serial walk has no split axis
    assert _spill_bytes(compiled.asm["cubin"]) in (None, 0)


def _sm90_int8_cases():
    """(id, M, N, K): one per distinct kernel configuration the default ("mixed") family gives
    the DSpark-8B drafter's GEMMs with int8 weights."""
    try:
        from jspec.kernels.linear_triton import make_plan
    except Exception:  # noqa: BLE001 - no triton: the tests skip
        return [("no_triton", 1, 16, 16)]
    cases = {}
    for (N, K), M in itertools.product(DRAFTER_8B.values(), DRAFTER_ROWS):
        p = make_plan(M, N, K, mma="mixed")
        key = (f"{p.mma}_bm{p.block_m}_dm{p.dot_m}_bn{p.block_n}_w{p.num_warps}_s{p.num_stages}"
               f"_sk{p.split_k}" + ("_serial" if p.split_serial else ""))
        cases.setdefault(key, (M, N, K))
    return sorted((k, *v) for k, v in cases.items())


@pytest.mark.parametrize("case", _sm90_int8_cases(), ids=lambda c: c[0])
def test_int8_weight_plans_compile_for_sm90(case):
    """With int8 weights every plan the drafter's shapes take compiles for the H200 to the same
    bf16 MMA as with bf16 weights (mma.sync up to 32 rows, wgmma above), within shared memory
    and without spills: the int8 tiles are widened in registers, not by another instruction."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.linear_triton import make_plan
    _, M, N, K = case
    plan = make_plan(M, N, K, mma="mixed")
    compiled = _compile_sm90(plan.constexprs(), plan.num_warps, plan.num_stages, w_dtype="i8")
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    if plan.mma == "v2":
        assert set(re.findall(r"\bmma\.\S+", ptx)) == {
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"} and "wgmma" not in ptx
    else:
        assert "mma.sync" not in ptx
        wgmmas = re.findall(r"\bwgmma\.mma_async\S+", ptx)
        assert wgmmas and all(m.endswith(".f32.bf16.bf16") for m in wgmmas)
    assert _spill_bytes(compiled.asm["cubin"]) in (None, 0)


def test_sm90_dot_of_64_rows_with_4_warps_is_wgmma():
    """The negative control, and Triton 3.6's rule that make_plan encodes (module docstring): the
    same kernel with one 64-row dot and 4 warps compiles to wgmma. If a Triton upgrade changes
    the rule, re-check make_plan's dot_m / num_warps choice before trusting this file."""
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.linear_triton import BLOCK_K
    constexprs = dict(M=256, N=4096, K=4096, BLOCK_M=64, DOT_M=64, BLOCK_N=64, BLOCK_K=BLOCK_K,
                      IEEE_DOT=False, SPLIT_K=1)
    ptx = _compile_sm90(constexprs, num_warps=4, num_stages=3).asm["ptx"]
    assert "wgmma" in ptx and "mma.sync" not in ptx


# ---- the attention kernel's batch-invariant plan (same interpreter worker) --------------------

ATT = dict(Hq=8, Hkv=2, hd=64, page_size=16, pages=45, L=700, block=8)


def _attention_inputs():
    rng = np.random.default_rng(5)
    a = ATT
    P = a["pages"] + 1
    bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    k = bf(rng.normal(size=(P, a["page_size"], a["Hkv"], a["hd"])).astype(np.float32))
    v = bf(rng.normal(size=(P, a["page_size"], a["Hkv"], a["hd"])).astype(np.float32))
    q = bf(rng.normal(size=(a["block"], a["Hq"], a["hd"])).astype(np.float32))
    page_table = (1 + rng.permutation(a["pages"])).astype(np.int32)[None]
    return q, k, v, page_table


def _attention_worker(out):
    """Verify (8 queries at L-8..L-1, one call) and decode (each query alone, kv_len = its
    position + 1), with the invariant plan and with the default one."""
    import torch

    from jspec.kernels.ragged_paged_attention_triton import launch_torch
    q, k, v, page_table = (torch.from_numpy(x) for x in _attention_inputs())
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    L, n = ATT["L"], ATT["block"]
    for name, inv in (("inv", True), ("dflt", False)):
        kw = dict(sm_scale=ATT["hd"] ** -0.5, causal=True, invariant=inv)
        out[f"att_{name}_verify"] = launch_torch(
            q, k, v, torch.tensor([L], dtype=torch.int32), page_table,
            torch.tensor([0, n], dtype=torch.int32), max_q_len=n, **kw).float().numpy()
        out[f"att_{name}_decode"] = np.stack([launch_torch(
            q[j:j + 1], k, v, torch.tensor([L - n + j + 1], dtype=torch.int32), page_table,
            torch.tensor([0, 1], dtype=torch.int32), max_q_len=1, **kw).float().numpy()[0]
            for j in range(n)])


def test_attention_invariant_plan_decode_equals_verify(interpreted):
    """Each verify row equals the same query decoded alone, bit for bit, across several splits.
    The plans really differ in what the default plan varies: the block and the split count."""
    from jspec.kernels.ragged_paged_attention_triton import make_plan
    common = dict(num_lanes=1, num_q_heads=ATT["Hq"], num_kv_heads=ATT["Hkv"], head_dim=ATT["hd"],
                  page_size=ATT["page_size"], pages_per_lane=ATT["pages"], causal=True,
                  ieee_dot=False)
    dec = make_plan(num_tokens=1, max_q_len=1, invariant=True, **common)
    ver = make_plan(num_tokens=8, max_q_len=8, invariant=True, **common)
    assert (dec.block_m, dec.block_n, dec.split_tiles) == (ver.block_m, ver.block_n, ver.split_tiles)
    assert dec.num_splits > 1
    default_dec = make_plan(num_tokens=1, max_q_len=1, **common)
    default_ver = make_plan(num_tokens=8, max_q_len=8, **common)
    assert (default_dec.block_m, default_dec.num_splits) != (default_ver.block_m, default_ver.num_splits)
    np.testing.assert_array_equal(interpreted["att_inv_decode"], interpreted["att_inv_verify"])
    # A prefill chunk keeps the default plan (no fp32 partials per split for 256 queries).
    chunk = make_plan(num_tokens=256, max_q_len=256, invariant=True, **common)
    assert chunk == make_plan(num_tokens=256, max_q_len=256, **common)
    # Negative control: the default plan (splits cut by length, a smaller decode tile) differs.
    assert (interpreted["att_dflt_decode"] != interpreted["att_dflt_verify"]).any()
    # Both plans compute attention (not a vacuous equality of zeros or of two wrong answers).
    np.testing.assert_allclose(interpreted["att_dflt_decode"], interpreted["att_inv_verify"],
                               rtol=2e-2, atol=2e-2)
    assert np.abs(interpreted["att_inv_verify"]).max() > 0.05


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interpret-worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _interpret_worker(Path(sys.argv[2]))
