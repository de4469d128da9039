"""Speculative decoding on the paged engine: greedy exactness, acceptance with an agreeing
drafter, batch independence, teacher-forced log-probabilities, the sampled law end to end,
no recompilation, preemption."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.config import PRESETS
from jspec.dspark import DSparkConfig, init_random_drafter
from jspec.engine import Engine, EngineConfig, Request
from jspec.qwen3 import init_random
from jspec.scoring import teacher_forced_logprobs
from jspec.steps import compile_count
from stats_helpers import chi2_pvalue

CFG = PRESETS["tiny-untied"]
K = 7
DCFG = DSparkConfig(layers=CFG.replace(num_layers=2), block_size=K, mask_token_id=CFG.vocab_size - 1,
                    target_layer_ids=(0, 2, 4), markov_rank=CFG.hidden_size)
ECFG = EngineConfig(max_lanes=3, page_size=8, max_context=160, prefill_chunk=16, decode_steps=3,
                    attn_impl="xla")


def _scaled(module, factor, seed_note=""):
    nnx.update(module, jax.tree.map(lambda x: x * factor if x.ndim > 1 else x, nnx.state(module)))
    return module


@pytest.fixture(scope="module")
def target():
    return _scaled(init_random(CFG, seed=1), 5)


@pytest.fixture(scope="module")
def random_drafter():
    return _scaled(init_random_drafter(DCFG, seed=3), 5)


def bigram_pair(concentrate: int | None = None, drafter_noise: float = 0.0):
    """A target whose attention and MLP write nothing (o_proj = down_proj = 0), so its next-token
    law is a bigram p(.|x) = softmax(lm_head . norm(embed[x])); and a drafter whose base logits are
    zero (final norm 0) and whose Markov head is that bigram exactly (W1 = norm(embed), W2 =
    lm_head), so q == p: every draft is accepted. `concentrate` keeps the law on that many
    tokens; `drafter_noise` perturbs W2 so that q != p."""
    t = init_random(CFG, seed=11)
    rng = np.random.default_rng(0)
    D, V = CFG.hidden_size, CFG.vocab_size
    embed = rng.normal(size=(V, D)).astype(np.float32)
    head = 3.0 * rng.normal(size=(V, D)).astype(np.float32) / np.sqrt(D)
    if concentrate:
        embed[:, 0] = 4.0  # one constant channel ...
        head[:, 0] = np.where(np.arange(V) < concentrate, 0.0, -30.0) / 4.0  # ... cuts off the tail
    t.embed_tokens[...] = jnp.asarray(embed)
    t.lm_head[...] = jnp.asarray(head)
    for layer in t.layers:
        layer.self_attn.o_proj[...] = jnp.zeros_like(layer.self_attn.o_proj[...])
        layer.mlp.down_proj[...] = jnp.zeros_like(layer.mlp.down_proj[...])
    normed = embed / np.sqrt(np.mean(embed ** 2, -1, keepdims=True) + CFG.rms_norm_eps)
    d = init_random_drafter(DCFG, seed=12)
    d.norm.weight[...] = jnp.zeros_like(d.norm.weight[...])
    d.markov_w1[...] = jnp.asarray(normed)
    d.markov_w2[...] = jnp.asarray(head + drafter_noise * rng.normal(size=head.shape).astype(np.float32))
    law = jax.nn.softmax(jnp.asarray(normed @ head.T), -1)  # law[x] = p(. | x)
    return t, d, np.asarray(law, np.float64)


def sampled_pairs(eng, n: int = 2400, x0: int = 3) -> tuple[list, np.ndarray]:
    """n requests [1, x0] at T = 1, 3 tokens each: (the requests, counts [6, 6] of their first
    two emitted tokens (t1, t2), t2 from a speculative iteration)."""
    reqs = eng.generate([Request([1, x0], temperature=1.0, max_tokens=3, seed=i) for i in range(n)])
    pairs = np.array([r.output_ids[:2] for r in reqs])
    assert pairs.max() < 6
    counts = np.zeros((6, 6))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    return reqs, counts


def pair_law(first, second, x0: int = 3) -> np.ndarray:
    """The law of (t1, t2) after x0 when t1 ~ first[x0] and t2 ~ second[t1]: [6, 6]."""
    return np.outer(first[x0, :6], np.ones(6)) * second[:6, :6]

def _requests(specs, temperature=0.0, seed0=0, **kw):
    rng = np.random.default_rng(7)
    return [Request(rng.integers(0, CFG.vocab_size, n).tolist(), temperature=temperature,
                    max_tokens=m, seed=seed0 + i, request_id=i, **kw) for i, (n, m) in enumerate(specs)]


SPECS = [(5, 20), (20, 7), (33, 12), (9, 30), (3, 1), (14, 25)]


def test_greedy_spec_is_token_identical_to_stock_random_drafter(target, random_drafter):
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS))
    eng = Engine(CFG, target, (), ECFG, drafter=random_drafter, draft_cfg=DCFG)
    spec = eng.generate(_requests(SPECS))
    for a, b in zip(stock, spec):
        assert a.output_ids == b.output_ids
    assert all(r.step_tokens for r in spec if r.max_tokens > 1)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1


def test_agreeing_drafter_accepts_whole_blocks_greedy_and_sampled():
    t, d, _ = bigram_pair()
    for temperature in (0.0, 1.0):
        stock = Engine(CFG, t, (), ECFG).generate(_requests(SPECS, temperature))
        spec = Engine(CFG, t, (), ECFG, drafter=d, draft_cfg=DCFG).generate(_requests(SPECS, temperature))
        for a, b in zip(stock, spec):
            assert len(b.output_ids) == b.max_tokens
            if temperature == 0.0:
                assert a.output_ids == b.output_ids
            # Every verify step commits K+1 tokens, except the last one cut by max_tokens.
            assert all(n == K + 1 for n in b.step_tokens[:-1]), b.step_tokens
            assert b.acceptance_per_position(K)[:1] == ([1.0] if len(b.step_tokens) > 1 else b.acceptance_per_position(K)[:1])


def test_seeded_spec_request_alone_or_batched(target, random_drafter):
    def run(reqs):
        return Engine(CFG, target, (), ECFG, drafter=random_drafter, draft_cfg=DCFG).generate(reqs)
    mk = lambda: Request([5, 6, 7, 8], temperature=0.9, top_k=50, top_p=0.95, seed=77, max_tokens=30)
    alone = run([mk()])[0].output_ids
    others = _requests([(9, 30), (20, 10), (4, 25)], temperature=1.0, seed0=99)
    mixed = run(others[:2] + [mk()] + others[2:])
    assert mixed[2].output_ids == alone and len(alone) == 30


def test_teacher_forced_logprobs_verify_equals_decode(target, random_drafter):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, CFG.vocab_size, 10).tolist()
    text = rng.integers(0, CFG.vocab_size, 4 * (K + 1)).tolist()
    stock = teacher_forced_logprobs(Engine(CFG, target, (), ECFG), prompt, text)
    spec = teacher_forced_logprobs(
        Engine(CFG, target, (), ECFG, drafter=random_drafter, draft_cfg=DCFG), prompt, text)
    assert stock.shape == spec.shape == (len(text),)
    assert np.abs(stock - spec).mean() <= 0.002 and np.abs(stock - spec).max() < 1e-3
    # And both are the dense forward's log-probabilities.
    from jspec.qwen3 import forward_logits
    logits, _ = forward_logits(target, jnp.asarray([prompt + text]))
    logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
    ref = [logp[len(prompt) - 1 + i, tok] for i, tok in enumerate(text)]
    np.testing.assert_allclose(stock, ref, atol=1e-4)


@pytest.mark.parametrize("rule", ["block", "token"])
def test_spec_sampled_law_end_to_end(rule):
    """Bigram target on 6 tokens, a drafter with q != p: the emitted pairs (t1, t2), where t2 is
    produced by a speculative iteration, must follow p(t1|x0) p(t2|t1), under either verify
    rule. Negative control: the same counts against the drafter's own law must be rejected."""
    t, d, law = bigram_pair(concentrate=6, drafter_noise=0.8)
    eng = Engine(CFG, t, (), EngineConfig(max_lanes=8, page_size=8, max_context=32, prefill_chunk=8,
                                          decode_steps=1, attn_impl="xla", verify_rule=rule),
                 drafter=d, draft_cfg=DCFG)
    reqs, counts = sampled_pairs(eng)
    p_value = chi2_pvalue(counts, pair_law(law, law))
    assert p_value > 1e-3, p_value
    # Negative control: the drafter's law q(t2|t1) is different, and the test must see it.
    q_rows = np.asarray(jax.nn.softmax(jnp.asarray(d.markov_w1[...]) @ jnp.asarray(d.markov_w2[...]).T, -1), np.float64)
    p_wrong = chi2_pvalue(counts, pair_law(law, q_rows / q_rows[:, :6].sum(1, keepdims=True)))
    assert p_wrong < 1e-6, p_wrong
    assert np.mean([np.mean(r.step_tokens) for r in reqs]) < K  # drafts were actually rejected


