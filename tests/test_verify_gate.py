"""The confidence-gated verify (DSpark's prefix rule, EngineConfig.verify_threshold): which
drafts a lane proposes, the packed verify against the full one, greedy exactness, the sampled
law with a rule that varies the draft count by token (and, as the negative control, the same
rule made to look at the draft it admits), and the refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec import spec_steps
from jspec.dspark import init_random_drafter
from jspec.engine import Engine, EngineConfig, Request
from jspec.spec_steps import proposed_drafts, verify_buckets
from jspec.steps import DecodeState
from test_spec_engine import CFG, DCFG, ECFG, K, SPECS, _requests, bigram_pair

# fixtures shared with the speculative engine's tests
from test_spec_engine import random_drafter, target, tiny_pair_dirs  # noqa: F401


def test_proposed_drafts_is_the_prefix_above_the_threshold():
    c = np.array([[0.9, 0.9, 0.9, 0.1, 0.99, 0.99, 0.99],   # survival .9 .81 .73 .07 ...
                  [0.4, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99],
                  [0.999] * 7])
    z = jnp.asarray(np.log(c / (1 - c)), jnp.float32)
    assert proposed_drafts(z, 0.0, K).tolist() == [7, 7, 7]  # 0: every draft
    assert proposed_drafts(z, 0.5, K).tolist() == [3, 0, 7]  # a late high c never re-opens
    assert proposed_drafts(z, 0.8, K).tolist() == [2, 0, 7]
    assert proposed_drafts(z, 0.5, 2).tolist() == [2, 0, 2]  # never past num_draft


def test_verify_buckets():
    assert verify_buckets(16, 8) == (32, 48, 64, 96, 128)
    assert verify_buckets(1, 8) == (2, 3, 4, 6, 8)
    assert verify_buckets(4, 3) == (8, 12)  # widths at or past the block drop out
    assert verify_buckets(2, 1) == (2,)


def test_packed_verify_equals_the_full_verify(target, random_drafter):  # noqa: F811
    """Each lane's verified rows through the packed verify (at a bucket smaller than the whole
    block) give the full verify's logits, and write the same target and drafter K/V there."""
    ecfg = dataclasses.replace(ECFG, max_lanes=4, attn_impl="xla")
    eng = Engine(CFG, target, (), ecfg, drafter=random_drafter, draft_cfg=DCFG)
    rng = np.random.default_rng(5)
    B, W = 4, K + 1
    ppl = eng.ecfg.pages_per_lane
    table = np.zeros((B, ppl), np.int32)
    for b in range(B):
        table[b] = 1 + b * ppl + np.arange(ppl)
    lengths = np.array([9, 17, 4, 30], np.int32)
    active = np.array([True, True, False, True])
    from jspec.sampling import SamplingArrays
    state = DecodeState(
        tokens=jnp.asarray(rng.integers(0, CFG.vocab_size, B), jnp.int32),
        lengths=jnp.asarray(lengths), page_table=jnp.asarray(table),
        active=jnp.asarray(active), remaining=jnp.full((B,), 100, jnp.int32),
        stop_on_eos=jnp.zeros((B,), bool),
        sampling=SamplingArrays.from_lists([1.0] * B, [0] * B, [1.0] * B, seed=list(range(B))))
    key = jax.random.key(0)
    caches = jax.tree.map(lambda c: jax.random.normal(jax.random.fold_in(key, c.size % 97),
                                                      c.shape, c.dtype), eng.caches)
    draft_bk = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, K)), jnp.int32)
    num_draft_b = jnp.asarray([2, 0, 0, 5], jnp.int32)  # 3 + 1 + 1 + 6 = 11 rows
    programs = eng.programs
    tgt, drf = programs.models(eng.params)
    rows = verify_buckets(B, W)[1]  # 12 of 32
    assert rows < B * W
    t_packed, d_packed, logits_packed = programs.packed_verify(
        tgt, drf, caches[0], caches[1], state, draft_bk, num_draft_b, rows=rows)
    t_full, logits_full, taps, positions_t, slots_t = programs.verify(tgt, caches[0], state,
                                                                      draft_bk)
    d_full = programs._write_context(drf, caches[1], taps, positions_t[None], slots_t)
    lp, lf = np.asarray(logits_packed), np.asarray(logits_full)
    for b in range(B):
        if not active[b]:
            continue
        n = int(num_draft_b[b])
        np.testing.assert_allclose(lp[b, :n + 1], lf[b, :n + 1], atol=1e-4, rtol=1e-4)
        # Rows past n repeat row n (the sampler reads none of them).
        np.testing.assert_array_equal(lp[b, n + 1:], np.broadcast_to(lp[b, n], lp[b, n + 1:].shape))
        page_size = eng.ecfg.page_size
        for j in range(n + 1):
            pos = int(lengths[b]) + j
            page, off = table[b, pos // page_size], pos % page_size
            for packed, full in ((t_packed, t_full), (d_packed, d_full)):
                for (pk, pv), (fk, fv) in zip(packed, full):
                    np.testing.assert_allclose(np.asarray(pk[page, off]), np.asarray(fk[page, off]),
                                               atol=1e-4, rtol=1e-4)
                    np.testing.assert_allclose(np.asarray(pv[page, off]), np.asarray(fv[page, off]),
                                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threshold", [0.3, 0.999])
def test_gated_greedy_is_token_identical_to_stock(target, random_drafter, threshold):  # noqa: F811
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS))
    ecfg = dataclasses.replace(ECFG, verify_threshold=threshold)
    spec = Engine(CFG, target, (), ecfg, drafter=random_drafter, draft_cfg=DCFG).generate(
        _requests(SPECS))
    for a, b in zip(stock, spec):
        assert a.output_ids == b.output_ids
    steps = [n for r in spec for n in r.step_tokens]
    if threshold > 0.99:  # a random drafter's confidence never reaches it: one token a step
        assert set(steps) == {1}


