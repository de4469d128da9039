"""The batch-invariant row reductions on CPU (kernels/rowwise_triton.py: RMSNorm and logsumexp):
run under Triton's interpreter (one subprocess, as in test_kernels_linear.py) against the XLA
twin (kernels/reductions.py) and a float64 oracle over a sweep of shapes, plus the property they
exist for: a row reduced alone and among other rows comes out with the same bits. The interface
is checked too: impl "xla" is today's RMSNorm and log-softmax bit for bit, impl "triton" is
refused off the GPU, and the model and the engine's programs route their norms and log-probs
through it when the target's linear_impl is "triton". The GPU runs the same checks in
tests/test_batch_invariance_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from test_kernels_attention import _triton_available
from triton_tools import ptxas_report, run_interpret_worker

EPS = 1e-6
# (M, D, x dtype, w dtype, f32_out): D of one step (128, 256, 4096), not a power of two (200),
# several steps with a masked tail (5000); M of 1..40; both output modes; fp32 weights too.
RMS_SHAPES = [(1, 128, "float32", "bfloat16", True), (5, 128, "float32", "bfloat16", False),
              (40, 256, "float32", "bfloat16", False), (3, 200, "bfloat16", "bfloat16", False),
              (17, 4096, "float32", "bfloat16", False), (2, 4096, "float32", "bfloat16", True),
              (4, 256, "float32", "float32", False), (7, 5000, "float32", "bfloat16", True),
              (9, 5000, "bfloat16", "bfloat16", False)]
# (M, V, dtype): the real vocabulary, one partial step, an exact multiple of BLOCK_V, a tail.
LSE_SHAPES = [(1, 151936, "float32"), (3, 1000, "float32"), (2, 8192, "bfloat16"),
              (33, 5000, "float32")]
# (M, Hq, Hkv, hd, out dtype): Qwen3-8B's heads at decode and at a verify block, GQA groups of
# 2 and 4, small and 64-wide heads, fp32 output.
QK_SHAPES = [(1, 32, 8, 128, "bfloat16"), (8, 4, 2, 128, "bfloat16"), (3, 2, 1, 16, "float32"),
             (5, 8, 2, 64, "bfloat16")]
# (M, D, P): add_rms_norm's residual + P split partials: the 8B row at decode (down's 3 splits,
# o's 2), a verify block, one partial (a serial split walk), a masked tail over two steps.
ADD_SHAPES = [(1, 4096, 3), (8, 4096, 2), (3, 200, 1), (5, 5000, 3)]
INVARIANCE_ROWS = (1, 5, 16, 33)  # the same first row among these many rows
INV_D, INV_V = 4096, 151936


def _bf16(a):
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _rms_inputs(i, M, D, x_dtype, w_dtype):
    """fp32 arrays holding values exact in the named dtypes; rows of varied scale."""
    rng = np.random.default_rng(100 + i)
    x = (rng.normal(size=(M, D)) * rng.uniform(0.1, 30, size=(M, 1))).astype(np.float32)
    w = rng.normal(1.0, 0.3, size=(D,)).astype(np.float32)
    return (_bf16(x) if x_dtype == "bfloat16" else x), (_bf16(w) if w_dtype == "bfloat16" else w)


def _add_inputs(i, M, D, P):
    """A residual stream of varied scale, P partials of a smaller one (what o / down add), a
    bf16 norm weight; all fp32 arrays."""
    rng = np.random.default_rng(400 + i)
    x = (rng.normal(size=(M, D)) * rng.uniform(1, 30, size=(M, 1))).astype(np.float32)
    p = (rng.normal(size=(P, M, D)) * rng.uniform(0.01, 3, size=(P, M, 1))).astype(np.float32)
    w = _bf16(rng.normal(1.0, 0.3, size=(D,)).astype(np.float32))
    return x, p, w


def _lse_inputs(i, M, V, dtype):
    """Logits of a realistic spread (a few large ones), one row with -inf (masked) entries."""
    rng = np.random.default_rng(200 + i)
    x = (rng.normal(size=(M, V)) * 3).astype(np.float32)
    x[:, rng.integers(0, V, 8)] += 25.0
    if M > 1:
        x[1, ::7] = -np.inf
    return _bf16(x) if dtype == "bfloat16" else x


def _qk_inputs(i, M, Hq, Hkv, hd):
    """The fused projection's fp32 output (heads of varied scale), bf16 norm weights, and the
    cos / sin rows of random positions (fp32, as reductions.rope_cos_sin makes them)."""
    rng = np.random.default_rng(300 + i)
    H = Hq + 2 * Hkv
    x = (rng.normal(size=(M, H, hd)) * rng.uniform(0.1, 20, size=(M, H, 1))).astype(np.float32)
    w_qk = _bf16(rng.normal(1.0, 0.3, size=(2, hd)).astype(np.float32))
    positions = rng.integers(0, 40000, M)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
    angles = positions.astype(np.float32)[:, None] * inv_freq
    return x, w_qk, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _qk_float64(x, w_qk, cos, sin, Hq, Hkv):
    x64 = x.astype(np.float64)
    out = x64.copy()
    half = x.shape[-1] // 2
    c, s = cos[:, None, :].astype(np.float64), sin[:, None, :].astype(np.float64)
    for lo, hi, w in ((0, Hq, w_qk[0]), (Hq, Hq + Hkv, w_qk[1])):
        a = x64[:, lo:hi]
        a = w.astype(np.float64) * a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + EPS)
        a1, a2 = a[..., :half], a[..., half:]
        out[:, lo:hi] = np.concatenate([a1 * c - a2 * s, a2 * c + a1 * s], axis=-1)
    return out


def _rms_float64(x, w, f32_out):
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
    return w.astype(np.float64) * xn


def _lse_float64(x):
    x64 = x.astype(np.float64)
    m = x64.max(-1, keepdims=True)
    return (m + np.log(np.exp(x64 - m).sum(-1, keepdims=True)))[:, 0]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not _triton_available():
        pytest.skip("triton (and torch) not installed")
    work = tmp_path_factory.mktemp("rowwise_interp")
    run_interpret_worker(__file__, work)
    with np.load(work / "out.npz") as out:
        return {k: out[k] for k in out.files}


@pytest.mark.parametrize("index", range(len(RMS_SHAPES)),
                         ids=[f"M{m}_D{d}_x{x[:2]}_w{w[:2]}_{'f32' if f else 'wdt'}"
                              for m, d, x, w, f in RMS_SHAPES])
def test_rms_norm_interpreted_matches_xla_twin(interpreted, index):
    """Against the XLA twin: fp32 outputs to a few ulps; outputs rounded to the weight's dtype
    equal almost everywhere and within one rounding step elsewhere (the kernel's sum of squares
    is ordered differently, which may flip a rounding). Against float64 in any case."""
    import jax.numpy as jnp

    from jspec.kernels.reductions import rms_norm_xla
    M, D, x_dtype, w_dtype, f32_out = RMS_SHAPES[index]
    x, w = _rms_inputs(index, M, D, x_dtype, w_dtype)
    got = interpreted[f"rms{index}"]
    assert got.shape == (M, D) and np.isfinite(got).all()  # every element written
    twin = np.asarray(rms_norm_xla(jnp.asarray(x, x_dtype), jnp.asarray(w, w_dtype), EPS,
                                   jnp.float32 if f32_out else None).astype(jnp.float32))
    want = _rms_float64(x, w, f32_out)
    if f32_out or w_dtype == "float32":
        np.testing.assert_allclose(got, twin, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    else:
        assert (got == twin).mean() > 0.99
        np.testing.assert_allclose(got, twin, rtol=2 ** -7, atol=0)  # one bf16 step
        np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=0)  # two roundings


@pytest.mark.parametrize("index", range(len(LSE_SHAPES)),
                         ids=[f"M{m}_V{v}_{d}" for m, v, d in LSE_SHAPES])
def test_logsumexp_interpreted_matches_float64(interpreted, index):
    import jax.numpy as jnp

    from jspec.kernels.reductions import logsumexp_xla
    M, V, dtype = LSE_SHAPES[index]
    x = _lse_inputs(index, M, V, dtype)
    got = interpreted[f"lse{index}"]
    assert got.shape == (M,) and np.isfinite(got).all()
    np.testing.assert_allclose(got, _lse_float64(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, np.asarray(logsumexp_xla(jnp.asarray(x))), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("index", range(len(QK_SHAPES)),
                         ids=[f"M{m}_q{hq}_kv{hkv}_hd{hd}_{d[:2]}" for m, hq, hkv, hd, d in QK_SHAPES])
def test_qk_norm_rope_interpreted_matches_xla_twin(interpreted, index):
    """The fused q/k step against its XLA twin (the model's own math): v heads are the same bits;
    q and k heads with an fp32 output agree to a few ulps (the rotation's multiply-adds may
    contract differently), rounded to bf16 almost everywhere equal and within one step elsewhere.
    Against float64 in any case."""
    import jax.numpy as jnp

    from jspec.kernels.reductions import qk_norm_rope_xla
    M, Hq, Hkv, hd, dtype = QK_SHAPES[index]
    x, w_qk, cos, sin = _qk_inputs(index, M, Hq, Hkv, hd)
    got = interpreted[f"qk{index}"]
    assert got.shape == x.shape and np.isfinite(got).all()  # every element written
    w_bf16 = jnp.asarray(w_qk, jnp.bfloat16)
    twin = np.asarray(qk_norm_rope_xla(jnp.asarray(x), w_bf16[0], w_bf16[1],
                                       jnp.asarray(cos), jnp.asarray(sin), EPS, Hq, Hkv,
                                       jnp.dtype(dtype)).astype(jnp.float32))
    want = _qk_float64(x, w_qk, cos, sin, Hq, Hkv)
    v = slice(Hq + Hkv, None)
    np.testing.assert_array_equal(got[:, v], twin[:, v])
    scale = np.abs(want).max(axis=-1, keepdims=True)  # rotations cancel: compare per head
    if dtype == "float32":
        np.testing.assert_allclose(got, twin, rtol=0, atol=1e-6 * scale.max())
        assert (np.abs(got - want) <= 1e-5 * scale).all()
    else:
        assert (got == twin).mean() > 0.98
        assert (np.abs(got - twin) <= 2 ** -7 * np.maximum(np.abs(twin), 1e-3 * scale)).all()
        assert (np.abs(got - want) <= 2 ** -7 * scale).all()


@pytest.mark.parametrize("index", range(len(ADD_SHAPES)),
                         ids=[f"M{m}_D{d}_P{p}" for m, d, p in ADD_SHAPES])
def test_add_rms_norm_interpreted_is_the_add_then_the_norm_kernel(interpreted, index):
    """The fused residual add + RMSNorm: its sum is the XLA add's (x + p0 + p1 ... in split
    order) bit for bit, its norm is the rms_norm kernel's on that sum bit for bit (the same walk),
    so folding the add into the norm changes no bit of the model; a sum in another order
    differs (the partials are chosen so that it does), and the norm is close to float64."""
    import jax.numpy as jnp

    from jspec.kernels.reductions import add_rms_norm_xla
    M, D, P = ADD_SHAPES[index]
    x, p, w = _add_inputs(index, M, D, P)
    got_sum, got_y = interpreted[f"add_sum{index}"], interpreted[f"add_y{index}"]
    want_sum, _ = add_rms_norm_xla(jnp.asarray(x), jnp.asarray(p), jnp.asarray(w, jnp.bfloat16),
                                   EPS)
    np.testing.assert_array_equal(got_sum, np.asarray(want_sum))
    if P > 1:
        other_order = x
        for part in p:  # ((x + p0) + p1) ...: the partials added one by one to the stream
            other_order = other_order + part
        assert (other_order != got_sum).any()  # the test can tell the order apart
    np.testing.assert_array_equal(got_y, interpreted[f"add_norm_alone{index}"])
    np.testing.assert_allclose(got_y, _rms_float64(np.asarray(want_sum), w, False),
                               rtol=2 ** -6, atol=0)


def test_qk_norm_rope_sums_its_partials_as_combine(interpreted):
    """qk_norm_rope over the qkv projection's split partials equals the kernel over their
    combined sum bit for bit (the adds it does at load are combine's), for 2 and 3 partials."""
    for P in (2, 3):
        np.testing.assert_array_equal(interpreted[f"qk_parts{P}"], interpreted[f"qk_summed{P}"])


def test_rows_are_batch_invariant(interpreted):
    """Row 0 alone and among 5, 16 or 33 rows: the same bits, for both kernels and both RMSNorm
    output modes (the interpreter runs each program with numpy, so this checks the contract
    that matters here: one row per program, no state shared across rows, plans fixed by the
    row length)."""
    for key in ("rms_inv_wdt", "rms_inv_f32", "lse_inv", "qk_inv", "add_inv"):
        first = interpreted[f"{key}1"][0]
        for m in INVARIANCE_ROWS[1:]:
            np.testing.assert_array_equal(interpreted[f"{key}{m}"][0], first, err_msg=f"{key}{m}")


def test_plans_depend_on_the_row_length_only():
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.rowwise_triton import (BLOCK_V, MAX_BLOCK_D, plan_logsumexp,
                                              plan_rms_norm)
    for D in (128, 200, 4096, 5120):
        decode, verify, busy = (plan_rms_norm(m, D) for m in (1, 8, 256))
        assert decode.block == verify.block == busy.block <= MAX_BLOCK_D
        assert decode.num_warps == verify.num_warps == busy.num_warps
        assert busy.grid == (256,)
    assert plan_rms_norm(1, 128).block == 128 and plan_rms_norm(1, 200).block == 256
    assert plan_rms_norm(1, 5120).block == MAX_BLOCK_D  # two steps
    assert plan_logsumexp(1, 151936).block == plan_logsumexp(256, 151936).block == BLOCK_V
    with pytest.raises(ValueError, match="empty"):
        plan_rms_norm(0, 128)
    with pytest.raises(ValueError, match="empty"):
        plan_logsumexp(4, 0)


def test_one_compiled_kernel_serves_every_row_count():
    """The kernels' compile-time constants (what Triton keys its compiled kernels on, beside the
    pointer dtypes) do not depend on the row count: the fused kernels read the partials' stride
    from the grid at run time, so decode, verify and prefill share one compiled kernel each."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import jspec.kernels.rowwise_triton as rw

    def keys(constexprs_of):  # the distinct constant sets over decode, verify and busy rows
        return {tuple(sorted(constexprs_of(m).items())) for m in (1, 8, 256)}

    for P in (1, 3):
        add = keys(lambda m: rw.add_rms_norm_constexprs(rw.plan_add_rms_norm(m, 4096), EPS, P))
        qk = keys(lambda m: rw.qk_norm_rope_constexprs(rw.plan_qk_norm_rope(m, 32, 8, 128), EPS, P))
        assert len(add) == 1 and len(qk) == 1, (add, qk)
    assert len(keys(lambda m: rw.rms_norm_constexprs(rw.plan_rms_norm(m, 4096), EPS, False))) == 1


# ---- the interface: impl "xla" is today's math, "triton" is GPU only -------------------------

def _todays_rms_norm(x, w, eps, out_dtype=None):
    """qwen3.RMSNorm.__call__ before the reductions module existed, verbatim."""
    import jax
    import jax.numpy as jnp
    x_f32 = x.astype(jnp.float32)
    x_f32 = x_f32 * jax.lax.rsqrt(jnp.mean(x_f32 * x_f32, axis=-1, keepdims=True) + eps)
    if out_dtype == jnp.float32:
        return w.astype(jnp.float32) * x_f32
    return w * x_f32.astype(w.dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                             ("float32", "float32")])
def test_xla_impl_is_todays_rms_norm_bit_for_bit(x_dtype, w_dtype):
    import jax
    import jax.numpy as jnp

    from jspec.kernels.reductions import rms_norm
    from jspec.qwen3 import RMSNorm
    x, w = _rms_inputs(0, 6, 256, x_dtype, w_dtype)
    x4 = jnp.asarray(x.reshape(2, 3, 2, 128), x_dtype)  # a q of [B, T, H, hd]
    w128 = jnp.asarray(w[:128], w_dtype)
    norm = RMSNorm(128, EPS, jnp.dtype(w_dtype))
    norm.weight[...] = w128
    for out_dtype in (None, jnp.float32):
        want = np.asarray(jax.jit(lambda a, b: _todays_rms_norm(a, b, EPS, out_dtype))(x4, w128))
        got = np.asarray(jax.jit(lambda a, b: rms_norm(a, b, EPS, out_dtype))(x4, w128))
        assert got.dtype == want.dtype == (np.float32 if out_dtype else jnp.dtype(w_dtype))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(norm(x4, out_dtype)), want)  # eager module


def test_xla_impl_is_todays_token_logprobs_bit_for_bit():
    import jax
    import jax.numpy as jnp

    from jspec.kernels.reductions import logsumexp, token_logprobs
    from jspec.steps import token_logprobs as steps_token_logprobs
    logits = jnp.asarray(_lse_inputs(1, 3, 1000, "float32").reshape(3, 1, 1000))
    tokens = jnp.asarray([[5], [999], [0]], jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)  # spec_steps' verify scoring, as it was
    want = np.asarray(jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0])
    np.testing.assert_array_equal(np.asarray(token_logprobs(logits, tokens)), want)
    np.testing.assert_array_equal(np.asarray(steps_token_logprobs(logits[:, 0], tokens[:, 0])),
                                  want[:, 0])
    np.testing.assert_allclose(np.asarray(logsumexp(logits))[:, 0],
                               _lse_float64(np.asarray(logits[:, 0])), rtol=1e-6)


def test_triton_impl_is_refused_off_the_gpu():
    import jax
    import jax.numpy as jnp

    from jspec.kernels.reductions import check_impl, logsumexp, rms_norm, token_logprobs
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU refusal")
    x = jnp.ones((2, 8), jnp.float32)
    for call in (lambda: check_impl("triton"), lambda: rms_norm(x, x[0], EPS, impl="triton"),
                 lambda: logsumexp(x, "triton"),
                 lambda: token_logprobs(x, jnp.zeros(2, jnp.int32), "triton")):
        with pytest.raises(ValueError, match="need an NVIDIA GPU"):
            call()
    for call in (lambda: check_impl("cuda"), lambda: rms_norm(x, x[0], EPS, impl="cuda"),
                 lambda: logsumexp(x, "cuda"),
                 lambda: token_logprobs(x, jnp.zeros(2, jnp.int32), "cuda")):
        with pytest.raises(ValueError, match="reduction impl must be one of"):
            call()


# ---- the wiring: the target's norms and log-probs follow its linear_impl ---------------------

@pytest.fixture
def kernels_on_xla(monkeypatch):
    """Every batch-invariant kernel stood in for by its XLA twin (the GPU-only ones cannot run
    here), recording the 2-D operands each is called with: what the wiring hands them."""
    if not _triton_available():
        pytest.skip("triton not installed")
    import jax.numpy as jnp

    import jspec.kernels.linear_triton as lt
    import jspec.kernels.reductions as red
    import jspec.kernels.rowwise_triton as rw
    from jspec.kernels.linear import linear_xla
    calls = {"linear": [], "rms_norm": [], "add_rms_norm": [], "logsumexp": [],
             "qk_norm_rope": []}

    def linear(x, w, **kw):
        calls["linear"].append(x.shape)
        return linear_xla(x, w)

    def linear_partials(x, w, **kw):  # two partials, y / 2 each: their sum is y exactly
        calls["linear"].append(x.shape)
        half = linear_xla(x, w) * 0.5
        return jnp.stack([half, half])

    def add_rms(x, partials, w, eps):
        assert x.ndim == 2 and partials.shape[1:] == x.shape and w.shape == x.shape[1:]
        calls["add_rms_norm"].append((partials.shape[0],) + x.shape)
        return red.add_rms_norm_xla(x, partials, w, eps)

    def rms(x, w, eps, f32_out=False):
        assert x.ndim == 2 and w.shape == x.shape[1:]
        calls["rms_norm"].append((x.shape, f32_out))
        return red.rms_norm_xla(x, w, eps, jnp.float32 if f32_out else None)

    def lse(x):
        assert x.ndim == 2
        calls["logsumexp"].append(x.shape)
        return red.logsumexp_xla(x)

    def qk(x, wq, wk, cos, sin, eps, num_q_heads, num_kv_heads, out_dtype):
        rw._check_qk_operands(x, wq, wk, cos, sin, num_q_heads, num_kv_heads)
        calls["qk_norm_rope"].append(x.shape)
        return red.qk_norm_rope_xla(red.sum_in_order(x), wq, wk, cos, sin, eps, num_q_heads,
                                    num_kv_heads, out_dtype)

    monkeypatch.setattr(lt, "linear_triton", linear)
    monkeypatch.setattr(lt, "linear_triton_partials", linear_partials)
    monkeypatch.setattr(rw, "add_rms_norm_triton", add_rms)
    monkeypatch.setattr(rw, "qk_norm_rope_triton", qk)
    monkeypatch.setattr(rw, "rms_norm_triton", rms)
    monkeypatch.setattr(rw, "logsumexp_triton", lse)
    monkeypatch.setattr(red, "check_impl", lambda impl: None)
    return calls


def test_model_norms_follow_linear_impl(kernels_on_xla):
    """fuse_projections(linear_impl="triton") puts every norm of the target on the invariant
    route with the right operands (per layer the two hidden-state norms, each with the residual
    add before it and the split partials of the matmul it adds, except the first layer's input
    norm; q/k's norms fused with RoPE in one call over all heads and the qkv partials; the final
    norm with the last MLP's add), the model computes the same logits, and a drafter (fused
    with the default route) keeps all its norms on XLA."""
    import jax.numpy as jnp
    from flax import nnx

    from jspec.config import PRESETS
    from jspec.dspark import DSparkConfig, DSparkDrafter
    from jspec.qwen3 import forward_logits, fuse_projections, init_random, unfuse_projections
    cfg = PRESETS["tiny-untied"].replace(dtype="bfloat16")
    model = init_random(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    want, _ = forward_logits(model, tokens)
    fuse_projections(model, linear_impl="triton")
    got, _ = forward_logits(model, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    rows, D, hd = 2 * 5, cfg.hidden_size, cfg.head_dim
    assert kernels_on_xla["rms_norm"] == [((rows, D), False)]  # layer 0's input: nothing to add
    assert kernels_on_xla["add_rms_norm"] == [(2, rows, D)] * (2 * cfg.num_layers)
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    assert kernels_on_xla["qk_norm_rope"] == [(2, rows, heads, hd)] * cfg.num_layers
    unfuse_projections(model)
    norms = [m for _, m in nnx.iter_graph(model) if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 4 * cfg.num_layers + 1 and all(n.impl == "xla" for n in norms)

    dcfg = DSparkConfig(layers=cfg.replace(num_layers=1), target_layer_ids=(0, 1),
                        mask_token_id=cfg.vocab_size - 1, markov_rank=8)
    drafter = DSparkDrafter(dcfg, rngs=nnx.Rngs(2))
    fuse_projections(drafter, qkv=False)
    assert all(m.impl == "xla" for _, m in nnx.iter_graph(drafter) if type(m).__name__ == "RMSNorm")


def test_engine_programs_score_through_the_invariant_route(kernels_on_xla, monkeypatch):
    """A batch_invariant engine's stock decode and speculative verify (with every kernel stood in
    for by its XLA twin, attention included) take their log-probs from the invariant logsumexp,
    one row per decode step and K+1 per verify block, and score as the default engine does."""
    from flax import nnx

    import jspec.engine as engine_mod
    import jspec.steps as steps
    from jspec.config import PRESETS
    from jspec.dspark import DSparkConfig, DSparkDrafter
    from jspec.engine import Engine, EngineConfig, shared_programs
    from jspec.qwen3 import init_random
    from jspec.scoring import teacher_forced_logprobs
    attention = steps.ragged_paged_attention
    monkeypatch.setattr(steps, "ragged_paged_attention",
                        lambda *a, impl, **k: attention(*a, impl="xla", **k))
    monkeypatch.setattr(engine_mod, "check_impl", lambda impl: None)

    cfg = PRESETS["tiny-untied"].replace(num_layers=3)  # a structure no other test compiles
    dcfg = DSparkConfig(layers=cfg.replace(num_layers=1), target_layer_ids=(0, 1),
                        mask_token_id=cfg.vocab_size - 1, markov_rank=8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size - 1, 12).tolist()
    cont = rng.integers(0, cfg.vocab_size - 1, 2 * (dcfg.block_size + 1)).tolist()
    scores = {}
    try:
        for inv in (False, True):
            target = init_random(cfg, seed=1)
            ecfg = EngineConfig(max_lanes=1, page_size=16, max_context=64, batch_invariant=inv)
            stock = Engine(cfg, target, (), ecfg)
            spec = Engine(cfg, target, (), ecfg, drafter=DSparkDrafter(dcfg, rngs=nnx.Rngs(2)),
                          draft_cfg=dcfg)
            kernels_on_xla["logsumexp"].clear()
            scores[inv] = (teacher_forced_logprobs(stock, prompt, cont),
                           teacher_forced_logprobs(spec, prompt, cont))
            if inv:  # prefill (1 row), decode steps (1 row), verify blocks (K+1 rows)
                assert {(1, cfg.vocab_size), (dcfg.block_size + 1, cfg.vocab_size)} <= set(
                    kernels_on_xla["logsumexp"])
            else:
                assert not kernels_on_xla["logsumexp"]
    finally:
        shared_programs.cache_clear()  # its programs hold the stand-ins
    for a, b in zip(scores[False], scores[True]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert kernels_on_xla["rms_norm"] and kernels_on_xla["linear"]


# ---- the GPU compiler accepts the kernels (no GPU needed) --------------------------------------

KERNEL_NAMES = ("rms_norm", "logsumexp", "qk_norm_rope", "add_rms_norm")  # _kernels() order


def _compile_sm90(name, signature, plan_args, *constexpr_args):
    """Kernel `name` compiled for sm_90 with its plan for `plan_args` (rowwise_triton's
    plan_<name> and <name>_constexprs): (compiled, ptx, ptxas spill counts). Skips without
    Triton, under the interpreter, or without Triton's NVIDIA backend."""
    import re

    if not _triton_available():
        pytest.skip("triton not installed")
    import jspec.kernels.rowwise_triton as rw
    if rw.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set for this process")
    import triton
    plan = getattr(rw, f"plan_{name}")(*plan_args)
    constexprs = getattr(rw, f"{name}_constexprs")(plan, *constexpr_args)
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        compiled = triton.compile(
            ASTSource(fn=rw._kernels()[KERNEL_NAMES.index(name)],
                      signature=dict(signature, **{k: "constexpr" for k in constexprs}),
                      constexprs=constexprs,
                      attrs={(i,): [["tt.divisibility", 16]] for i in range(len(signature))}),
            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=plan.num_warps, num_stages=1))
    except ImportError as e:
        pytest.skip(f"no NVIDIA backend in this triton: {e}")
    ptx = compiled.asm["ptx"]
    info = ptxas_report(ptx, "rowwise")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill", info)]
    return compiled, ptx, spills