def test_spec_no_recompilation_after_warmup(target, random_drafter):
    eng = Engine(CFG, target, (), ECFG, drafter=random_drafter, draft_cfg=DCFG)
    eng.generate(_requests([(10, 6)]))
    counts = (compile_count(eng.programs.prefill), compile_count(eng.programs.decode))
    eng.generate(_requests([(3, 2), (40, 11), (17, 30), (1, 5), (25, 9)], temperature=0.7))
    eng.generate([Request([1, 2, 3], temperature=1.0, top_k=5, top_p=0.9, max_tokens=8)])
    assert (compile_count(eng.programs.prefill), compile_count(eng.programs.decode)) == counts


def test_spec_preemption_keeps_outputs(target, random_drafter):
    specs = [(40, 40), (30, 45), (35, 30), (20, 50)]
    small = Engine(CFG, target, (), EngineConfig(**{**ECFG.__dict__, "num_pages": 16}),
                   drafter=random_drafter, draft_cfg=DCFG)
    got = small.generate(_requests(specs, temperature=0.8))
    assert small.stats["preemptions"] > 0
    ref = Engine(CFG, target, (), ECFG, drafter=random_drafter, draft_cfg=DCFG).generate(
        _requests(specs, temperature=0.8))
    for a, b in zip(got, ref):
        assert a.output_ids == b.output_ids
    assert small.allocator.num_free == 15


