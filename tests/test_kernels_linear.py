"""The batch-invariant kernels on CPU (the linear layer; the attention kernel's invariant plan): run under Triton's interpreter (one subprocess, as in
test_kernels_attention.py) against a float64 oracle over a sweep of shapes, plus the property it
exists for: a row computed alone and among other rows comes out with the same bits. On the GPU
the same checks run in tests/test_kernels_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from test_kernels_attention import _triton_available

# (M, N, K, dtype, block_n): K not a multiple of BLOCK_K, N not of block_n, M of 1..40 rows.
SHAPES = [(1, 48, 200, "float32", None), (3, 64, 128, "float32", 16), (17, 40, 300, "float32", 32),
          (8, 128, 256, "bfloat16", None), (40, 24, 96, "bfloat16", 16), (1, 16, 1, "float32", None)]
INVARIANCE_ROWS = (1, 5, 16, 33)  # the same first row inside GEMMs of these many rows
INV_N, INV_K = 48, 384


def _inputs(i, M, N, K, dtype):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(M, K)).astype(np.float32)
    w = (rng.normal(size=(N, K)) * 0.1).astype(np.float32)
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x, w


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not _triton_available():
        pytest.skip("triton (and torch) not installed")
    work = tmp_path_factory.mktemp("linear_interp")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interpret-worker", str(work)], env=env,
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    with np.load(work / "out.npz") as out:
        return {k: out[k] for k in out.files}


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=[f"M{m}_N{n}_K{k}_{d}_bn{b}" for m, n, k, d, b in SHAPES])
def test_linear_interpreted_matches_float64(interpreted, index):
    M, N, K, dtype, _ = SHAPES[index]
    x, w = _inputs(index, M, N, K, dtype)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = interpreted[str(index)]
    assert got.shape == (M, N) and np.isfinite(got).all()  # every element written
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_linear_rows_are_batch_invariant(interpreted):
    """Row 0 alone and among 5, 16 or 33 rows: the same bits (the interpreter multiplies tiles
    with numpy, so this checks the tiling contract: fixed row tile and reduction steps)."""
    first = interpreted["inv1"][0]
    for m in INVARIANCE_ROWS[1:]:
        np.testing.assert_array_equal(interpreted[f"inv{m}"][0], first)


def test_plan_depends_on_the_shape_only_where_it_may():
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.linear_triton import BLOCK_K, BLOCK_M, make_plan
    decode = make_plan(1, 4096, 4096)
    verify = make_plan(256, 4096, 4096)
    assert decode.constexprs()["BLOCK_K"] == verify.constexprs()["BLOCK_K"] == BLOCK_K
    assert decode.constexprs()["BLOCK_M"] == verify.constexprs()["BLOCK_M"] == BLOCK_M
    # A skinny GEMM takes the narrowest tile so that every SM has programs; a wide one wider tiles.
    assert decode.block_n == 16 and decode.grid[0] * decode.grid[1] >= 132
    assert make_plan(1, 24576, 4096).block_n == 64
    assert verify.block_n > decode.block_n
    with pytest.raises(ValueError, match="empty"):
        make_plan(0, 8, 8)


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
    for i, (M, N, K, dtype, block_n) in enumerate(SHAPES):
        x, w = _inputs(i, M, N, K, dtype)
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        out[str(i)] = launch_torch(torch.from_numpy(x).to(tdt), torch.from_numpy(w).to(tdt),
                                   block_n=block_n).numpy()
    x, w = _inputs(99, max(INVARIANCE_ROWS), INV_N, INV_K, "bfloat16")
    for m in INVARIANCE_ROWS:
        out[f"inv{m}"] = launch_torch(torch.from_numpy(x[:m]).to(torch.bfloat16),
                                      torch.from_numpy(w).to(torch.bfloat16), block_n=16).numpy()
    _attention_worker(out)
    np.savez(work / "out.npz", **out)



@pytest.mark.parametrize("M,N,K", [(1, 6144, 4096), (8, 4096, 12288), (256, 24576, 4096),
                                   (8, 151936, 4096)], ids=["qkv_decode", "down_verify",
                                                            "gate_up_busy", "lm_head_verify"])
def test_linear_compiles_for_sm90(M, N, K):
    """The GPU compiler accepts the kernel at Qwen3-8B shapes: shared memory fits, no spills."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jspec.kernels.linear_triton import _kernel, interpreter_enabled, make_plan
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set for this process")
    plan = make_plan(M, N, K)
    constexprs = plan.constexprs()
    signature = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32",
                     **{k: "constexpr" for k in constexprs})
    try:
        compiled = triton.compile(
            ASTSource(fn=_kernel(), signature=signature, constexprs=constexprs,
                      attrs={(i,): [["tt.divisibility", 16]] for i in range(3)}),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    except ImportError as e:
        pytest.skip(f"no NVIDIA backend in this triton: {e}")
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert "mma.sync" in ptx and "wgmma" not in ptx  # the fixed 16-row MMA (module docstring)


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
