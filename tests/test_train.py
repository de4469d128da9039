"""Training (jspec.train) at toy size on CPU: the target learns and memorises, the drafter's
training forward is the inference draft, its loss is DeepSpec's, it learns and beats an
untrained drafter, resuming equals not stopping, and exports load back unchanged."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.config import Qwen3Config
from jspec.dspark import dense_draft, init_random_drafter
from jspec.qwen3 import forward_logits, init_random
from jspec.train import OptimConfig, TrainState, time_boxed_factor
from jspec.train.checkpointing import (CheckpointManager, LossLog, export_drafter, export_target,
                                       fit, resume)
from jspec.train.data import (BatchOrder, batch_source, corpus_manifest, gather_corpus, make_prompts,
                              pack_documents, pack_reply_arrays, read_replies, reply_arrays,
                              split_documents, write_replies)
from jspec.train.drafter import (DFLASH_LOSS, DrafterTrainConfig, DrafterTrainer, drafter_config,
                                 sample_anchors, sample_replies, training_block_logits)
from jspec.train.target import TargetTrainConfig, TargetTrainer

V, SEP, MASK = 64, 1, 63
CFG = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                  num_kv_heads=1, head_dim=16, max_position_embeddings=512, dtype="float32")
DCFG = drafter_config(CFG, draft_layers=1, mask_token_id=MASK, block_size=4, tap_layers=(0, 1),
                      markov_rank=8)
DFLASH_CFG = drafter_config(CFG, draft_layers=1, mask_token_id=MASK, block_size=4, tap_layers=(0, 1),
                            dflash=True)
SEQ, BATCH, TARGET_STEPS, REPLY_BATCH = 32, 16, 150, 40
TCFG = TargetTrainConfig(remat=True, loss_chunk=100)  # 512 rows: 6 chunks, the last padded
D_TCFG = DrafterTrainConfig(num_anchors=8, row_chunk=96, remat=True)  # 256 rows: 3 chunks, padded


def progression(start, stride, n):
    """The toy language: arithmetic progressions over ids 2..49 (mod 48)."""
    return [2 + (start - 2 + j * stride) % 48 for j in range(n)]


def toy_docs(n, seed):
    rng = np.random.default_rng(seed)
    return [progression(int(rng.integers(2, 50)), int(rng.integers(1, 4)), int(rng.integers(10, 40)))
            for _ in range(n)]


def same_tree(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


# ---- data -----------------------------------------------------------------------------------------

def test_pack_split_and_batch_order(tmp_path):
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rows = pack_documents(docs, 4, SEP)
    assert rows.tolist() == [[5, 6, 7, 1], [8, 9, 1, 10], [11, 12, 13, 1]]
    train, held = split_documents(toy_docs(50, 0), 0.2, seed=3)
    assert len(held) == 10 and len(train) == 40
    assert (train, held) == split_documents(toy_docs(50, 0), 0.2, seed=3)  # deterministic
    assert not {tuple(d) for d in train} & {tuple(d) for d in held}
    order = BatchOrder(10, 3, seed=1)
    epoch0 = np.concatenate([order.indices(i) for i in range(3)])
    assert len(set(epoch0.tolist())) == 9  # an epoch is a permutation, the tail dropped
    assert not np.array_equal(order.indices(0), order.indices(3))  # a new order each epoch
    assert np.array_equal(order.indices(4), BatchOrder(10, 3, seed=1).indices(4))  # position is the state

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "c.txt").write_text("no")
    files = gather_corpus(tmp_path)
    man = corpus_manifest(tmp_path, files)
    assert [f["path"] for f in man["files"]] == ["b.py", "pkg/a.py"]
    assert man["file_count"] == 2 and man["total_bytes"] == 12 and len(man["sha256"]) == 64

    arrays = reply_arrays([[5, 6], [7]], [[8, 9, 10], [11]], seq_len=6, pad_id=0)
    assert arrays["tokens"].tolist() == [[5, 6, 8, 9, 10, 0]]  # the 1-token reply is dropped
    assert arrays["loss_mask"].tolist() == [[False, False, True, True, True, False]]
    write_replies(tmp_path / "r.jsonl", [[1, 2]], [[3]])
    assert read_replies(tmp_path / "r.jsonl") == ([[1, 2]], [[3]])


# ---- target pre-training ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_data():
    train_docs, held_docs = split_documents(toy_docs(240, 0), 0.1, seed=0)
    return train_docs, pack_documents(train_docs, SEQ, SEP), pack_documents(held_docs, SEQ, SEP)


@pytest.fixture(scope="module")
def trained_target(toy_data):
    _, rows, held = toy_data
    trainer = TargetTrainer(init_random(CFG, seed=0), OptimConfig(TARGET_STEPS, lr=3e-3, weight_decay=0.01), TCFG)
    before = trainer.eval_loss(held, BATCH)
    records = fit(trainer, batch_source({"tokens": rows}, BATCH, seed=0), TARGET_STEPS,
                  progress=False, log_every=25)
    return trainer, records, before, trainer.eval_loss(held, BATCH)


def test_target_loss_decreases_and_memorises(trained_target, toy_data):
    trainer, records, before, after = trained_target
    assert records[0]["loss"] > 3.9 and records[-1]["loss"] < 1.0
    assert after["loss"] < 1.0 < 3.9 < before["loss"] and after["accuracy"] > 0.8
    model = trainer.model()
    # The held-out loss (rematerialised layers, padded vocabulary chunks) is the plain CE.
    _, _, held = toy_data
    forward = jitted(target_logits, model)
    logits = np.concatenate([np.asarray(forward(jnp.asarray(held[i:i + 8])), np.float64) for i in (0, 8)])
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], held[:16, 1:, None], -1)
    np.testing.assert_allclose(after["loss"], nll.mean(), rtol=1e-5)

    prompts = [progression(5, 2, 4), progression(40, 3, 5), progression(11, 1, 3)]
    replies = sample_replies(model, prompts, 10, temperature=0.0, batch_size=REPLY_BATCH)
    for prompt, reply in zip(prompts, replies):
        stride = prompt[1] - prompt[0]
        assert reply == progression(prompt[0], stride, len(prompt) + 10)[len(prompt):]


# ---- drafter: the training forward is the inference draft -----------------------------------------

def inference_block_logits(target, drafter, context_bs, anchor_b, prev_bk):
    """The inference draft path (jspec.dspark.dense_draft) for B lanes of one context length:
    U + B(prev) and confidence logits."""
    logits, _, conf = dense_draft(target, drafter, context_bs, anchor_b, prev_bk)
    return logits, conf


@functools.partial(jax.jit, static_argnums=(0, 1))
def _call(fn, graphs, states, *args):
    return fn(*(nnx.merge(g, st) for g, st in zip(graphs, states)), *args)


def jitted(fn, *modules):
    """fn(*modules, *args), compiled once per (fn, module graphs, shapes) for the whole file."""
    graphs, states = zip(*(nnx.split(m) for m in modules))
    return lambda *args: _call(fn, graphs, states, *args)


def target_logits(model, tokens):
    return forward_logits(model, tokens)[0]


@pytest.fixture(scope="module")
def random_pair():
    """Random target and drafter with weights wider than the init, so that every mistake in
    masks, positions or context shows in the logits."""
    target, drafter = init_random(CFG, seed=1), init_random_drafter(DCFG, seed=2)
    for m in (target, drafter):
        nnx.update(m, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(m)))
    return (target, drafter, jitted(training_block_logits, target, drafter),
            jitted(inference_block_logits, target, drafter))


def random_replies(seed, reply_start):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, 60, (8, SEQ)).astype(np.int32)
    loss_mask = np.zeros((8, SEQ), bool)
    for b, start in enumerate(reply_start):
        loss_mask[b, start:] = True
    return tokens, loss_mask


def test_training_block_logits_equal_inference_draft(random_pair):
    target, drafter, block_logits, inference_logits = random_pair
    blk = DCFG.block_size
    tokens, loss_mask = random_replies(0, [6, 3, 9, 12, 2, 20, 5, 7])
    loss_mask[1, 15:] = False  # a reply that ends early: blocks past it weigh 0 but stay exact
    anchors = np.tile(np.arange(8, dtype=np.int32) * 3 + 6, (8, 1))  # 6, 9, ..., 27
    anchors[0] = [6, 9, 10, 13, 17, 25, 28, 29]  # overlapping blocks; the last two overrun S
    anchors[1] = [3, 11, 13, 0, 0, 0, 0, 0]
    anchors[2, 7] = 29
    keep = np.ones((8, 8), bool)
    keep[1, 3:] = False  # dummy blocks
    logits, conf, layout = block_logits(jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(anchors),
                                        jnp.asarray(keep))
    assert np.isfinite(np.asarray(logits)).all() and np.isfinite(np.asarray(conf)).all()
    # The inference path, one context length at a time: (row, block) pairs anchored at p.
    for p, pairs in ((13, [(0, 3), (1, 2)]), (29, [(0, 7), (2, 7)])):
        rows = [b for b, _ in pairs]
        prev = [[int(tokens[b, min(p + k, SEQ - 1)]) for k in range(blk)] for b in rows]  # [x_p, y_1..]
        ref, ref_conf = inference_logits(jnp.asarray(tokens[rows, :p]), jnp.asarray(tokens[rows, p]),
                                         jnp.asarray(prev))
        for i, (b, a) in enumerate(pairs):
            assert anchors[b, a] == p
            scale = float(jnp.abs(ref[i]).max())
            np.testing.assert_allclose(np.asarray(logits[b, a]), np.asarray(ref[i]), atol=2e-5 * scale)
            np.testing.assert_allclose(np.asarray(conf[b, a]), np.asarray(ref_conf[i]), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(logits[0, 2] - logits[0, 3])).max() > 1.0  # neighbouring anchors differ
    w = np.asarray(layout["weights"])
    np.testing.assert_allclose(w[0, 0], np.exp(-np.arange(blk) / 4.0), rtol=1e-6)
    assert w[0, 7].tolist() == [1.0, np.float32(np.exp(-0.25)), 0.0, 0.0]  # 29 + 3 = S: past the end
    assert w[1, 3:].sum() == 0 and w[1, 2].tolist() == [1.0, 0.0, 0.0, 0.0]  # the reply ends at 14
    np.testing.assert_allclose(w[1, 1], [1.0, np.exp(-0.25), np.exp(-0.5), 0.0], rtol=1e-6)


def test_pack_reply_arrays_keeps_every_sequence_whole():
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 60, int(n)).tolist() for n in rng.integers(0, 12, 40)]
    replies = [rng.integers(2, 60, int(n)).tolist() for n in rng.integers(1, 20, 40)]
    single = reply_arrays(prompts, replies, SEQ, pad_id=0)
    packed = pack_reply_arrays(prompts, replies, SEQ, pad_id=0)
    again = pack_reply_arrays(prompts, replies, SEQ, pad_id=0)
    assert all(np.array_equal(packed[k], again[k]) for k in packed)  # deterministic
    n = SEQ - np.argmax(single["loss_mask"][:, ::-1], 1)  # each sequence's length
    assert len(packed["tokens"]) <= np.ceil(11 / 9 * n.sum() / SEQ) + 1  # best fit decreasing's bound
    assert len(packed["tokens"]) < 0.7 * len(single["tokens"])
    assert packed["loss_mask"].sum() == single["loss_mask"].sum()  # every reply token kept
    found = []
    for r, seg in enumerate(packed["segment_ids"]):
        used = int((seg > 0).sum())
        assert (seg[used:] == 0).all() and (np.diff(seg[:used]) >= 0).all() and seg[0] == 1
        assert (np.diff(seg[:used]) <= 1).all()  # segments 1, 2, ... side by side, padding last
        for sid in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == sid)
            assert packed["positions"][r, where].tolist() == list(range(len(where)))
            found.append((packed["tokens"][r, where].tolist(), packed["loss_mask"][r, where].tolist()))
        assert (packed["tokens"][r, used:] == 0).all() and not packed["loss_mask"][r, used:].any()
    want = [(t[:k].tolist(), m[:k].tolist()) for t, m, k in zip(single["tokens"], single["loss_mask"], n)]
    assert sorted(found) == sorted(want)  # each sequence exactly once, unchanged


def test_pack_reply_arrays_joined_rows_read_as_one_long_sequence():
    """joined_share: the drawn rows hold the same tokens and loss tokens as the plain packing, as
    one segment with positions 0 .. used - 1; the other rows are untouched."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 60, int(n)).tolist() for n in rng.integers(0, 12, 120)]
    replies = [rng.integers(2, 60, int(n)).tolist() for n in rng.integers(1, 20, 120)]
    plain = pack_reply_arrays(prompts, replies, SEQ, pad_id=0)
    assert all(np.array_equal(plain[k], pack_reply_arrays(prompts, replies, SEQ, pad_id=0,
                                                          joined_share=0.0)[k]) for k in plain)
    half = pack_reply_arrays(prompts, replies, SEQ, pad_id=0, joined_share=0.5, seed=3)
    every = pack_reply_arrays(prompts, replies, SEQ, pad_id=0, joined_share=1.0)
    for k in ("tokens", "loss_mask"):  # the same members in the same rows and order
        np.testing.assert_array_equal(half[k], plain[k])
        np.testing.assert_array_equal(every[k], plain[k])
    used = (plain["segment_ids"] > 0).sum(1)
    joined_rows = []
    for r, n in enumerate(used):
        assert every["segment_ids"][r].tolist() == [1] * n + [0] * (SEQ - n)
        assert every["positions"][r, :n].tolist() == list(range(n))
        joined = bool((half["segment_ids"][r, :n] == 1).all()) and plain["segment_ids"][r].max() > 1
        if joined:
            np.testing.assert_array_equal(half["positions"][r], every["positions"][r])
        elif plain["segment_ids"][r].max() > 1:
            for k in ("segment_ids", "positions"):
                np.testing.assert_array_equal(half[k][r], plain[k][r])
        joined_rows.append(joined)
    multi = int((plain["segment_ids"].max(1) > 1).sum())
    assert multi >= 20 and 0.2 * multi < sum(joined_rows) < 0.8 * multi
    other = pack_reply_arrays(prompts, replies, SEQ, pad_id=0, joined_share=0.5, seed=4)
    assert not np.array_equal(other["segment_ids"], half["segment_ids"])  # the seed draws the rows
    with pytest.raises(ValueError, match="joined_share"):
        pack_reply_arrays(prompts, replies, SEQ, pad_id=0, joined_share=1.5)