@pytest.mark.parametrize("D,x_type,f32_out", [(128, "fp32", True), (4096, "fp32", False),
                                              (5120, "bf16", False)],
                         ids=["q_norm", "hidden_8b", "hidden_14b_bf16_in"])
def test_rms_norm_compiles_for_sm90(D, x_type, f32_out):
    signature = dict(x_ptr=f"*{x_type}", w_ptr="*bf16", y_ptr="*fp32" if f32_out else "*bf16")
    compiled, ptx, spills = _compile_sm90("rms_norm", signature, (256, D), EPS, f32_out)
    assert compiled.metadata.shared <= 227 * 1024 and not any(spills)
    assert "div.rn.f32" in ptx  # the mean divides as jnp.mean does (not div.full's 2 ulps)
    assert f32_out or "cvt.rn.bf16" in ptx  # round to nearest even before the scale


def test_qk_norm_rope_compiles_for_sm90():
    signature = dict(x_ptr="*fp32", wq_ptr="*bf16", wk_ptr="*bf16", cos_ptr="*fp32",
                     sin_ptr="*fp32", y_ptr="*bf16")
    compiled, ptx, spills = _compile_sm90("qk_norm_rope", signature, (256, 32, 8, 128), EPS)
    assert compiled.metadata.shared <= 227 * 1024 and not any(spills)
    assert "div.rn.f32" in ptx and "cvt.rn.bf16" in ptx  # the norm's mean; one rounding


