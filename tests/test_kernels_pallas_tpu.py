"""The Pallas TPU ragged paged attention kernel, run on CPU in Pallas's TPU interpret mode
(pltpu.InterpretParams: simulated HBM / VMEM / SMEM, DMAs and DMA semaphores), against the XLA
reference and the float64 brute force of tests/test_kernels_attention.py.

make_inputs fills everything a correct kernel must not read with NaN (the null page, slots at or
past kv_len, unused pages, q's padding rows), and the interpreter fills uninitialized VMEM with
NaN, so a stale read or a missed mask shows up as a NaN or a mismatch. This says nothing about
whether Mosaic compiles the kernel for a real TPU, nor how fast it is there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jspec.kernels.ragged_paged_attention import (ragged_paged_attention,
                                                  ragged_paged_attention_xla)
from jspec.kernels.ragged_paged_attention_pallas_tpu import ragged_paged_attention_pallas_tpu
from test_kernels_attention import Case, assert_close, bruteforce, make_inputs, to_jax

# Page sizes 8 and 16, kv lengths mostly not multiples of the page size, decode (1), verify (8),
# prefill-like chunks, GQA groups 1 / 2 / 4, causal and the drafter's non-causal block, fp32 and
# bf16 (and fp8 pages), several lanes of different lengths per call with a 0-query lane.
CASES = [
    Case("decode_ps8_g4_f32", (1, 1, 1, 0), (1, 13, 30, 5), page_size=8, max_q_len=1),
    Case("decode_ps16_g1_bf16", (1, 1, 1), (17, 45, 16), group=1, dtype="bfloat16",
         max_q_len=1),
    Case("verify_ps8_g2_f32", (8, 8, 0, 8), (8, 21, 9, 50), page_size=8, group=2, max_q_len=8),
    Case("verify_ps16_g4_bf16", (8, 8, 8), (70, 8, 29), dtype="bfloat16", max_q_len=8),
    Case("prefill_ps16_g4_f32", (40, 2, 23), (45, 130, 23), max_q_len=40),
    Case("prefill_ps8_g2_bf16_d128", (19, 1, 0), (19, 37, 3), page_size=8, group=2,
         head_dim=128, dtype="bfloat16", max_q_len=24),
    Case("mixed_ps16_g2_nomax", (3, 0, 9), (3, 5, 77), group=2),
    Case("drafter_noncausal_ps8_g4_f32", (7, 7, 0), (30, 7, 4), page_size=8, causal=False,
         max_q_len=7),
    Case("drafter_noncausal_ps16_g2_bf16", (7, 7), (71, 40), group=2, dtype="bfloat16",
         causal=False, max_q_len=8),
    Case("noncausal_ps16_g1_f32", (3, 16, 1), (3, 40, 9), group=1, causal=False, max_q_len=16),
    Case("drafter_noncausal_ps16_g4_bf16_fp8kv", (7, 7, 0), (30, 7, 4), dtype="bfloat16",
         kv_dtype="float8_e4m3fn", causal=False, max_q_len=7),
    Case("decode_ps8_g2_f32_fp8kv", (1, 1, 1), (17, 40, 9), page_size=8, group=2,
         kv_dtype="float8_e4m3fn", max_q_len=1),
]


@pytest.fixture(autouse=True)
def _fresh_interpreter_state():
    # TPU interpret mode keeps global state that a kernel raising mid-run leaves behind.
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()


def run_kernel(case: Case, args, interpret=True):
    fn = jax.jit(functools.partial(ragged_paged_attention_pallas_tpu, sm_scale=case.sm_scale,
                                   causal=case.causal, max_q_len=case.max_q_len,
                                   interpret=interpret))
    return fn(*args)


def run_xla(case: Case, args):
    fn = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=case.sm_scale,
                                   causal=case.causal, max_q_len=case.max_q_len))
    return fn(*args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pallas_tpu_interpreted_matches_reference(case):
    x = make_inputs(case)
    args = to_jax(case, x)
    out = run_kernel(case, args)
    assert out.shape == args[0].shape and out.dtype == jnp.dtype(case.dtype)
    assert_close(case, out, np.asarray(run_xla(case, args), np.float64), "pallas_tpu vs xla")
    assert_close(case, out, bruteforce(case, x), "pallas_tpu vs bruteforce")


def test_pallas_tpu_follows_the_page_table():
    """Negative control: permuting a lane's live pages in the table (the pool unchanged) must
    change the kernel's output, exactly as it changes the reference's."""
    case = Case("shuffled_ps8_g2", (8, 1), (37, 30), page_size=8, group=2, max_q_len=8)
    x = make_inputs(case)
    out = np.asarray(run_kernel(case, to_jax(case, x)))
    shuffled = dict(x, page_table=x["page_table"].copy())
    full = case.kv_lens[0] // case.page_size  # roll the full pages only: the partial last
    shuffled["page_table"][0, :full] = np.roll(x["page_table"][0, :full], 1)  # one holds NaN
    args = to_jax(case, shuffled)
    out_shuffled = np.asarray(run_kernel(case, args))
    n0 = case.q_lens[0]
    assert np.isfinite(out_shuffled).all()
    assert np.max(np.abs(out_shuffled[:n0] - out[:n0])) > 1e-2, "page table ignored"
    np.testing.assert_array_equal(out_shuffled[n0:], out[n0:])  # lane 1 untouched
    assert_close(case, out_shuffled, np.asarray(run_xla(case, args), np.float64),
                 "shuffled pallas_tpu vs xla")


def test_pallas_tpu_no_races_and_eager_dmas():
    """The double-buffered DMAs under the interpreter's race detector, and with DMAs executed as
    soon as they are started instead of on wait: same result, no race reported."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    case = Case("races_ps8_g2", (8, 1, 0), (29, 17, 4), page_size=8, group=2, max_q_len=8)
    x = make_inputs(case)
    args = to_jax(case, x)
    expected = np.asarray(run_xla(case, args), np.float64)
    for params in (pltpu.InterpretParams(detect_races=True),
                   pltpu.InterpretParams(dma_execution_mode="eager")):
        out = run_kernel(case, args, interpret=params)
        assert_close(case, out, expected, f"pallas_tpu {params}")
        if params.detect_races:
            assert ipc.races is not None and not ipc.races.races_found


def test_dispatch_refuses_pallas_tpu_off_tpu(monkeypatch):
    assert jax.default_backend() != "tpu"
    case = CASES[0]
    args = to_jax(case, make_inputs(case))
    monkeypatch.delenv("JSPEC_PALLAS_TPU_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a TPU backend.*JSPEC_PALLAS_TPU_INTERPRET=1"):
        ragged_paged_attention(*args, sm_scale=case.sm_scale, max_q_len=case.max_q_len,
                               impl="pallas_tpu")


def test_dispatch_runs_pallas_tpu_interpreted_when_asked(monkeypatch):
    monkeypatch.setenv("JSPEC_PALLAS_TPU_INTERPRET", "1")
    case = dataclasses.replace(CASES[2], name="dispatch")
    x = make_inputs(case)
    args = to_jax(case, x)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=case.sm_scale,
                                   causal=case.causal, max_q_len=case.max_q_len,
                                   impl="pallas_tpu"))
    assert_close(case, fn(*args), bruteforce(case, x), "dispatch pallas_tpu")
