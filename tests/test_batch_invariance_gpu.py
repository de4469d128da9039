"""Batch invariance on the GPU (marked `gpu`; run on the H200 with `pytest -m gpu`): the Triton
linear kernel and the attention kernel's invariant plan give a row the same bits alone and among
others, and an engine built with `batch_invariant=True` teacher-forces the same log-probs
through speculative verify (blocks of 8) as through stock decode: the bench's fixed-text gate
at exactly zero. The CPU suite checks the same contracts under Triton's interpreter
(tests/test_kernels_linear.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels_gpu import _need_gpu  # noqa: F401  (module fixture: skip without a GPU)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                                 (151936, 4096)], ids=["qkv", "o", "gate_up", "down", "lm_head"])
def test_linear_triton_rows_invariant_and_correct(N, K):
    from jspec.kernels.linear import linear_xla
    from jspec.kernels.linear_triton import linear_triton
    kx, kw = jax.random.split(jax.random.PRNGKey(N + K))
    w = (0.02 * jax.random.normal(kw, (N, K), jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (256, K), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(linear_triton)
    alone = np.asarray(f(x[:1], w))
    for m in (8, 16, 128, 256):
        np.testing.assert_array_equal(np.asarray(f(x[:m], w))[:1], alone)
    ref = np.asarray(jax.jit(linear_xla)(x[:8], w))
    got = np.asarray(f(x[:8], w))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


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


def test_batch_invariant_engine_verify_equals_decode():
    """The whole target: fixed texts teacher-forced through verify and through decode give the
    same log-probs to the bit with batch_invariant=True (and differ without it)."""
    from jspec.config import PRESETS
    from jspec.dspark import DSparkConfig, DSparkDrafter
    from jspec.engine import Engine, EngineConfig
    from jspec.qwen3 import init_random
    from jspec.scoring import teacher_forced_logprobs
    from flax import nnx

    cfg = PRESETS["tiny-untied"].replace(dtype="bfloat16", head_dim=64)
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
        ecfg = EngineConfig(max_lanes=1, page_size=16, max_context=128, batch_invariant=inv)
        stock = Engine(cfg, target, (), ecfg)
        spec = Engine(cfg, target, (), ecfg, drafter=drafter, draft_cfg=dcfg)
        a = teacher_forced_logprobs(stock, prompt, cont)
        b = teacher_forced_logprobs(spec, prompt, cont)
        diffs[inv] = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert diffs[True].max() == 0.0, f"mean {diffs[True].mean():.2e}, max {diffs[True].max():.2e}"
    assert diffs[False].max() > 0.0  # negative control: the default kernels round differently
