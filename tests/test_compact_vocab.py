"""The stand-in's compact vocabulary: rows by corpus frequency, the graft's vocab_law read back,
and the training losses with log multiplicities equal to the losses of the expanded
full-vocabulary models (convert/expand_vocab.py) that the engine and the graft serve."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.config import Qwen3Config
from jspec.convert.expand_vocab import expand_drafter, expand_target
from jspec.dspark import init_random_drafter
from jspec.loading import load_drafter, load_model
from jspec.qwen3 import forward_logits, init_random
from jspec.train.checkpointing import export_drafter, export_target
from jspec.train.drafter import DrafterTrainConfig, drafter_config, drafter_loss
from jspec.train.target import TargetTrainConfig, lm_loss
from jspec.train.vocab import build_compact_vocab, coverage

FULL, SPECIALS, MASK_ID, ROWS = 300, (290, 291, 292), 295, 40


@pytest.fixture(scope="module")
def vocab_docs():
    rng = np.random.default_rng(0)
    # Zipf-like ids: a few frequent ones, a long tail beyond what 40 rows hold.
    docs = [list(np.minimum(rng.zipf(1.3, size=int(rng.integers(20, 60))) + 3, 280)) for _ in range(40)]
    return build_compact_vocab(docs, ROWS, specials=SPECIALS, mask_id=MASK_ID, full_vocab=FULL), docs


def test_rows_follow_frequency_and_law_is_consistent(vocab_docs):
    vocab, docs = vocab_docs
    sigma, n = vocab.law()
    counts = np.bincount(np.concatenate(docs), minlength=FULL)
    own = [t for t in vocab.id_to_row if t not in SPECIALS and t != MASK_ID]
    assert len(own) == ROWS - len(SPECIALS) - 2
    assert min(counts[own]) >= max(np.delete(counts, own + list(SPECIALS) + [MASK_ID]))
    for t, r in vocab.id_to_row.items():
        assert sigma[t] == r
    assert sigma[MASK_ID] == vocab.mask_row == ROWS - 1
    assert n.sum() == FULL and n[vocab.shared_row] == FULL - (ROWS - 1) and (n >= 1).all()
    assert np.all(np.delete(n, vocab.shared_row) == 1)
    assert 0.5 < coverage(vocab, docs) < 1.0
    assert np.array_equal(vocab.to_rows([own[0], 279]), [vocab.id_to_row[own[0]], vocab.shared_row]) or \
        279 in vocab.id_to_row


@pytest.fixture(scope="module")
def compact_pair(vocab_docs, tmp_path_factory):
    vocab, _ = vocab_docs
    root = tmp_path_factory.mktemp("compact")
    cfg = Qwen3Config(vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256, dtype="float32",
                      tie_word_embeddings=True)
    model = init_random(cfg, seed=3)
    export_target(model, root / "s", dtype="float32")
    hf = json.loads((root / "s" / "config.json").read_text())
    hf.update(vocab.hf_keys())
    (root / "s" / "config.json").write_text(json.dumps(hf))
    dcfg = drafter_config(cfg, draft_layers=1, mask_token_id=vocab.mask_row, block_size=4,
                          tap_layers=(0, 1), markov_rank=8)
    drafter = init_random_drafter(dcfg, seed=4)
    export_drafter(drafter, model, root / "d", dtype="float32")
    expand_target(root / "s", root / "s_full", vocab_size=FULL)
    expand_drafter(root / "d", root / "d_full", root / "s", vocab_size=FULL, mask_token_id=MASK_ID)
    return root, vocab, model, drafter


def test_expanded_target_logits_are_rows_by_sigma(compact_pair):
    root, vocab, model, _ = compact_pair
    cfg_full, full = load_model(root / "s_full")
    assert cfg_full.vocab_size == FULL and not cfg_full.tie_word_embeddings
    sigma, _ = vocab.law()
    ids = np.array([[5, 6, 250, 7, 290, 4, 100, 8]], np.int32)
    z_full = forward_logits(full, jnp.asarray(ids))[0]
    z_rows = forward_logits(model, jnp.asarray(vocab.to_rows(ids)))[0]
    np.testing.assert_allclose(np.asarray(z_full), np.asarray(z_rows)[..., sigma], rtol=1e-5, atol=1e-5)


def test_target_loss_with_log_multiplicity_is_the_expanded_models(compact_pair):
    root, vocab, model, _ = compact_pair
    _, full = load_model(root / "s_full")
    ids = np.random.default_rng(1).integers(0, 280, size=(2, 24)).astype(np.int32)
    cfg = TargetTrainConfig(loss_chunk=16)
    loss_full, _ = lm_loss(full, jnp.asarray(ids), cfg)
    loss_rows, _ = lm_loss(model, jnp.asarray(vocab.to_rows(ids)), cfg,
                           jnp.asarray(vocab.log_multiplicity()))
    # The expanded model gives a shared-row id p = P_S(row) / n: the row CE plus log n there.
    rows = vocab.to_rows(ids)[:, 1:]
    extra = np.log(vocab.law()[1])[rows].mean()
    np.testing.assert_allclose(float(loss_full), float(loss_rows) + extra, rtol=1e-5)
    # Negative control: without the multiplicities the compact loss is a different law.
    loss_plain, _ = lm_loss(model, jnp.asarray(vocab.to_rows(ids)), cfg)
    assert abs(float(loss_full) - (float(loss_plain) + extra)) > 1e-2


def test_drafter_l1_with_log_multiplicity_is_the_expanded_pairs(compact_pair):
    root, vocab, model, drafter = compact_pair
    cfg_full, full = load_model(root / "s_full")
    dcfg_full, drafter_full = load_drafter(root / "d_full", cfg_full, full)
    assert dcfg_full.mask_token_id == MASK_ID
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 280, size=(2, 32)).astype(np.int32)
    mask = np.zeros((2, 32), bool)
    mask[:, 10:] = True
    cfg = DrafterTrainConfig(num_anchors=6, row_chunk=64)
    key = jax.random.PRNGKey(0)
    _, m_full = drafter_loss(full, drafter_full, jnp.asarray(ids), jnp.asarray(mask), key, cfg)
    _, m_rows = drafter_loss(model, drafter, jnp.asarray(vocab.to_rows(ids)), jnp.asarray(mask), key, cfg,
                             jnp.asarray(vocab.log_multiplicity()))
    for k in ("l1", "conf", "tau_prob", "accept_rate"):
        np.testing.assert_allclose(float(m_full[k]), float(m_rows[k]), rtol=2e-4, atol=1e-5, err_msg=k)
    _, m_plain = drafter_loss(model, drafter, jnp.asarray(vocab.to_rows(ids)), jnp.asarray(mask), key, cfg)
    assert abs(float(m_plain["l1"]) - float(m_full["l1"])) > 1e-3