@pytest.mark.parametrize("M,P", [(1, 3), (256, 1)], ids=["decode_down", "busy_serial"])
def test_add_rms_norm_compiles_for_sm90(M, P):
    signature = dict(x_ptr="*fp32", p_ptr="*fp32", w_ptr="*bf16", sum_ptr="*fp32",
                     y_ptr="*bf16")
    compiled, ptx, spills = _compile_sm90("add_rms_norm", signature, (M, 4096), EPS, P)
    assert compiled.metadata.shared <= 227 * 1024 and not any(spills)
    assert "div.rn.f32" in ptx and "cvt.rn.bf16" in ptx  # rms_norm's mean and rounding
    assert ptx.count("add.f32") >= P  # the partials and the stream are added, not dropped


def test_qk_norm_rope_over_partials_compiles_for_sm90():
    signature = dict(x_ptr="*fp32", wq_ptr="*bf16", wk_ptr="*bf16", cos_ptr="*fp32",
                     sin_ptr="*fp32", y_ptr="*bf16")
    compiled, _, spills = _compile_sm90("qk_norm_rope", signature, (1, 32, 8, 128), EPS, 2)
    assert compiled.metadata.shared <= 227 * 1024 and not any(spills)


def test_add_operands_and_partials_are_checked():
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.rowwise_triton import _check_add_operands, add_rms_norm_constexprs
    x, w = np.zeros((3, 16)), np.zeros(16)
    assert _check_add_operands(x, np.zeros((2, 3, 16)), w).grid == (3,)
    for args, match in (((x, np.zeros((3, 16)), w), "partials"),
                        ((x, np.zeros((2, 4, 16)), w), "partials"),
                        ((x, np.zeros((2, 3, 16)), np.zeros(8)), "w \\[D\\]"),
                        ((x, np.zeros((9, 3, 16)), w), "partials must be 1..8")):
        with pytest.raises(ValueError, match=match):
            _check_add_operands(*args)
    with pytest.raises(ValueError, match="partials must be"):
        add_rms_norm_constexprs(_check_add_operands(x, np.zeros((1, 3, 16)), w), EPS, 0)