def test_joined_row_trains_as_its_concatenation(random_pair):
    """A joined row's blocks are those of its tokens read as one plain sequence; the same row
    packed with its segments kept apart gives other logits (negative control)."""
    target, drafter, block_logits, _ = random_pair
    rng = np.random.default_rng(6)
    prompts = [rng.integers(2, 60, 4).tolist(), rng.integers(2, 60, 3).tolist()]
    replies = [rng.integers(2, 60, n).tolist() for n in (7, 9)]  # lengths 11 and 12
    joined = pack_reply_arrays(prompts, replies, SEQ, pad_id=0, joined_share=1.0)
    apart = pack_reply_arrays(prompts, replies, SEQ, pad_id=0)
    assert len(joined["tokens"]) == 1 and joined["segment_ids"][0].max() == 1
    anchors = np.array([[4, 8, 12, 16, 17, 19, 20, 21]], np.int32)  # the second reply's blocks last
    base = tuple(map(jnp.asarray, (joined["tokens"], joined["loss_mask"], anchors, np.ones((1, 8), bool))))
    logits_j, _, lay_j = block_logits(*base, jnp.asarray(joined["segment_ids"]),
                                      jnp.asarray(joined["positions"]))
    logits_1, _, lay_1 = block_logits(*base)
    live = np.asarray(lay_1["eval_mask"])
    np.testing.assert_array_equal(np.asarray(lay_j["eval_mask"]), live)
    assert live[0, 4:].sum() > 8  # the second reply's blocks are scored
    scale = float(jnp.abs(logits_1).max())
    np.testing.assert_allclose(np.asarray(logits_j)[live], np.asarray(logits_1)[live], atol=2e-5 * scale)
    logits_a, _, _ = block_logits(*base, jnp.asarray(apart["segment_ids"]), jnp.asarray(apart["positions"]))
    second = live.copy()
    second[0, :4] = False
    assert np.abs(np.asarray(logits_a)[second] - np.asarray(logits_1)[second]).max() > 1e-2 * scale