def _confident_pair():
    """The bigram pair (q far from p) with a confidence head that reads only the previous token:
    c = 0.9 after token 5, 0.6 after 3, 0.3 after 2, 0.05 after the rest, so with threshold 0.5
    a lane's draft count depends on what it drew."""
    t, d, law = bigram_pair(concentrate=6, drafter_noise=2.0)  # q far from p: a biased rule shows
    w1 = np.asarray(d.markov_w1[...], np.float64)[:6]
    c = np.array([0.05, 0.05, 0.3, 0.6, 0.05, 0.9])
    want = np.log(c / (1 - c))
    v = np.linalg.lstsq(w1, want, rcond=None)[0]
    proj = np.zeros(d.confidence_proj[...].shape, np.float32)
    proj[0, CFG.hidden_size:] = v
    d.confidence_proj[...] = jnp.asarray(proj)
    d.confidence_bias[...] = jnp.zeros_like(d.confidence_bias[...])
    return t, d, law


def _pair_law_p_value(reqs, law, x0):
    """Chi-square p-value of the emitted (t2, t3) against sum_t1 p(t1|x0) p(t2|t1) p(t3|t2)."""
    pairs = np.array([r.output_ids[1:3] for r in reqs])
    assert pairs.max() < 6
    counts = np.zeros((6, 6))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    p = law[:6, :6] / law[:6, :6].sum(1, keepdims=True)
    t2 = (law[x0, :6] / law[x0, :6].sum()) @ p
    expected = t2[:, None] * p * len(reqs)
    keep = expected > 5
    return stats.chisquare(counts[keep], expected[keep] * counts[keep].sum()
                           / expected[keep].sum()).pvalue


def _sample(t, d, threshold, n=2400, x0=3):
    ecfg = EngineConfig(max_lanes=8, page_size=8, max_context=32, prefill_chunk=8,
                        decode_steps=1, attn_impl="xla", verify_threshold=threshold)
    eng = Engine(CFG, t, (), ecfg, drafter=d, draft_cfg=DCFG)
    return eng.generate([Request([1, x0], temperature=1.0, max_tokens=6, seed=i)
                         for i in range(n)])