def test_spec_carried_decode_state_equals_the_hosts(target, random_drafter):
    """The speculative engine carries its output state (lengths advanced by what each verify
    kept, EOS inside a block, budgets) the way the host counts it: same tokens as re-sending the
    state every dispatch, and the same state every dispatch, through preemptions."""
    specs = [(40, 40), (30, 45), (35, 30), (20, 50), (6, 4)]

    def run(carry, eos):
        eng = Engine(CFG, target, (eos,), EngineConfig(**{**ECFG.__dict__, "num_pages": 16}),
                     drafter=random_drafter, draft_cfg=DCFG)
        eng.carry_state, eng.check_carry = carry, carry
        return [(r.output_ids, r.finish_reason) for r in eng.generate(_requests(specs, temperature=0.8))], eng.stats

    probe, _ = run(False, CFG.vocab_size - 1)
    eos = probe[0][0][5]  # a token the first reply samples early: at least that lane stops on it
    sent, _ = run(False, eos)
    carried, stats = run(True, eos)
    assert carried == sent
    assert stats["state_carries"] > 3 and stats["preemptions"] > 0
    assert {f for _, f in carried} == {"eos", "length"}


def test_eos_inside_accepted_drafts_ends_the_request():
    t, d, _ = bigram_pair()
    (probe,) = Engine(CFG, t, (), ECFG, drafter=d, draft_cfg=DCFG).generate(_requests([(6, 30)]))
    eos = probe.output_ids[4]  # falls inside the first verify block's accepted drafts
    first = probe.output_ids.index(eos)
    (r,) = Engine(CFG, t, (eos,), ECFG, drafter=d, draft_cfg=DCFG).generate(_requests([(6, 30)]))
    assert r.finish_reason == "eos" and r.output_ids == probe.output_ids[:first + 1]


# ---- API and CLI with a draft model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair_dirs(tmp_path_factory):
    from hf_models import make_hf_qwen3, save_drafter_checkpoint, write_tiny_tokenizer
    from jspec.loading import load_model
    d = tmp_path_factory.mktemp("tiny-target")
    make_hf_qwen3(CFG, d, seed=5, std=0.3)
    write_tiny_tokenizer(d, CFG.vocab_size)
    _, target = load_model(d)
    dd = tmp_path_factory.mktemp("tiny-draft")
    save_drafter_checkpoint(_scaled(init_random_drafter(DCFG, seed=8), 5), DCFG, dd, target=target)
    return d, dd


def test_api_speculative_greedy_matches_stock_and_reports_stats(tiny_pair_dirs):
    from jspec.api import LLM, SamplingParams
    target_dir, draft_dir = tiny_pair_dirs
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["def add(a, b):", "The quick brown"]
    stock = LLM(target_dir, max_lanes=2, max_context=128, attn_impl="xla").generate(prompts, greedy)
    for k in (None, 3):
        llm = LLM(target_dir, draft=draft_dir, num_draft_tokens=k, max_lanes=2, max_context=128,
                  attn_impl="xla")
        spec = llm.generate(prompts, greedy)
        for a, b in zip(stock, spec):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert a.tokens_per_step is None and 1.0 <= b.tokens_per_step <= (k or K) + 1
            assert len(b.acceptance_per_position) == (k or K)


@pytest.mark.parametrize("k", [0, K + 1])
def test_num_draft_tokens_out_of_range(tiny_pair_dirs, k):
    from jspec.api import LLM
    target_dir, draft_dir = tiny_pair_dirs
    with pytest.raises(ValueError, match="num_draft_tokens"):
        LLM(target_dir, draft=draft_dir, num_draft_tokens=k, max_context=128, attn_impl="xla")