def test_packed_rows_train_as_each_sequence_alone(random_pair):
    """Blocks of sequences packed into one row (segment ids, own positions) give the logits,
    labels and weights the same sequences give alone; a reply that starts right after another
    sequence's reply (an empty prompt) does not run into it. Negative control: the packed row
    read as one sequence gives other logits."""
    target, drafter, block_logits, _ = random_pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 60, 4).tolist(), [], rng.integers(2, 60, 3).tolist()]
    replies = [rng.integers(2, 60, n).tolist() for n in (7, 8, 9)]  # lengths 11, 8, 12
    single = reply_arrays(prompts, replies, SEQ, pad_id=0)
    packed = pack_reply_arrays(prompts, replies, SEQ, pad_id=0)
    offsets = np.array([0, 11, 19])  # one row, the sequences in their order
    assert packed["segment_ids"][0].tolist() == [1] * 11 + [2] * 8 + [3] * 12 + [0]
    anchors_1 = np.array([[4, 6, 8, 9], [0, 3, 5, 6], [3, 5, 8, 10]], np.int32)
    keep_1 = np.ones((3, 4), bool)
    logits_1, conf_1, lay_1 = block_logits(*map(jnp.asarray, (single["tokens"], single["loss_mask"],
                                                            anchors_1, keep_1)))
    anchors_p = (anchors_1 + offsets[:, None]).reshape(1, 12)  # sorted already
    packed_args = (packed["tokens"], packed["loss_mask"], anchors_p, np.ones((1, 12), bool))
    logits_p, conf_p, lay_p = block_logits(*map(jnp.asarray, packed_args + (packed["segment_ids"],
                                                                           packed["positions"])))
    per_seq = lambda x: np.asarray(x).reshape((3, 4) + np.asarray(x).shape[2:])
    for key in ("weights", "eval_mask"):
        np.testing.assert_array_equal(per_seq(lay_p[key]), np.asarray(lay_1[key]), err_msg=key)
    # Rows past a sequence's end weigh 0 (their teacher-forced prev token is the next sequence's).
    live = np.asarray(lay_1["eval_mask"])
    assert live.sum() > 30
    for key in ("labels", "prev"):
        np.testing.assert_array_equal(per_seq(lay_p[key])[live], np.asarray(lay_1[key])[live], err_msg=key)
    scale = float(jnp.abs(logits_1).max())
    np.testing.assert_allclose(per_seq(logits_p)[live], np.asarray(logits_1)[live], atol=2e-5 * scale)
    np.testing.assert_allclose(per_seq(conf_p)[live], np.asarray(conf_1)[live], rtol=1e-4, atol=1e-4)
    # the first reply's last block (anchor 9) stops at its end, where the next reply begins
    assert np.asarray(lay_1["weights"])[0, 3].tolist() == [1.0, 0.0, 0.0, 0.0]
    as_one, _, _ = block_logits(*map(jnp.asarray, packed_args))
    assert np.abs(per_seq(as_one)[1:][live[1:]] - np.asarray(logits_1)[1:][live[1:]]).max() > 1e-2 * scale