def test_gated_sampled_law_and_the_anticipating_rule_as_negative_control(monkeypatch):
    """With the gate on, the emitted (t2, t3) follow the target's law although lanes verify 0,
    1, 2, ... drafts depending on what they drew. The negative control lets c_k read x_k itself
    (the draft it admits): the same test must reject that engine's output."""
    t, d, law = _confident_pair()
    reqs = _sample(t, d, 0.5)
    first_steps = [r.step_tokens[0] for r in reqs]
    assert len(set(first_steps)) >= 3  # the draft count really varied (1 = nothing verified)
    assert _pair_law_p_value(reqs, law, 3) > 1e-3

    # Anticipation: c_k from x_k. A fresh threshold keeps this engine's programs apart.
    monkeypatch.setattr(spec_steps, "confidence_prev_tokens", lambda anchor_b, draft_bk: draft_bk)
    bad = _sample(t, d, 0.5 + 1e-6)
    assert _pair_law_p_value(bad, law, 3) < 1e-6


def test_gate_refusals(target):  # noqa: F811
    with pytest.raises(ValueError, match="verify_threshold must be in"):
        EngineConfig(verify_threshold=1.0)
    with pytest.raises(ValueError, match="verify_threshold must be in"):
        EngineConfig(verify_threshold=-0.1)
    dflash_cfg = dataclasses.replace(DCFG, markov_rank=0, confidence_head=False)
    dflash = init_random_drafter(dflash_cfg, seed=2)
    with pytest.raises(ValueError, match="confidence head"):
        Engine(CFG, target, (), dataclasses.replace(ECFG, verify_threshold=0.5), drafter=dflash,
               draft_cfg=dflash_cfg)


@pytest.mark.gpu
def test_gated_verify_on_the_gpu_invariant_route():
    """The GPU's batch-invariant route (Triton linear kernels, the ragged attention with lanes
    of 1..8 queries in one call, a lax.switch over the verify sizes inside the device loop):
    gated greedy output equals stock greedy token for token."""
    from flax import nnx

    from jspec.qwen3 import init_random
    cfg = CFG.replace(dtype="bfloat16", head_dim=64)
    dcfg = dataclasses.replace(DCFG, layers=cfg.replace(num_layers=2))
    tgt = init_random(cfg, seed=1)
    nnx.update(tgt, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(tgt)))
    drf = init_random_drafter(dcfg, seed=3)
    base = EngineConfig(max_lanes=4, page_size=16, max_context=160, prefill_chunk=32,
                        decode_steps=3, batch_invariant=True)
    stock = Engine(cfg, tgt, (), base).generate(_requests(SPECS))
    gated = Engine(cfg, tgt, (), dataclasses.replace(base, verify_threshold=0.3), drafter=drf,
                   draft_cfg=dcfg)
    spec = gated.generate(_requests(SPECS))
    for a, b in zip(stock, spec):
        assert a.output_ids == b.output_ids
    assert min(d for r in spec for d in r.step_drafts) < K  # the gate verified fewer somewhere


def test_cli_generate_with_the_gate_and_its_refusals(tiny_pair_dirs, capsys):  # noqa: F811
    """jspec generate --verify-threshold: the same greedy text as without it; without a drafter,
    or out of range, a one-line error and exit code 2."""
    import json

    from jspec.cli import main
    target_dir, draft_dir = tiny_pair_dirs
    args = ["generate", "--model", str(target_dir), "--draft", str(draft_dir), "--prompt",
            "def f(x):", "--max-tokens", "12", "--temperature", "0", "--max-context", "128",
            "--attn-impl", "xla", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--verify-threshold", "0.5"]) == 0
    gated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert gated["token_ids"] == plain["token_ids"]
    assert main(args[:3] + args[5:] + ["--verify-threshold", "0.5"]) == 2
    assert "verify_threshold needs a draft model" in capsys.readouterr().err
    assert main(args + ["--verify-threshold", "1.5"]) == 2
    assert "verify_threshold must be in [0, 1)" in capsys.readouterr().err