def test_cli_generate_with_draft_json(tiny_pair_dirs, capsys):
    import json
    from jspec.cli import main
    target_dir, draft_dir = tiny_pair_dirs
    args = ["generate", "--model", str(target_dir), "--draft", str(draft_dir), "--prompt", "def f(x):",
            "--max-tokens", "12", "--seed", "3", "--max-context", "128", "--attn-impl", "xla", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tokens_per_step"] >= 1.0 and len(record["acceptance_per_position"]) == K
    assert main(args[:3] + ["--draft", str(target_dir)] + args[5:]) == 2  # a target is no drafter
    assert "not a DSpark" in capsys.readouterr().err


@pytest.mark.parametrize("lanes", [3, 1])
def test_spec_lookahead_and_device_loop_change_when_not_what(target, random_drafter, lanes):
    """The speculative engine with look-ahead dispatches and the early-ending device loop gives
    the same tokens, finish reasons and tokens per verify step as with neither, with EOS inside
    a dispatch (test_engine.py has the stock twin)."""
    specs = [(40, 40), (9, 45), (35, 30)]

    def run(lookahead, device_loop, eos):
        eng = Engine(CFG, target, (eos,), EngineConfig(**{
            **ECFG.__dict__, "max_lanes": lanes, "lookahead": lookahead,
            "device_loop": device_loop}), drafter=random_drafter, draft_cfg=DCFG)
        eng.check_carry = True
        reqs = eng.generate(_requests(specs, temperature=0.8))
        return [(r.output_ids, r.finish_reason, r.step_tokens) for r in reqs], eng.stats

    probe, _ = run(False, False, CFG.vocab_size - 1)
    eos = probe[0][0][5]  # a token the first reply samples early: at least that lane stops on it
    ref, ref_stats = run(False, False, eos)
    got, stats = run(True, True, eos)
    assert got == ref
    assert {f for _, f, _ in ref} == {"eos", "length"}
    assert ref_stats["lookahead_dispatches"] == 0 < stats["lookahead_dispatches"]


@pytest.mark.parametrize("lanes", [3, 2])
def test_spec_lookahead_admission_changes_when_not_what(target, random_drafter, lanes):
    """The speculative engine with lookahead_admission (requests seated while a look-ahead
    dispatch runs, their first tokens merged into the carried state on the device) gives the same
    tokens, finish reasons and tokens per verify step as the engine that reads every dispatch
    first: six requests for two or three lanes, EOS inside a dispatch and as a first token."""
    specs = [(40, 40), (9, 45), (35, 30), (12, 20), (20, 35), (7, 25)]

    def run(eos, **kw):
        eng = Engine(CFG, target, eos, EngineConfig(**{
            **ECFG.__dict__, "max_lanes": lanes, **kw}), drafter=random_drafter, draft_cfg=DCFG)
        eng.check_carry = True
        reqs = eng.generate(_requests(specs, temperature=0.8))
        return [(r.output_ids, r.finish_reason, r.step_tokens) for r in reqs], eng.stats

    probe, _ = run((CFG.vocab_size - 1,), max_lanes=1)
    eos = (probe[0][0][5], probe[4][0][0])  # mid-reply for request 0, the first token of 4
    ref, _ = run(eos, lookahead=False, device_loop=False)
    assert {f for _, f, _ in ref} == {"eos", "length"} and ref[4][:2] == ([eos[1]], "eos")
    got, stats = run(eos, lookahead=True, lookahead_admission=True)
    assert got == ref
    assert stats["admissions_ahead"] > 0 and stats["state_merges"] > 0


def test_api_lookahead_admission_gives_the_same_replies(tiny_pair_dirs):
    """LLM(lookahead_admission=True): five seeded prompts through two speculative lanes give the
    replies of the default engine."""
    from jspec.api import LLM, SamplingParams
    target_dir, draft_dir = tiny_pair_dirs
    prompts = ["def f(x):", "class A:", "import os", "x = [", "for i in"]
    params = [SamplingParams(temperature=1.0, max_tokens=10 + 3 * i, seed=i, ignore_eos=True)
              for i in range(len(prompts))]

    def replies(**kw):
        llm = LLM(target_dir, draft=draft_dir, max_lanes=2, max_context=128, attn_impl="xla", **kw)
        return [r.token_ids for r in llm.generate(prompts, params)], llm.engine.stats

    ref, _ = replies()
    got, stats = replies(lookahead_admission=True)
    assert got == ref and stats["admissions_ahead"] > 0


def test_verify_rule_is_checked():
    with pytest.raises(ValueError, match="verify_rule must be one of"):
        EngineConfig(verify_rule="blockwise")