def test_drafter_loss_is_deepspec_objective(random_pair):
    """The trainer's loss (anchors sampled in the step, rematerialised layers, uneven vocabulary
    chunks) equals a NumPy transcription of reference 6.2-6.3 on the full logits."""
    target, drafter, block_logits, _ = random_pair
    tokens, loss_mask = random_replies(1, [5, 8, 3, 12, 20, 9, 4, 16])
    loss_mask[0, 20:] = False
    trainer = DrafterTrainer(target, drafter, OptimConfig(10), D_TCFG)
    metrics = trainer.evaluate({"tokens": tokens, "loss_mask": loss_mask}, 8, seed=7)

    key = jax.random.fold_in(jax.random.PRNGKey(7), 0)  # evaluate's key for its first batch
    anchors, keep = sample_anchors(key, jnp.asarray(loss_mask), D_TCFG.num_anchors)
    anchors, keep = np.asarray(anchors), np.asarray(keep)
    rows = np.arange(8)[:, None]
    assert keep.all() and loss_mask[rows, anchors].all() and loss_mask[rows, anchors + 1].all()
    assert (np.diff(anchors, axis=1) > 0).all()  # sorted, without replacement
    logits, conf, layout = block_logits(jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(anchors),
                                        jnp.asarray(keep))
    logits_t = jitted(target_logits, target)(jnp.asarray(tokens))
    f64 = lambda x: np.asarray(x, np.float64)
    ld, z, w = f64(logits), f64(conf), f64(layout["weights"])
    lt = f64(logits_t)[np.arange(8)[:, None, None], np.asarray(layout["target_index"])]
    logp = ld - ld.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    pt = np.exp(lt - lt.max(-1, keepdims=True))
    pt /= pt.sum(-1, keepdims=True)
    ce = -np.take_along_axis(logp, np.asarray(layout["labels"])[..., None], -1)[..., 0]
    l1 = np.abs(np.exp(logp) - pt).sum(-1)
    c_star = np.clip(1 - 0.5 * l1, 0, 1)
    bce = np.maximum(z, 0) - z * c_star + np.log1p(np.exp(-np.abs(z)))
    expect = {"ce": (w * ce).sum() / w.sum(), "l1": (w * l1).sum() / w.sum(), "conf": (w * bce).sum() / w.sum()}
    expect["loss"] = 0.1 * expect["ce"] + 0.9 * expect["l1"] + expect["conf"]
    for k, v in expect.items():
        np.testing.assert_allclose(metrics[k], v, rtol=3e-5, err_msg=k)
    m = np.asarray(layout["eval_mask"], np.float64)
    np.testing.assert_allclose(metrics["tau_prob"], 1 + np.cumprod(c_star * m, -1).sum() / 64, rtol=3e-5)
    for k in range(m.shape[-1]):  # mean c* per block position over the rows that count
        np.testing.assert_allclose(metrics[f"c_star_{k + 1}"],
                                   (c_star[..., k] * m[..., k]).sum() / m[..., k].sum(), rtol=3e-5)


