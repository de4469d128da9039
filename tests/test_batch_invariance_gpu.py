"""Batch invariance on the GPU (marked `gpu`; run on the H200 with `pytest -m gpu`): the Triton
linear kernel, the row reductions (RMSNorm, logsumexp, the fused q/k norms with RoPE) and the
attention kernel's invariant plan
give a row the same bits alone and among others, and an engine built with `batch_invariant=True`
teacher-forces the same log-probs through speculative verify (blocks of 8) as through stock
decode: the bench's fixed-text gate at exactly zero. The CPU suite checks the same contracts
under Triton's interpreter (tests/test_kernels_linear.py, tests/test_kernels_rowwise.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels_gpu import _need_gpu  # noqa: F401  (module fixture: skip without a GPU)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mma", ["v2", "v3", "mixed"])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                                 (151936, 4096)], ids=["qkv", "o", "gate_up", "down", "lm_head"])
def test_linear_triton_rows_invariant_and_correct(N, K, mma):
    """Every row alone and among 8..256 rows: the same bits, in each MMA family (v2 mma.sync,
    the default; v3 wgmma; "mixed", whose 1..32-row plans are v2 and 128/256-row plans v3, so
    this compares the two instructions' bits)."""
    from jspec.kernels.linear import linear_xla
    from jspec.kernels.linear_triton import linear_triton
    kx, kw = jax.random.split(jax.random.PRNGKey(N + K))
    w = (0.02 * jax.random.normal(kw, (N, K), jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (256, K), jnp.float32).astype(jnp.bfloat16)
    import functools

    from jspec.kernels.linear_triton import _split_k
    ref = np.asarray(jax.jit(linear_xla)(x, w))
    # The default plan (the split rule's walk), and the unsplit walk (FORCE_SPLIT_K = 1).
    for split in sorted({1, _split_k(N, K)}):
        f = jax.jit(functools.partial(linear_triton, split_k=split, mma=mma))
        # 256 rows: the widest row tiles the plan picks; in v3 / mixed a split shape walks its
        # splits in turn in one program there (split_serial), against the split grid below.
        full = np.asarray(f(x, w))
        for m in (1, 8, 16, 32, 128):  # every row, not only row 0: rows in later dot blocks too
            np.testing.assert_array_equal(np.asarray(f(x[:m], w)), full[:m],
                                          err_msg=f"{mma} split {split}, {m} rows")
        np.testing.assert_allclose(full, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"], ids=["f32_in", "bf16_in"])
@pytest.mark.parametrize("f32_out", [False, True], ids=["wdt_out", "f32_out"])
@pytest.mark.parametrize("D", [128, 4096], ids=["head_dim", "hidden"])
def test_rms_norm_triton_rows_invariant_and_close(D, f32_out, x_dtype):
    """Rows 0..m-1 of M = 1 and M = 8 equal those of M = 256 bit for bit; all rows are the XLA
    twin's up to the sum's order (fp32 out: ulps; bf16 out: rare one-step rounding flips)."""
    from jspec.kernels.reductions import rms_norm_xla
    from jspec.kernels.rowwise_triton import rms_norm_triton
    kx, kw = jax.random.split(jax.random.PRNGKey(D))
    w = (1 + 0.3 * jax.random.normal(kw, (D,), jnp.float32)).astype(jnp.bfloat16)
    x = (5 * jax.random.normal(kx, (256, D), jnp.float32)).astype(x_dtype)  # a residual stream
    f = jax.jit(functools.partial(rms_norm_triton, eps=1e-6, f32_out=f32_out))
    busy = np.asarray(f(x, w).astype(jnp.float32))
    for m in (1, 8):
        np.testing.assert_array_equal(np.asarray(f(x[:m], w).astype(jnp.float32)), busy[:m])
    twin = functools.partial(rms_norm_xla, eps=1e-6, out_dtype=jnp.float32 if f32_out else None)
    ref = np.asarray(jax.jit(twin)(x, w).astype(jnp.float32))
    if f32_out:
        np.testing.assert_allclose(busy, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (busy == ref).mean() > 0.99
        np.testing.assert_allclose(busy, ref, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("heads", [(32, 8), (4, 2)], ids=["qwen3_8b", "group2"])
def test_qk_norm_rope_triton_rows_invariant_and_close(heads):
    """The fused q/k step: rows of M = 1 and M = 8 equal those of M = 256 bit for bit; v heads are
    the twin's bits, q/k heads the twin's up to rare one-step bf16 rounding flips."""
    from jspec.kernels.reductions import qk_norm_rope_xla, rope_cos_sin
    from jspec.kernels.rowwise_triton import qk_norm_rope_triton
    Hq, Hkv = heads
    H, hd = Hq + 2 * Hkv, 128
    kx, kw, kp = jax.random.split(jax.random.PRNGKey(Hq), 3)
    x = 4 * jax.random.normal(kx, (256, H, hd), jnp.float32)
    w_qk = (1 + 0.3 * jax.random.normal(kw, (2, hd), jnp.float32)).astype(jnp.bfloat16)
    cos, sin = rope_cos_sin(jax.random.randint(kp, (256,), 0, 40000), hd, 1e6)
    f = jax.jit(functools.partial(qk_norm_rope_triton, eps=1e-6, num_q_heads=Hq,
                                  num_kv_heads=Hkv, out_dtype=jnp.bfloat16))
    busy = np.asarray(f(x, w_qk[0], w_qk[1], cos, sin).astype(jnp.float32))
    for m in (1, 8):
        np.testing.assert_array_equal(
            np.asarray(f(x[:m], w_qk[0], w_qk[1], cos[:m], sin[:m]).astype(jnp.float32)), busy[:m])
    twin = jax.jit(functools.partial(qk_norm_rope_xla, eps=1e-6, num_q_heads=Hq,
                                     num_kv_heads=Hkv, out_dtype=jnp.bfloat16))
    ref = np.asarray(twin(x, w_qk[0], w_qk[1], cos, sin).astype(jnp.float32))
    np.testing.assert_array_equal(busy[:, Hq + Hkv:], ref[:, Hq + Hkv:])
    assert (busy == ref).mean() > 0.98
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    assert (np.abs(busy - ref) <= 2 ** -7 * np.maximum(np.abs(ref), 1e-3 * scale)).all()


@pytest.mark.parametrize("P", [1, 2, 3])
def test_add_rms_norm_triton_rows_invariant_and_the_unfused_bits(P):
    """The residual add folded into the norm: rows of M = 1 and M = 8 equal those of M = 256; the
    sum is XLA's x + combine(partials) bit for bit, and the norm is rms_norm_triton's over that
    sum bit for bit (so the fused route computes the model of before, bit for bit). The qkv
    partials through qk_norm_rope likewise equal the combined qkv's."""
    from jspec.kernels.linear_triton import combine
    from jspec.kernels.rowwise_triton import add_rms_norm_triton, rms_norm_triton
    D = 4096
    kx, kp, kw = jax.random.split(jax.random.PRNGKey(P), 3)
    x = 8 * jax.random.normal(kx, (256, D), jnp.float32)
    parts = jax.random.normal(kp, (P, 256, D), jnp.float32)
    w = (1 + 0.3 * jax.random.normal(kw, (D,), jnp.float32)).astype(jnp.bfloat16)
    f = jax.jit(functools.partial(add_rms_norm_triton, eps=1e-6))
    total, y = (np.asarray(a.astype(jnp.float32)) for a in f(x, parts, w))
    for m in (1, 8):
        t_m, y_m = f(x[:m], parts[:, :m], w)
        np.testing.assert_array_equal(np.asarray(t_m), total[:m])
        np.testing.assert_array_equal(np.asarray(y_m.astype(jnp.float32)), y[:m])
    unfused = jax.jit(lambda x, p: x + combine(p, P))(x, parts)
    np.testing.assert_array_equal(total, np.asarray(unfused))
    norm = jax.jit(functools.partial(rms_norm_triton, eps=1e-6))(unfused, w)
    np.testing.assert_array_equal(y, np.asarray(norm.astype(jnp.float32)))


def test_qk_norm_rope_triton_over_partials_is_the_combined_bits():
    from jspec.kernels.linear_triton import combine
    from jspec.kernels.reductions import rope_cos_sin
    from jspec.kernels.rowwise_triton import qk_norm_rope_triton
    Hq, Hkv, hd = 32, 8, 128
    kx, kw, kp = jax.random.split(jax.random.PRNGKey(11), 3)
    parts = 4 * jax.random.normal(kx, (2, 8, Hq + 2 * Hkv, hd), jnp.float32)
    w_qk = (1 + 0.3 * jax.random.normal(kw, (2, hd), jnp.float32)).astype(jnp.bfloat16)
    cos, sin = rope_cos_sin(jax.random.randint(kp, (8,), 0, 40000), hd, 1e6)
    f = jax.jit(functools.partial(qk_norm_rope_triton, eps=1e-6, num_q_heads=Hq,
                                  num_kv_heads=Hkv, out_dtype=jnp.bfloat16))
    got = np.asarray(f(parts, w_qk[0], w_qk[1], cos, sin).astype(jnp.float32))
    want = np.asarray(f(combine(parts, 2), w_qk[0], w_qk[1], cos, sin).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)


def test_logsumexp_triton_rows_invariant_and_close():
    """A vocabulary row's logsumexp alone, among 8 and among 256 rows: the same bits; close to
    jax.nn.logsumexp. Through token_logprobs, a verify block's row equals that row decoded."""
    from jspec.kernels.reductions import token_logprobs
    from jspec.kernels.rowwise_triton import logsumexp_triton
    V = 151936
    kx, kt = jax.random.split(jax.random.PRNGKey(7))
    x = 3 * jax.random.normal(kx, (256, V), jnp.float32)
    x = x.at[:, ::997].add(20.0)  # a few dominant logits
    f = jax.jit(logsumexp_triton)
    busy = np.asarray(f(x))
    for m in (1, 8):
        np.testing.assert_array_equal(np.asarray(f(x[:m])), busy[:m])
    ref = np.asarray(jax.jit(lambda a: jax.nn.logsumexp(a, axis=-1))(x))
    np.testing.assert_allclose(busy, ref, rtol=1e-6, atol=1e-5)
    tokens = jax.random.randint(kt, (8,), 0, V)
    lp = jax.jit(functools.partial(token_logprobs, impl="triton"))
    verify = np.asarray(lp(x[:8].reshape(1, 8, V), tokens[None]))[0]
    decode = np.stack([np.asarray(lp(x[j:j + 1], tokens[j:j + 1]))[0] for j in range(8)])
    np.testing.assert_array_equal(verify, decode)
    np.testing.assert_allclose(verify, np.asarray(token_logprobs(x[:8], tokens)), rtol=1e-5,
                               atol=1e-5)


def test_attention_invariant_plan_decode_equals_verify_8b_shape():
    from jspec.kernels.ragged_paged_attention import ragged_paged_attention
    Hq, Hkv, hd, ps, pages, L, n = 32, 8, 128, 16, 256, 3000, 8
    k0, k1, k2 = jax.random.split(jax.random.PRNGKey(3), 3)
    kp = jax.random.normal(k0, (pages + 1, ps, Hkv, hd), jnp.float32).astype(jnp.bfloat16)
    vp = jax.random.normal(k1, (pages + 1, ps, Hkv, hd), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(k2, (n, Hq, hd), jnp.float32).astype(jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)[None] + 1, jnp.int32)

    def run(qq, kv_len, q_len, impl):
        return ragged_paged_attention(qq, kp, vp, jnp.asarray([kv_len], jnp.int32), table,
                                      jnp.asarray([0, q_len], jnp.int32), sm_scale=hd ** -0.5,
                                      max_q_len=q_len, impl=impl)

    for impl, exact in (("triton_invariant", True), ("triton", False)):
        verify = np.asarray(run(q, L, n, impl))
        decode = np.stack([np.asarray(run(q[j:j + 1], L - n + j + 1, 1, impl))[0] for j in range(n)])
        if exact:
            np.testing.assert_array_equal(decode, verify)
        else:  # the default plan is the negative control: same values, other bits
            np.testing.assert_allclose(decode.astype(np.float32), verify.astype(np.float32),
                                       rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("invariant_prefill", [False, True])
@pytest.mark.parametrize("shape", ["tiny", "standin"])
def test_batch_invariant_engine_verify_equals_decode(shape, invariant_prefill):
    """The whole target: fixed texts teacher-forced through verify and through decode give the
    same log-probs to the bit with batch_invariant=True (and differ without it). "standin" has
    the stand-in target's widths (hidden 256, head_dim 128, Qwen3's 151936-id vocabulary): the
    real stand-in still differed there (mean |d log p| 1.75e-3) while only the matmuls and
    attention were invariant, the norms and the log-softmax on XLA. The prompt's prefill runs
    XLA's GEMMs or the invariant kernels (EngineConfig.invariant_prefill): both engines share it,
    so verify == decode holds either way."""
    from jspec.config import PRESETS
    from jspec.dspark import DSparkConfig, DSparkDrafter
    from jspec.engine import Engine, EngineConfig
    from jspec.qwen3 import init_random
    from jspec.scoring import teacher_forced_logprobs
    from flax import nnx

    cfg = PRESETS["tiny-untied"].replace(dtype="bfloat16", head_dim=64)
    if shape == "standin":
        cfg = cfg.replace(hidden_size=256, head_dim=128, num_heads=4, num_kv_heads=2,
                          intermediate_size=768, num_layers=4, vocab_size=151936)
    dcfg = DSparkConfig(layers=cfg.replace(num_layers=1), target_layer_ids=(0, 1),
                        mask_token_id=cfg.vocab_size - 1, markov_rank=8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size - 1, 20).tolist()
    cont = rng.integers(0, cfg.vocab_size - 1, 64).tolist()
    diffs = {}
    for inv in (False, True):
        target = init_random(cfg, seed=1)
        nnx.update(target, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(target)))
        drafter = DSparkDrafter(dcfg, rngs=nnx.Rngs(2))
        ecfg = EngineConfig(max_lanes=1, page_size=16, max_context=128, batch_invariant=inv,
                            invariant_prefill=inv and invariant_prefill)
        stock = Engine(cfg, target, (), ecfg)
        spec = Engine(cfg, target, (), ecfg, drafter=drafter, draft_cfg=dcfg)
        a = teacher_forced_logprobs(stock, prompt, cont)
        b = teacher_forced_logprobs(spec, prompt, cont)
        diffs[inv] = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert diffs[True].max() == 0.0, f"mean {diffs[True].mean():.2e}, max {diffs[True].max():.2e}"
    assert diffs[False].max() > 0.0  # negative control: the default kernels round differently


@pytest.mark.parametrize("M", [7, 112, 224], ids=["solo", "team", "busy"])
@pytest.mark.parametrize("N,K", [(24576, 4096), (4096, 12288), (151936, 256)],
                         ids=["gate_up", "down", "markov_w2"])
def test_linear_triton_int8_weights_widen_exactly(N, K, M):
    """The drafter's int8 weights (EngineConfig.draft_linear "triton"): the kernel on the int8
    values matches the kernel on the same values widened to bf16 beforehand (the widening is
    exact), at the drafter's row counts, and project() through the route agrees with XLA's int8
    route. Bit for bit only in the wgmma (v3) plans: on the H100 (2026-12-07, JSPEC_LINEAR_MMA=
    mixed) the mma.sync (v2) plans at 7 rows differed in the last fp32 bits (at most 1.5e-6 of
    the value), most likely because Triton lays an upcast 8-bit operand out with another kWidth
    and so sums the k products in another order. The drafter needs no bit-exactness (it only
    proposes), so v2 plans are held to fp32 reassociation error."""
    from jspec.draft_weights import quantize_int8
    from jspec.kernels.linear_triton import linear_triton, make_plan
    from jspec.qwen3 import project
    kx, kw = jax.random.split(jax.random.PRNGKey(N + K + M))
    q = quantize_int8(0.02 * jax.random.normal(kw, (N, K), jnp.float32), (1,))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(linear_triton)
    got_int8 = np.asarray(f(x, q.values))
    got_widened = np.asarray(f(x, q.values.astype(jnp.bfloat16)))
    if make_plan(M, N, K).mma == "v3":
        np.testing.assert_array_equal(got_int8, got_widened)
    else:
        np.testing.assert_allclose(got_int8, got_widened, rtol=1e-5,
                                   atol=1e-5 * np.abs(got_widened).max())
    got = np.asarray(jax.jit(lambda x: project(x, q, "triton"))(x))
    want = np.asarray(jax.jit(lambda x: project(x, q, "xla"))(x))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