def test_qk_plan_and_operands_are_checked():
    if not _triton_available():
        pytest.skip("triton not installed")
    from jspec.kernels.rowwise_triton import _check_qk_operands, plan_qk_norm_rope
    assert plan_qk_norm_rope(7, 32, 8, 128).grid == (7, 48)
    for bad, match in (((0, 4, 2, 128), "empty"), ((1, 4, 0, 128), "q and kv heads"),
                       ((1, 4, 2, 96), "power of two")):
        with pytest.raises(ValueError, match=match):
            plan_qk_norm_rope(*bad)
    x, w, cs = np.zeros((3, 8, 16)), np.zeros(16), np.zeros((3, 8))
    _check_qk_operands(x, w, w, cs, cs, 4, 2)
    for args, match in (((np.zeros((3, 9, 16)), w, w, cs, cs), "heads"),
                        ((x, w, np.zeros((2, 16)), cs, cs), "wk"),
                        ((x, w, w, np.zeros((3, 16)), cs), "cos")):
        with pytest.raises(ValueError, match=match):
            _check_qk_operands(*args, 4, 2)


def _todays_apply_rope(x_bthk, positions_bt, theta):
    """qwen3.apply_rope before rope_cos_sin / rope_rotate were factored out, verbatim."""
    import jax.numpy as jnp
    head_dim = x_bthk.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(angles_btf)[:, :, None, :]
    sin = jnp.sin(angles_btf)[:, :, None, :]
    x = x_bthk.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_bthk.dtype)