def test_drafter_step_is_the_same_without_loss_remat(random_pair):
    """loss_remat=False keeps the loss chunks' residuals instead of recomputing them: a memory /
    compute trade, never a change of the step. Two steps from the same start on the same batch
    give the same metrics and parameters either way (the chunks are uneven and padded)."""
    target, drafter, _, _ = random_pair
    tokens, loss_mask = random_replies(1, [5, 8, 3, 12, 20, 9, 4, 16])
    batch = {"tokens": tokens, "loss_mask": loss_mask}
    runs = []
    for loss_remat in (True, False):
        cfg = dataclasses.replace(D_TCFG, loss_remat=loss_remat)
        trainer = DrafterTrainer(target, nnx.clone(drafter), OptimConfig(10, lr=1e-2), cfg, seed=3)
        start = jax.device_get(trainer.state.params)  # a host copy: the step donates the params
        for _ in range(2):  # the warm-up's first step has a learning rate of 0
            metrics = trainer.train_step(batch)
        runs.append((jax.device_get(metrics), jax.device_get(trainer.state.params), start))
    (m_remat, p_remat, p_start), (m_kept, p_kept, _) = runs
    for k in ("loss", "ce", "l1", "conf", "tau_prob"):
        np.testing.assert_allclose(m_kept[k], m_remat[k], rtol=1e-5, err_msg=k)
    moved = 0.0
    for a, b, a0 in zip(jax.tree.leaves(p_kept), jax.tree.leaves(p_remat), jax.tree.leaves(p_start)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        moved = max(moved, float(np.abs(np.asarray(a) - np.asarray(a0)).max()))
    assert moved > 1e-4  # the step did update the drafter: the comparison is not of two no-ops


# ---- drafter training ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reply_data(trained_target, toy_data):
    """Prompts from the corpus and the trained target's own greedy replies (greedy, so that the
    greedy accepted length against them is the acceptance against the target's greedy decode)."""
    trainer, *_ = trained_target
    model = trainer.model()
    train_docs, _, _ = toy_data
    prompts = make_prompts(train_docs, 200, 3, 10, seed=0)
    replies = sample_replies(model, prompts, SEQ - 10, temperature=0.0, batch_size=REPLY_BATCH)
    arrays = reply_arrays(prompts, replies, SEQ, pad_id=0)
    held = {k: v[:16] for k, v in arrays.items()}
    train = {k: v[16:] for k, v in arrays.items()}
    return model, train, held


DRAFT_STEPS = 120


def _drafter_trainer(model, dcfg, loss=None, seed=0):
    cfg = D_TCFG if loss is None else dataclasses.replace(D_TCFG, loss=loss)
    return DrafterTrainer(model, init_random_drafter(dcfg, seed=5), OptimConfig(DRAFT_STEPS, lr=3e-3), cfg, seed)


def test_drafter_learns_and_beats_untrained(reply_data):
    model, train, held = reply_data
    trainer = _drafter_trainer(model, DCFG)
    untrained = trainer.evaluate(held, 8)
    records = fit(trainer, batch_source(train, 8, seed=0), DRAFT_STEPS, progress=False, log_every=20)
    trained = trainer.evaluate(held, 8)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # (the confidence BCE has a floor: H(c*))
    assert records[-1]["ce"] < 0.5 * records[0]["ce"] and trained["ce"] < 0.6 * untrained["ce"]
    # Held out: the greedy accepted length against the target's greedy replies, and the
    # expected τ at T = 1 under teacher forcing (measured: 1.44 -> 2.78 and 1.48 -> 2.10).
    assert trained["l1"] < 0.8 * untrained["l1"]
    assert trained["tau_greedy"] > untrained["tau_greedy"] + 1.0 and trained["tau_greedy"] > 2.2
    assert trained["tau_prob"] > untrained["tau_prob"] + 0.3


def test_dflash_ablation_trains_with_ce_only(reply_data):
    model, train, _ = reply_data
    trainer = _drafter_trainer(model, DFLASH_CFG, loss=DFLASH_LOSS)
    drafter = trainer.drafter()
    assert not hasattr(drafter, "markov_w1") and not hasattr(drafter, "confidence_proj")
    records = fit(trainer, batch_source(train, 8, seed=0), DRAFT_STEPS, progress=False, log_every=20)
    assert all(r["loss"] == pytest.approx(r["ce"]) for r in records)  # CE only
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert records[-1]["tau_greedy"] > records[0]["tau_greedy"] + 1.0


def test_time_boxed_schedule_ends_at_the_deadline(reply_data):
    """A time-boxed run: warm-up then cosine over the time between its first (compiled) step and
    the deadline, read from a clock; the steps cap is not reached, the last update is ~0."""
    model, train, _ = reply_data
    cfg = OptimConfig(10_000, lr=3e-3, warmup_frac=0.1, time_boxed=True)
    assert time_boxed_factor(cfg, 0.0) == 0 and time_boxed_factor(cfg, 0.05) == pytest.approx(0.5)
    assert time_boxed_factor(cfg, 0.1) == pytest.approx(1.0) and time_boxed_factor(cfg, 1.0) == pytest.approx(0)
    assert time_boxed_factor(cfg, 0.55) == pytest.approx(0.5)
    trainer = DrafterTrainer(model, init_random_drafter(DCFG, seed=5), cfg, D_TCFG)
    ticks = iter(range(10_000))
    clock = lambda: float(next(ticks))  # one second per reading
    with pytest.raises(ValueError, match="needs a deadline"):
        fit(trainer, batch_source(train, 8, seed=0), 10_000, progress=False)
    target_trainer = TargetTrainer(init_random(CFG, seed=0), cfg, TCFG)
    with pytest.raises(ValueError, match="TargetTrainer.train_step takes no lr_factor"):
        fit(target_trainer, batch_source({"tokens": train["tokens"]}, 8, seed=0), 10, progress=False,
            deadline=1e12)
    before = jax.tree.map(np.asarray, trainer.state.params)
    records = fit(trainer, batch_source(train, 8, seed=0), 10_000, progress=False, deadline=41.0,
                  clock=clock)
    lrs = [r["lr"] for r in records]
    assert 10 < len(records) < 41 and trainer.state.step == len(records)
    assert lrs[0] == 0 and max(lrs) == pytest.approx(3e-3, rel=0.05) and lrs[-1] < 0.05 * 3e-3
    peak = int(np.argmax(lrs))
    assert all(np.diff(lrs[:peak + 1]) >= 0) and all(np.diff(lrs[peak:]) <= 0)
    assert not same_tree(before, trainer.state.params)
    # a step at factor 0 changes nothing: the first step is the compile's, not an update
    t2 = DrafterTrainer(model, init_random_drafter(DCFG, seed=5), cfg, D_TCFG)
    start = jax.tree.map(np.asarray, t2.state.params)
    t2.train_step(batch_source(train, 8, seed=0)(0), lr_factor=0.0)
    assert same_tree(start, t2.state.params)


# ---- resume ---------------------------------------------------------------------------------------

def _run(make_trainer, batch_at, directory, stop_after=None, resume_from=False):
    trainer = make_trainer()
    manager = CheckpointManager(directory / "ckpt", keep=2)
    start = resume(trainer, manager) if resume_from else None
    log = LossLog(directory / "log.jsonl", resume_step=trainer.state.step if resume_from else None)
    fit(trainer, batch_at, 12, manager=manager, ckpt_every=4, log=log, progress=False,
        stop_after=stop_after)
    log.close()
    return trainer, [json.loads(line) for line in (directory / "log.jsonl").read_text().splitlines()], start


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_resume_after_interrupt_equals_uninterrupted(kind, toy_data, reply_data, tmp_path):
    if kind == "target":
        _, rows, _ = toy_data
        make = lambda: TargetTrainer(init_random(CFG, seed=0), OptimConfig(TARGET_STEPS, lr=3e-3, weight_decay=0.01), TCFG)
        batch_at = batch_source({"tokens": rows}, BATCH, seed=0)
    else:
        model, train, _ = reply_data
        make = lambda: _drafter_trainer(model, DCFG)
        batch_at = batch_source(train, 8, seed=0)
    straight, log_a, _ = _run(make, batch_at, tmp_path / "a")
    _, _, _ = _run(make, batch_at, tmp_path / "b", stop_after=10)  # killed after step 10
    assert CheckpointManager(tmp_path / "b" / "ckpt").steps() == [4, 8]  # keep=2; step 8 is newest
    resumed, log_b, extra = _run(make, batch_at, tmp_path / "b", resume_from=True)
    assert extra == {}
    assert [r["step"] for r in log_b] == list(range(1, 13))  # steps 9, 10 were redone, not duplicated
    assert log_b == log_a  # every loss, lr and grad norm, bit for bit
    assert resumed.state.step == 12 and resumed.state.data_position == 12
    assert same_tree(resumed.state.params, straight.state.params)
    assert same_tree(resumed.state.opt_state, straight.state.opt_state)


def test_checkpoint_is_atomic_and_checked(tmp_path):
    state = TrainState(params={"w": jnp.ones((2, 3))}, opt_state=(jnp.zeros(()),), step=5,
                       data_position=7, rng=jax.random.PRNGKey(1))
    manager = CheckpointManager(tmp_path)
    (tmp_path / ".tmp-step_00000009-1").mkdir(parents=True)  # a crash mid-write leaves only a temp dir
    manager.save(state, extra={"note": 1})
    assert manager.steps() == [5]
    restored, extra = manager.restore(state)
    assert restored.step == 5 and restored.data_position == 7 and extra == {"note": 1}
    assert same_tree(restored.params, state.params) and np.array_equal(restored.rng, state.rng)
    wrong = TrainState(params={"w": jnp.ones((3, 3))}, opt_state=state.opt_state, step=0,
                       data_position=0, rng=state.rng)
    with pytest.raises(ValueError, match="expected"):
        manager.restore(wrong)


# ---- export -------------------------------------------------------------------------------------

def test_export_round_trips(trained_target, random_pair, tmp_path):
    from jspec.loading import load_drafter, load_model
    trainer, *_ = trained_target
    model = trainer.model()
    export_target(model, tmp_path / "target32", dtype="float32", eos_ids=[SEP])
    cfg, loaded = load_model(tmp_path / "target32")
    assert cfg == CFG and same_tree(nnx.state(loaded), nnx.state(model))
    assert json.loads((tmp_path / "target32" / "generation_config.json").read_text())["eos_token_id"] == [SEP]

    export_target(model, tmp_path / "target16", dtype="bfloat16")
    cfg16, loaded16 = load_model(tmp_path / "target16")
    assert cfg16.dtype == "bfloat16"
    assert same_tree(nnx.state(loaded16), jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))

    tied_cfg = CFG.replace(tie_word_embeddings=True)
    tied = init_random(tied_cfg, seed=3)
    export_target(tied, tmp_path / "tied", dtype="float32")
    assert same_tree(nnx.state(load_model(tmp_path / "tied")[1]), nnx.state(tied))

    _, drafter, *_ = random_pair
    for dcfg, d in ((DCFG, drafter), (DFLASH_CFG, init_random_drafter(DFLASH_CFG, seed=4))):
        export_drafter(d, loaded, tmp_path / "drafter", dtype="float32")  # with the shared copies
        dcfg_loaded, d_loaded = load_drafter(tmp_path / "drafter", cfg, loaded)
        assert dcfg_loaded == dcfg and same_tree(nnx.state(d_loaded), nnx.state(d))


