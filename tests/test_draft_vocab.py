"""The frequency-ranked draft vocabulary (jspec/draft_vocab.py): choosing and reading the ids,
and the speculative engine drafting from them without changing the output law."""

import dataclasses
import json

import numpy as np
import pytest

from jspec.config import ConfigError
from jspec.draft_vocab import (RANKED_IDS_FILE, choose_ids, ranked_ids_from_rows,
                               read_ranked_ids, write_ranked_ids)
from jspec.dspark import init_random_drafter
from jspec.engine import Engine, EngineConfig, Request
from stats_helpers import chi2_pvalue
# The pair and fixtures of the speculative engine's tests (fixtures imported are registered here).
from test_spec_engine import (CFG, DCFG, ECFG, K, SPECS, _requests, bigram_pair,  # noqa: F401
                              pair_law, random_drafter, sampled_pairs, target,
                              tiny_pair_dirs)


def test_choose_ids_cuts_the_ranking_and_keeps_eos():
    ranked = [7, 3, 9, 1, 5]
    assert choose_ids(ranked, 3, 10).tolist() == [3, 7, 9]
    assert choose_ids(ranked, 2, 10, keep=[8, 3]).tolist() == [3, 7, 8]
    assert choose_ids(ranked, 5, 10).dtype == np.int32


@pytest.mark.parametrize("ranked,size,message", [
    ([1, 2, 3], 0, "must be >= 1"), ([1, 2, 3], 4, "exceeds the 3 ranked ids"),
    ([1, 2, 1], 3, "repeat"), ([1, 12, 3], 3, "outside the vocabulary"),
    ([-1, 2, 3], 2, "outside the vocabulary")])
def test_choose_ids_refuses_bad_input(ranked, size, message):
    with pytest.raises(ValueError, match=message):
        choose_ids(ranked, size, 10)


def test_ranked_ids_file_round_trip_and_errors(tmp_path):
    with pytest.raises(ConfigError, match=RANKED_IDS_FILE):
        read_ranked_ids(tmp_path)
    write_ranked_ids(tmp_path, np.asarray([4, 2, 9]))
    assert read_ranked_ids(tmp_path) == [4, 2, 9]
    (tmp_path / RANKED_IDS_FILE).write_text(json.dumps({"ids": [1]}))
    with pytest.raises(ConfigError, match="not a draft vocabulary"):
        read_ranked_ids(tmp_path)
    (tmp_path / RANKED_IDS_FILE).write_text(json.dumps({"ranked_ids": [1, "x"]}))
    with pytest.raises(ConfigError, match="not a draft vocabulary"):
        read_ranked_ids(tmp_path)


def test_ranked_ids_from_rows_orders_own_rows():
    sigma = np.asarray([2, 0, 3, 3, 1, 3])  # ids 2, 3, 5 share row 3
    mult = np.bincount(sigma, minlength=4)
    assert ranked_ids_from_rows(sigma, mult) == [1, 4, 0]
    assert ranked_ids_from_rows(sigma, mult, exclude=[4]) == [1, 0]


def _engine(drafter_pair, size, ranked, **kw):
    t, d = drafter_pair
    return Engine(CFG, t, kw.pop("eos", ()), EngineConfig(**{**ECFG.__dict__, "draft_vocab": size,
                                                            **kw}),
                  drafter=d, draft_cfg=DCFG, draft_vocab_ids=ranked)


def test_drafts_come_from_the_draft_vocabulary():
    """The drafter's tokens are draft ids, and q is a law on them (-inf elsewhere)."""
    t, d, _ = bigram_pair()
    ranked = np.random.default_rng(0).permutation(CFG.vocab_size).tolist()
    eng = _engine((t, d), 40, ranked)
    eng.generate(_requests([(6, 12), (9, 10)], temperature=1.0))
    ids = set(choose_ids(ranked, 40, CFG.vocab_size).tolist())
    state = eng._carry[1]
    target, drafter = eng.programs.models(eng.params)
    _, tokens, q, _ = eng.programs.draft(target, drafter, eng.caches[1], state,
                                         eng.programs.draft_vocab(eng.params))
    assert set(np.asarray(tokens).ravel().tolist()) <= ids
    q = np.asarray(q)
    outside = np.setdiff1d(np.arange(CFG.vocab_size), sorted(ids))
    assert np.all(np.isneginf(q[..., outside]))
    np.testing.assert_allclose(np.exp(q).sum(-1), 1.0, atol=1e-5)


def test_greedy_with_a_draft_vocabulary_is_stock_greedy(target, random_drafter):
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS))
    ranked = np.random.default_rng(1).permutation(CFG.vocab_size).tolist()
    spec = _engine((target, random_drafter), 64, ranked).generate(_requests(SPECS))
    assert [r.output_ids for r in spec] == [r.output_ids for r in stock]


