"""The DSpark drafter: module math against a float64 NumPy transcription of the specification,
the paged draft path against the dense one, checkpoints, and mismatch errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.config import PRESETS, ConfigError
from jspec.convert.safetensors_reader import CheckpointError
from jspec.dspark import DSparkConfig, dense_draft, init_random_drafter
from jspec.qwen3 import forward_logits, init_random

CFG = PRESETS["tiny-untied"]
DCFG = DSparkConfig(layers=CFG.replace(num_layers=2), block_size=7, mask_token_id=CFG.vocab_size - 1,
                    target_layer_ids=(0, 2, 4), markov_rank=16)


@pytest.fixture(scope="module")
def pair():
    target = init_random(CFG, seed=1)
    nnx.update(target, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(target)))
    drafter = init_random_drafter(DCFG, seed=2)
    nnx.update(drafter, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(drafter)))
    return target, drafter


# ---- float64 NumPy transcription of reference/dspark.md sections 1.4-1.6 and 2.2 --------------

def _np(x):
    return np.asarray(x, np.float64)


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def reference_block_logits(target, drafter, taps_cd, anchor, s, prev_tokens):
    """U_k + B_k for the block at s, given the context taps [s, n_taps*D] (float64)."""
    lc, eps, theta = DCFG.layers, DCFG.layers.rms_norm_eps, DCFG.layers.rope_theta
    Hq, Hkv, hd = lc.num_heads, lc.num_kv_heads, lc.head_dim
    c = _rms(taps_cd @ _np(drafter.fc[...]).T, _np(drafter.hidden_norm.weight[...]), eps)
    E = _np(target.embed_tokens[...])
    h = E[[anchor] + [DCFG.mask_token_id] * (DCFG.block_size - 1)]
    pos_ctx, pos_blk = np.arange(s, dtype=np.float64), s + np.arange(DCFG.block_size, dtype=np.float64)
    for layer in drafter.layers:
        a = layer.self_attn
        Wq = _np(a.q_proj[...]).reshape(Hq * hd, -1)
        Wk = _np(a.k_proj[...]).reshape(Hkv * hd, -1)
        Wv = _np(a.v_proj[...]).reshape(Hkv * hd, -1)
        x = _rms(h, _np(layer.input_layernorm.weight[...]), eps)
        q = _rope(_rms((x @ Wq.T).reshape(-1, Hq, hd), _np(a.q_norm.weight[...]), eps), pos_blk, theta)
        kin = np.concatenate([c, x])
        k = _rms((kin @ Wk.T).reshape(-1, Hkv, hd), _np(a.k_norm.weight[...]), eps)
        k = _rope(k, np.concatenate([pos_ctx, pos_blk]), theta)
        v = (kin @ Wv.T).reshape(-1, Hkv, hd)
        k, v = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)  # no mask at all
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(DCFG.block_size, -1)
        h = h + o @ _np(a.o_proj[...]).reshape(-1, Hq * hd).T
        y = _rms(h, _np(layer.post_attention_layernorm.weight[...]), eps)
        m = layer.mlp
        g, u = y @ _np(m.gate_proj[...]).T, y @ _np(m.up_proj[...]).T
        h = h + (g / (1 + np.exp(-g)) * u) @ _np(m.down_proj[...]).T
    hf = _rms(h, _np(drafter.norm.weight[...]), eps)
    U = hf @ _np(target.head_weight()).T
    B = _np(drafter.markov_w1[...])[prev_tokens] @ _np(drafter.markov_w2[...]).T
    return U + B


def dense_block_logits(target, drafter, context_tokens, anchor, prev_tokens):
    """The jspec modules with dense attention (dspark.dense_draft) for one block; also the taps."""
    logits, _, _ = dense_draft(target, drafter, [context_tokens], [anchor], [prev_tokens])
    _, taps = forward_logits(target, jnp.asarray([context_tokens]), tap_layers=DCFG.target_layer_ids)
    return logits[0], taps


def test_drafter_math_matches_float64_reference(pair):
    target, drafter = pair
    rng = np.random.default_rng(0)
    context = rng.integers(0, CFG.vocab_size, 13).tolist()
    anchor, prev = int(rng.integers(CFG.vocab_size)), rng.integers(0, CFG.vocab_size, 7)
    prev[0] = anchor
    ours, taps = dense_block_logits(target, drafter, context, anchor, prev)
    taps_cd = np.concatenate([_np(t[0]) for t in taps], -1)
    ref = reference_block_logits(target, drafter, taps_cd, anchor, len(context), prev)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    assert np.abs(ref[1:] - ref[:-1]).max() > 1.0  # positions differ: the test sees the block


def test_stacked_context_kv_is_the_per_layer_projection():
    """fuse_context_kv (the engine's layout): one GEMM over every layer's stacked k/v weights
    gives each layer's context K/V as its own k_proj / v_proj do; unfuse_projections drops it
    (checkpoints never see it) and fusing twice changes nothing."""
    from jspec.qwen3 import unfuse_projections
    drafter = init_random_drafter(DCFG, seed=5)
    rng = np.random.default_rng(2)
    ctx = jnp.asarray(rng.normal(size=(2, 5, CFG.hidden_size)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    before = drafter.context_kv(ctx, pos)
    drafter.fuse_context_kv()
    drafter.fuse_context_kv()
    Hkv, hd = DCFG.layers.num_kv_heads, DCFG.layers.head_dim
    L = DCFG.layers.num_layers
    assert drafter.context_kv_proj[...].shape == (L * 2 * Hkv, hd, CFG.hidden_size)
    after = drafter.context_kv(ctx, pos)
    for (k0, v0), (k1, v1) in zip(before, after):
        np.testing.assert_allclose(np.asarray(k1), np.asarray(k0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v0), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(after[0][0]), np.asarray(after[1][0]))  # layers differ
    unfuse_projections(drafter)
    assert not hasattr(drafter, "context_kv_proj")
    assert "context_kv_proj" not in str(jax.tree_util.tree_structure(nnx.state(drafter)))


def test_paged_draft_equals_dense_draft(pair):
    """The engine's draft (paged, flash-style kernel interface, block keys written past the
    committed length) gives the q the dense path gives, for every lane of a mixed batch."""
    from jspec.engine import Engine, EngineConfig, Request
    from jspec.steps import DecodeState
    target, drafter = pair
    eng = Engine(CFG, target, (), EngineConfig(max_lanes=2, page_size=8, max_context=64,
                                               prefill_chunk=16, decode_steps=1, attn_impl="xla"),
                 drafter=drafter, draft_cfg=DCFG)
    rng = np.random.default_rng(1)
    reqs = [Request(rng.integers(0, CFG.vocab_size, n).tolist(), temperature=1.0, seed=i,
                    max_tokens=20) for i, n in enumerate((11, 21))]
    for r in reqs:
        r.lane, r.pages = reqs.index(r), eng.allocator.allocate(eng.cache_shape.pages_for(40))
        eng.lanes[r.lane] = r
        eng._prefill(r)
    state = DecodeState(
        tokens=jnp.asarray([r.output_ids[-1] for r in reqs], jnp.int32),
        lengths=jnp.asarray([len(r.prompt_ids) for r in reqs], jnp.int32),
        page_table=jnp.asarray(np.stack([eng._page_row(r) for r in reqs])),
        active=jnp.ones(2, bool), remaining=jnp.full(2, 20, jnp.int32),
        stop_on_eos=jnp.ones(2, bool), sampling=eng._sampling(reqs))
    tgt, drf = eng.programs.models(eng.params)
    _, drafts, q, confidence = jax.jit(eng.programs.draft)(tgt, drf, eng.caches[1], state)
    for b, r in enumerate(reqs):
        prev = [r.output_ids[-1]] + np.asarray(drafts[b, :-1]).tolist()
        dense, _ = dense_block_logits(target, drafter, r.prompt_ids, r.output_ids[-1], prev)
        np.testing.assert_allclose(np.asarray(q[b]), np.asarray(jax.nn.log_softmax(dense, -1)),
                                   atol=2e-4)
        # The confidence of x_k reads x_{k-1} (the anchor for k = 1), never x_k itself.
        _, _, dense_conf = dense_draft(target, drafter, [r.prompt_ids], [r.output_ids[-1]], [prev])
        np.testing.assert_allclose(np.asarray(confidence[b]), np.asarray(dense_conf[0]), atol=2e-4)


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drafter_dir(pair, tmp_path_factory):
    from hf_models import save_drafter_checkpoint
    target, drafter = pair
    d = tmp_path_factory.mktemp("drafter")
    save_drafter_checkpoint(drafter, DCFG, d, target=target)
    return d


def _same_params(a, b):
    la, lb = jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_load_deepspec_checkpoint_and_convert(pair, drafter_dir, tmp_path):
    from jspec.cli import main
    from jspec.loading import load_drafter
    target, drafter = pair
    cfg, loaded = load_drafter(drafter_dir, CFG, target)
    assert cfg == DCFG and _same_params(loaded, drafter)
    assert not hasattr(loaded, "embed_tokens") and not hasattr(loaded, "lm_head")  # shared, not copied
    assert main(["convert", str(drafter_dir), str(tmp_path / "conv"), "--quiet"]) == 0
    marker = json.loads((tmp_path / "conv" / "jspec.json").read_text())
    assert marker["kind"] == "dspark" and set(marker["shared_fingerprints"]) == {"embed_tokens.weight", "lm_head.weight"}
    cfg2, loaded2 = load_drafter(tmp_path / "conv", CFG, target)
    assert cfg2 == DCFG and _same_params(loaded2, drafter)
    other = init_random(CFG, seed=9)  # a different target: its embedding is not the copy
    with pytest.raises(CheckpointError, match="differs from the target"):
        load_drafter(tmp_path / "conv", CFG, other)
    with pytest.raises(CheckpointError, match="differs from the target"):
        load_drafter(drafter_dir, CFG, other)


def test_dflash_configuration_from_the_same_code(pair, tmp_path):
    from hf_models import save_drafter_checkpoint
    from jspec.loading import load_drafter
    target, _ = pair
    dflash_cfg = DSparkConfig(layers=DCFG.layers, block_size=7, mask_token_id=DCFG.mask_token_id,
                              target_layer_ids=DCFG.target_layer_ids, markov_rank=0,
                              confidence_head=False)
    dflash = init_random_drafter(dflash_cfg, seed=4)
    save_drafter_checkpoint(dflash, dflash_cfg, tmp_path / "dflash")
    keys = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert keys["markov_rank"] == 0 and not keys["enable_confidence_head"]
    cfg, loaded = load_drafter(tmp_path / "dflash", CFG, target)
    assert cfg.is_dflash and not hasattr(loaded, "markov_w1")
    assert float(jnp.abs(loaded.markov_bias(jnp.asarray([1, 2]))).max()) == 0.0


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(hidden_size=128), "hidden_size"),
    (lambda d: d.update(vocab_size=1000), "vocab_size"),
    (lambda d: d.update(target_layer_ids=[0, 2, 5]), "target_layer_ids"),
    (lambda d: d.update(target_layer_ids=[0, 2, 40]), "target_layer_ids"),
    (lambda d: d.update(mask_token_id=CFG.vocab_size + 3), "mask_token_id"),
    (lambda d: d.update(markov_head_type="rnn"), "markov_head_type"),
])
def test_mismatched_drafter_is_refused(drafter_dir, tmp_path, change, message):
    import shutil
    from jspec.loading import load_drafter
    bad = tmp_path / "bad"
    shutil.copytree(drafter_dir, bad)
    hf = json.loads((bad / "config.json").read_text())
    change(hf)
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises((ConfigError, CheckpointError), match=message):
        load_drafter(bad, CFG, None)


def test_target_dir_is_not_a_drafter(tmp_path):
    from hf_models import make_hf_qwen3
    from jspec.loading import load_drafter
    make_hf_qwen3(CFG, tmp_path)
    with pytest.raises(ConfigError, match="not a DSpark"):
        load_drafter(tmp_path, CFG, None)