@pytest.mark.gpu
def test_cudnn_segment_attention_matches_dense():
    """Packed rows' target attention through cuDNN (the segment mask as its bias) against the
    dense masked softmax: what training uses on the GPU."""
    from jspec.train.target import segment_attention_gap
    assert segment_attention_gap("cudnn") < 3e-2


def test_masked_block_attention_sees_exactly_the_split_keys():
    """The fused route's formulation (keys [context; every block] under one mask, here on XLA)
    equals the split block attention, and a block's queries read only the keys they may: moving
    another block's keys, or context keys past the anchor or of another sequence, changes
    nothing; moving a visible context key does."""
    from jspec.train.drafter import block_attention, block_attention_gap
    assert block_attention_gap("xla", dtype=jnp.float32) < 1e-5
    B, S, A, blk, Hkv, g, hd = 1, 12, 3, 4, 1, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    q = jax.random.normal(keys[0], (B, A * blk, Hkv * g, hd))
    k, v = (jax.random.normal(kx, (B, A * blk, Hkv, hd)) for kx in keys[1:3])
    k_ctx, v_ctx = (jax.random.normal(kx, (B, S, Hkv, hd)) for kx in keys[3:5])
    sees = np.zeros((B, A, S), bool)
    sees[0, 0, 2:6] = True  # block 0: its sequence starts at 2, its anchor is at 6
    sees[0, 1, :3] = True
    sees[0, 2, 7:11] = True

    def out(k_ctx=k_ctx, k=k):
        att = block_attention([(k_ctx, v_ctx)], jnp.asarray(sees), blk, "xla")
        return np.asarray(att(0, q, k, v, None)[0])[0, :blk]  # block 0's queries

    base = out()
    np.testing.assert_allclose(base, np.asarray(block_attention([(k_ctx, v_ctx)], jnp.asarray(sees),
                                                                blk, "split")(0, q, k, v, None)[0])[0, :blk],
                               atol=1e-5)
    np.testing.assert_array_equal(out(k=k.at[:, blk:].add(3.0)), base)  # other blocks' keys
    np.testing.assert_array_equal(out(k_ctx=k_ctx.at[:, 6:].add(3.0)), base)  # at / past the anchor
    np.testing.assert_array_equal(out(k_ctx=k_ctx.at[:, :2].add(3.0)), base)  # another sequence
    assert np.abs(out(k_ctx=k_ctx.at[:, 4].add(3.0)) - base).max() > 1e-3  # a visible key
    assert np.abs(out(k=k.at[:, 1].add(3.0)) - base).max() > 1e-3  # its own block's key