@pytest.mark.parametrize("weights", [None, "int8"])
def test_dflash_drafter_with_a_draft_vocabulary(target, weights):
    """A DFlash drafter (no Markov head) drafts on the vocabulary's ids too (its zero bias was
    once sized to the whole vocabulary and broke the draft), with float or int8 weights;
    greedy output is stock's."""
    dcfg = dataclasses.replace(DCFG, markov_rank=0, confidence_head=False)
    assert dcfg.is_dflash
    drafter = init_random_drafter(dcfg, seed=3)
    ranked = np.random.default_rng(1).permutation(CFG.vocab_size).tolist()
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS[:3]))
    eng = Engine(CFG, target, (), EngineConfig(**{**ECFG.__dict__, "draft_vocab": 64,
                                                  "draft_weight_dtype": weights}),
                 drafter=drafter, draft_cfg=dcfg, draft_vocab_ids=ranked)
    spec = eng.generate(_requests(SPECS[:3]))
    assert [r.output_ids for r in spec] == [r.output_ids for r in stock]
    assert all(r.step_tokens for r in spec)


def test_draft_vocabulary_keeps_the_sampled_law():
    """Bigram target on 6 tokens; the drafter proposes only 3 of them (its law is exactly the
    target's there: an agreeing pair). The emitted pairs (t1, t2), t2 from a speculative
    iteration, must follow p(t1|x0) p(t2|t1): the other 3 tokens reach the output only through
    the residual. Negative control: the drafter's own law, zero on those 3 tokens, is refused."""
    t, d, law = bigram_pair(concentrate=6)
    eng = Engine(CFG, t, (), EngineConfig(max_lanes=8, page_size=8, max_context=32, prefill_chunk=8,
                                          decode_steps=1, attn_impl="xla", draft_vocab=3),
                 drafter=d, draft_cfg=DCFG, draft_vocab_ids=[0, 2, 4, 1, 3, 5])
    reqs, counts = sampled_pairs(eng)
    p_value = chi2_pvalue(counts, pair_law(law, law))
    assert p_value > 1e-3, p_value
    assert counts[:, [1, 3, 5]].sum() > 100  # tokens no draft can propose are emitted
    drafts_only = law * np.isin(np.arange(law.shape[1]), [0, 2, 4])[None]
    assert chi2_pvalue(counts, pair_law(law, drafts_only / drafts_only.sum(1, keepdims=True))) < 1e-6
    assert np.mean([np.mean(r.step_tokens) for r in reqs]) < K  # drafts were rejected too


def test_engine_refuses_a_draft_vocabulary_without_ranking(target, random_drafter):
    with pytest.raises(ValueError, match="draft_vocab_ids"):
        _engine((target, random_drafter), 10, None)
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        EngineConfig(draft_vocab=0)


def test_api_and_cli_with_a_draft_vocabulary(tiny_pair_dirs, tmp_path, capsys):
    """LLM(draft_vocab=N) and `jspec generate --draft-vocab N` read the ranking beside the
    drafter: greedy output equals stock's; a drafter without the ranking, a missing drafter and
    a bad N are refused with the problem named."""
    import shutil

    from jspec.api import LLM, SamplingParams
    from jspec.cli import main
    target_dir, draft_dir = tiny_pair_dirs
    ranked_dir = shutil.copytree(draft_dir, tmp_path / "ranked")
    write_ranked_ids(ranked_dir, np.random.default_rng(2).permutation(CFG.vocab_size).tolist())
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    stock = LLM(target_dir, max_lanes=2, max_context=128, attn_impl="xla").generate(["def f(x):"],
                                                                                    greedy)
    spec = LLM(target_dir, draft=ranked_dir, draft_vocab=100, max_lanes=2, max_context=128,
               attn_impl="xla").generate(["def f(x):"], greedy)
    assert spec[0].token_ids == stock[0].token_ids and spec[0].tokens_per_step >= 1.0
    with pytest.raises(ConfigError, match=RANKED_IDS_FILE):
        LLM(target_dir, draft=draft_dir, draft_vocab=100, max_context=128, attn_impl="xla")
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(target_dir, draft_vocab=100, max_context=128, attn_impl="xla")
    args = ["generate", "--model", str(target_dir), "--draft", str(ranked_dir), "--prompt",
            "def f(x):", "--max-tokens", "8", "--max-context", "128", "--attn-impl", "xla",
            "--json"]
    assert main(args + ["--draft-vocab", "100"]) == 0
    capsys.readouterr()
    assert main(args + ["--draft-vocab", "100000"]) == 2
    assert "exceeds the 512 ranked ids" in capsys.readouterr().err