def test_xla_rope_and_the_twin_are_the_models_math_bit_for_bit():
    """apply_rope is today's RoPE bit for bit, and qk_norm_rope_xla (the fused kernel's twin) is
    what Attention.qkv computes on the XLA route."""
    import jax
    import jax.numpy as jnp

    from jspec.config import PRESETS
    from jspec.kernels.reductions import qk_norm_rope_xla, rope_cos_sin
    from jspec.qwen3 import apply_rope, init_random, project
    cfg = PRESETS["tiny-untied"].replace(dtype="bfloat16")
    attn = init_random(cfg, seed=4).layers[0].self_attn
    attn.fuse()
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 3, cfg.hidden_size)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 5000, (2, 3)), jnp.int32)
    q32 = jnp.asarray(rng.normal(size=(2, 3, cfg.num_heads, cfg.head_dim)) * 3, jnp.float32)
    for a, b in ((apply_rope, _todays_apply_rope),):
        np.testing.assert_array_equal(np.asarray(jax.jit(a, static_argnums=2)(q32, positions, 1e6)),
                                      np.asarray(jax.jit(b, static_argnums=2)(q32, positions, 1e6)))

    def twin(x, positions):
        qkv = project(x, attn.qkv_proj[...])
        cos, sin = rope_cos_sin(positions, cfg.head_dim, attn.rope_theta)
        out = qk_norm_rope_xla(qkv, attn.q_norm.weight[...], attn.k_norm.weight[...], cos, sin,
                               attn.q_norm.eps, cfg.num_heads,
                               cfg.num_kv_heads, x.dtype)
        return jnp.split(out, [cfg.num_heads, cfg.num_heads + cfg.num_kv_heads], axis=2)

    for got, want in zip(jax.jit(twin)(x, positions), jax.jit(attn.qkv)(x, positions)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_logsumexp_compiles_for_sm90():
    compiled, ptx, spills = _compile_sm90("logsumexp", dict(x_ptr="*fp32", lse_ptr="*fp32"),
                                          (256, 151936))
    assert compiled.metadata.shared <= 227 * 1024 and not any(spills)
    assert "ld.global.v4" in ptx  # 16-byte loads: the row is streamed, not gathered


# ---- interpreter worker (runs in the subprocess) ------------------------------------------------

def _rtne_bf16_casts() -> None:
    """Round fp32 -> bf16 to nearest even, as the GPU's cvt.rn does: the interpreter truncates."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            return interp.TensorHandle(data, dst_type.scalar)
        return original(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl


def _interpret_worker(work: Path) -> None:
    import torch

    from test_kernels_attention import _patch_interpreter
    _patch_interpreter()  # the scalar __index__ fix
    _rtne_bf16_casts()
    from jspec.kernels.rowwise_triton import (add_rms_norm_launch_torch, logsumexp_launch_torch,
                                              qk_norm_rope_launch_torch, rms_norm_launch_torch)

    def t(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(
            torch.bfloat16 if dtype == "bfloat16" else torch.float32)

    out = {}
    for i, (M, D, x_dtype, w_dtype, f32_out) in enumerate(RMS_SHAPES):
        x, w = _rms_inputs(i, M, D, x_dtype, w_dtype)
        out[f"rms{i}"] = rms_norm_launch_torch(t(x, x_dtype), t(w, w_dtype), EPS,
                                               f32_out).float().numpy()
    for i, (M, V, dtype) in enumerate(LSE_SHAPES):
        out[f"lse{i}"] = logsumexp_launch_torch(t(_lse_inputs(i, M, V, dtype), dtype)).numpy()
    for i, (M, Hq, Hkv, hd, dtype) in enumerate(QK_SHAPES):
        x, w_qk, cos, sin = _qk_inputs(i, M, Hq, Hkv, hd)
        out[f"qk{i}"] = qk_norm_rope_launch_torch(
            t(x, "float32"), t(w_qk[0], "bfloat16"), t(w_qk[1], "bfloat16"), t(cos, "float32"),
            t(sin, "float32"), EPS, Hq, Hkv,
            torch.bfloat16 if dtype == "bfloat16" else torch.float32).float().numpy()
    for i, (M, D, P) in enumerate(ADD_SHAPES):
        x, p, w = _add_inputs(i, M, D, P)
        total, y = add_rms_norm_launch_torch(t(x, "float32"), t(p, "float32"), t(w, "bfloat16"),
                                             EPS)
        out[f"add_sum{i}"], out[f"add_y{i}"] = total.numpy(), y.float().numpy()
        out[f"add_norm_alone{i}"] = rms_norm_launch_torch(total, t(w, "bfloat16"),
                                                          EPS).float().numpy()
    for P in (2, 3):
        x, w_qk, cos, sin = _qk_inputs(50 + P, 3, 4, 2, 64)
        parts = np.stack([x * (0.5 + 0.37 * s) for s in range(P)]).astype(np.float32)
        summed = parts[0]
        for s_ in range(1, P):
            summed = summed + parts[s_]
        args = (t(w_qk[0], "bfloat16"), t(w_qk[1], "bfloat16"), t(cos, "float32"),
                t(sin, "float32"), EPS, 4, 2, torch.bfloat16)
        out[f"qk_parts{P}"] = qk_norm_rope_launch_torch(t(parts, "float32"), *args).float().numpy()
        out[f"qk_summed{P}"] = qk_norm_rope_launch_torch(t(summed, "float32"), *args).float().numpy()
    ax, ap, aw = _add_inputs(99, max(INVARIANCE_ROWS), INV_D, 3)
    for m in INVARIANCE_ROWS:
        out[f"add_inv{m}"] = add_rms_norm_launch_torch(
            t(ax[:m], "float32"), t(ap[:, :m], "float32"), t(aw, "bfloat16"), EPS)[1].float().numpy()
    qx, qw, qcos, qsin = _qk_inputs(99, max(INVARIANCE_ROWS), 4, 2, 128)
    for m in INVARIANCE_ROWS:
        out[f"qk_inv{m}"] = qk_norm_rope_launch_torch(
            t(qx[:m], "float32"), t(qw[0], "bfloat16"), t(qw[1], "bfloat16"),
            t(qcos[:m], "float32"), t(qsin[:m], "float32"), EPS, 4, 2, torch.bfloat16).float().numpy()
    x, w = _rms_inputs(99, max(INVARIANCE_ROWS), INV_D, "float32", "bfloat16")
    logits = _lse_inputs(99, max(INVARIANCE_ROWS), INV_V, "float32")
    for m in INVARIANCE_ROWS:
        for key, f32_out in (("rms_inv_wdt", False), ("rms_inv_f32", True)):
            out[f"{key}{m}"] = rms_norm_launch_torch(t(x[:m], "float32"), t(w, "bfloat16"), EPS,
                                                     f32_out).float().numpy()
        out[f"lse_inv{m}"] = logsumexp_launch_torch(t(logits[:m], "float32")).numpy()
    np.savez(work / "out.npz", **out)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interpret-worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _interpret_worker(Path(sys.argv[2]))