def test_block_attention_gap_sees_a_wrong_mask(monkeypatch):
    """The check train_standin runs before "cudnn": a masked route that lets every query see the
    whole context (no anchor, no sequence) is caught."""
    import jspec.train.drafter as drafter_mod
    real = drafter_mod._masked_block_attention
    monkeypatch.setattr(drafter_mod, "_masked_block_attention",
                        lambda ctx_kv, sees, block, impl, chunk: real(ctx_kv, jnp.ones_like(sees),
                                                                      block, impl, chunk))
    assert drafter_mod.block_attention_gap("xla", dtype=jnp.float32) > 0.1
    assert drafter_mod.block_attention_gap("xla_chunks", dtype=jnp.float32) > 0.1


def test_chunked_block_attention_is_the_masked_one(monkeypatch):
    """The blocks in chunks of anchors, each chunk seeing the context and only its own blocks'
    keys: the same outputs and the same gradients (the context keys' summed over the chunks) as
    one masked attention over every block, for chunks of 2 and 3 anchors out of 6, and the check
    train_standin runs before it trains agrees. A chunking that puts one block's queries beside
    another chunk's keys (the blocks shifted by one anchor) is told apart."""
    import jspec.train.drafter as drafter_mod

    B, S, A, blk, Hkv, g, hd = 2, 20, 6, 3, 1, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(4), 6)
    q = jax.random.normal(keys[0], (B, A * blk, Hkv * g, hd))
    k, v = (jax.random.normal(kx, (B, A * blk, Hkv, hd)) for kx in keys[1:3])
    k_ctx, v_ctx = (jax.random.normal(kx, (B, S, Hkv, hd)) for kx in keys[3:5])
    anchors = np.array([[1, 4, 7, 9, 13, 18], [0, 2, 5, 11, 15, 19]])
    seg = (np.arange(S) >= 10)[None].repeat(B, 0)  # two sequences a row
    sees = jnp.asarray((np.arange(S) < anchors[..., None])
                       & (seg[:, None, :] == np.take_along_axis(seg, anchors, 1)[..., None]))

    def run(impl, q, k, k_ctx):
        return drafter_mod.block_attention([(k_ctx, v_ctx)], sees, blk, impl)(0, q, k, v, None)[0]

    def loss(impl):  # a weighted sum, so that every output position counts differently
        w = jax.random.normal(keys[5], q.shape)
        return jax.grad(lambda *a: (run(impl, *a) * w).sum(), argnums=(0, 1, 2))

    base, base_grads = run("xla", q, k, k_ctx), loss("xla")(q, k, k_ctx)
    for chunk in (2, 3):
        monkeypatch.setattr(drafter_mod, "CHUNK_ANCHORS", chunk)
        np.testing.assert_allclose(run("xla_chunks", q, k, k_ctx), base, atol=1e-5)
        for got, want in zip(loss("xla_chunks")(q, k, k_ctx), base_grads):
            np.testing.assert_allclose(got, want, atol=1e-5)
    monkeypatch.setattr(drafter_mod, "CHUNK_ANCHORS", 2)
    shifted = run("xla_chunks", q, jnp.roll(k, blk, axis=1), k_ctx)
    assert np.abs(np.asarray(shifted) - np.asarray(base)).max() > 1e-3
    assert drafter_mod.block_attention_gap("xla_chunks", seq=64, dtype=jnp.float32) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "xla_chunks"])
def test_training_block_logits_are_the_same_on_the_masked_route(random_pair, impl, monkeypatch):
    """Packed rows (two sequences a row, a dummy anchor) through the whole training forward: the
    masked block attention (whole, or in chunks of 2 anchors) gives the split one's logits."""
    import jspec.train.drafter as drafter_mod
    monkeypatch.setattr(drafter_mod, "CHUNK_ANCHORS", 2)
    target, drafter, block_logits, _ = random_pair
    masked = jitted(functools.partial(training_block_logits, block_attn_impl=impl), target, drafter)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 60, n).tolist() for n in (4, 0, 3, 5)]
    replies = [rng.integers(2, 60, n).tolist() for n in (9, 6, 10, 8)]
    packed = pack_reply_arrays(prompts, replies, SEQ, pad_id=0)
    rows = packed["tokens"].shape[0]
    anchors = np.tile(np.array([3, 8, 12, 16, 20, 25], np.int32), (rows, 1))
    keep = np.ones_like(anchors, bool)
    keep[:, -1] = False
    args = [jnp.asarray(x) for x in (packed["tokens"], packed["loss_mask"], anchors, keep,
                                     packed["segment_ids"], packed["positions"])]
    split_logits, split_conf, _ = block_logits(*args)
    masked_logits, masked_conf, _ = masked(*args)
    scale = float(jnp.abs(split_logits).max())
    np.testing.assert_allclose(np.asarray(masked_logits), np.asarray(split_logits), atol=2e-5 * scale)
    np.testing.assert_allclose(np.asarray(masked_conf), np.asarray(split_conf), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "cudnn_chunks"])
def test_cudnn_block_attention_matches_split(impl):
    """The drafter's block attention fused on cuDNN (whole, or in chunks of anchors) against the
    split einsums (bf16)."""
    from jspec.train.drafter import block_attention_gap
    assert block_attention_gap(impl) < 3e-2


def test_segment_attention_gap_sees_a_wrong_mask(monkeypatch):
    """The check itself: dense against dense is 0; attention that ignores the segments (causal
    over the whole row) is caught."""
    import jspec.train.target as target_mod
    assert target_mod.segment_attention_gap("dense", 96) == 0.0
    real = target_mod.training_attention
    monkeypatch.setattr(target_mod, "training_attention",
                        lambda impl, seg=None: real("dense", None if impl == "cudnn" else seg))
    assert target_mod.segment_attention_gap("cudnn", 96) > 0.1
