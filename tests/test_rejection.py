"""Rejection sampler: exact rule with fixed randomness, and the lossless law (CPU).

The statistical tests simulate whole generations: rounds of "draft K=7 tokens from q, verify
against p, emit a+1 tokens" until 8 tokens exist, for tens of thousands of seeded requests in
one jitted batch. To make the analytic law easy, the target logits (and the drafter's) depend
only on the absolute position, not on the drafted prefix: then a lossless sampler emits, at
every position t, a token with law p_t (processed with the lane's temperature / top-k /
top-p), independently across positions. Two broken samplers (accept-all; residual drawn from p
instead of max(p - q, 0)) must fail the very same checks.
"""

import dataclasses

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import rejection, sampling
from jspec.rejection import rejection_sample, rejection_sample_core
from jspec.sampling import SamplingArrays
from stats_helpers import chi2_pvalue

ALPHA = 1e-5  # per-check significance; seeds are fixed, so every verdict is deterministic
NEG = -np.inf


def log(probs):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probs, np.float64)).astype(np.float32)


def core(p_rows, q_rows, drafts, num_draft, uniforms, gumbel, greedy=False):
    """rejection_sample_core on one lane given as probability tables."""
    out = rejection_sample_core(
        jnp.asarray(log(p_rows))[None], jnp.asarray(log(q_rows))[None],
        jnp.asarray(drafts, jnp.int32)[None], jnp.asarray([num_draft], jnp.int32),
        jnp.asarray([greedy]), jnp.asarray(uniforms, jnp.float32)[None],
        jnp.asarray(gumbel, jnp.float32)[None])
    return (np.asarray(out.tokens[0]).tolist(), int(out.num_emitted[0]),
            np.asarray(out.logprobs[0]))


# Hand-made round, V = 4, K = 4. Ratios p_{k-1}(x_k) / q_k(x_k): 0.75, 0.5, 0.25, 2.
P_ROWS = [[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4],
          [0.1, 0.1, 0.1, 0.7], [0.4, 0.3, 0.2, 0.1]]
Q_ROWS = [[0.1, 0.8, 0.05, 0.05], [0.5, 0.2, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1],
          [0.25, 0.25, 0.15, 0.35]]
DRAFTS = [1, 0, 0, 3]


# ---------------------------------------------------------------------------- exact rule


def test_all_accepted_emits_the_drafts_and_a_bonus_from_the_last_row():
    tokens, n, logprobs = core(P_ROWS, Q_ROWS, DRAFTS, 4, [0.7, 0.49, 0.2, 0.99],
                               [0.0, 30.0, 0.0, 0.0])
    assert (tokens, n) == ([1, 0, 0, 3, 1], 5)
    np.testing.assert_allclose(logprobs, np.log([0.6, 0.25, 0.1, 0.7, 0.3]), rtol=1e-6)


def test_rejection_at_k_emits_the_prefix_and_a_residual_token():
    # x_3 has ratio 0.25 and u_3 = 0.5: rejected. r = max(p_2 - q_3, 0) = (0, 0, .1, .3) / .4;
    # the Gumbel noise on tokens 0 and 1 is huge, but they are outside r's support.
    tokens, n, logprobs = core(P_ROWS, Q_ROWS, DRAFTS, 4, [0.7, 0.49, 0.5, 0.0],
                               [50.0, 50.0, 3.0, 0.0])  # log .25 + 3 > log .75
    assert (tokens, n) == ([1, 0, 2, -1, -1], 3)
    np.testing.assert_allclose(logprobs, [np.log(0.6), np.log(0.25), np.log(0.3), 0, 0],
                               rtol=1e-6)
    tokens, n, _ = core(P_ROWS, Q_ROWS, DRAFTS, 4, [0.7, 0.49, 0.5, 0.0], [50.0, 50.0, 0.0, 1.0])
    assert (tokens, n) == ([1, 0, 3, -1, -1], 3)
    # u just above the ratio 0.5 of x_2: rejected there; r = (0, .05, .05, .15) / .25.
    tokens, n, _ = core(P_ROWS, Q_ROWS, DRAFTS, 4, [0.7, 0.51, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0])
    assert (tokens, n) == ([1, 3, -1, -1, -1], 2)
    # Rejection of x_1 (u_1 = 0.76 > 0.75): one token, from max(p_0 - q_1, 0) = (0, 0, .15, .05).
    tokens, n, _ = core(P_ROWS, Q_ROWS, DRAFTS, 4, [0.76, 0.0, 0.0, 0.0], [9.0, 9.0, 0.0, 0.5])
    assert (tokens, n) == ([2, -1, -1, -1, -1], 1)


def test_a_draft_the_target_filtered_out_is_never_accepted():
    p_rows = [[0.0, 0.5, 0.5, 0.0]] + P_ROWS[1:]  # p_0(x_1 = 3) = 0, as after top-k
    tokens, n, _ = core(p_rows, Q_ROWS, [3, 0, 0, 3], 4, [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])
    assert n == 1 and tokens[0] in (1, 2)
    # u = 0 accepts any draft with p > 0, even when q >> p
    tokens, n, _ = core(P_ROWS, Q_ROWS, [1, 0, 0, 0], 4, [0.0] * 4, [0.0] * 4)
    assert n == 5 and tokens[:4] == [1, 0, 0, 0]


def test_fewer_drafts_than_k_take_the_bonus_from_row_num_draft():
    p_rows = [P_ROWS[0], P_ROWS[1], [0.0, 0.0, 1.0, 0.0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]]
    garbage = [1, 0, -1, 999]  # entries past num_draft are never read
    tokens, n, logprobs = core(p_rows, Q_ROWS, garbage, 2, [0.0] * 4, [0.0, 5.0, 0.0, 9.0])
    assert (tokens, n) == ([1, 0, 2, -1, -1], 3)
    np.testing.assert_allclose(logprobs[:3], np.log([0.6, 0.25, 1.0]), rtol=1e-6)
    # num_draft = 0: a plain sample from p_0
    tokens, n, _ = core(P_ROWS, Q_ROWS, garbage, 0, [0.0] * 4, [0.0, 0.0, 5.0, 0.0])
    assert (tokens, n) == ([2, -1, -1, -1, -1], 1)


def test_residual_distribution_exact():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(16), size=6)
    q = rng.dirichlet(np.ones(16), size=6)
    p[0, :5] = 0.0  # filtered target entries stay filtered
    p[0] /= p[0].sum()
    got = np.exp(np.asarray(rejection.residual_logprobs(log(p), log(q)), np.float64))
    want = np.maximum(p - q, 0)
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert np.all(got[0, :5] == 0)
    # p == q: no residual mass, fall back to p
    same = np.asarray(rejection.residual_logprobs(log(p), log(p)))
    np.testing.assert_allclose(np.exp(same), p, rtol=1e-6, atol=1e-7)


def test_greedy_lanes_follow_the_target_argmax_whatever_q_and_u():
    # argmax p rows: 1, 0, 3, 3, 0. x_3 = 0 is wrong: emit x_1, x_2, then argmax p_2 = 3.
    uniform_q = [[0.25] * 4] * 4
    for u in ([0.0] * 4, [0.99] * 4):
        tokens, n, _ = core(P_ROWS, uniform_q, [1, 0, 0, 3], 4, u, [9.0, 9.0, 9.0, 0.0], True)
        assert (tokens, n) == ([1, 0, 3, -1, -1], 3)
        tokens, n, _ = core(P_ROWS, uniform_q, [1, 0, 3, 3], 4, u, [0.0, 9.0, 9.0, 9.0], True)
        assert (tokens, n) == ([1, 0, 3, 3, 0], 5)


def test_wrapper_matches_core_and_a_request_is_independent_of_its_batch():
    rng = np.random.default_rng(1)
    lanes, k, vocab = 5, 4, 24
    arrays = SamplingArrays.from_lists([1.0, 0.6, 0.0, 0.8, 1.2], [0, 6, 0, 10, 3],
                                       [1.0, 0.9, 1.0, 0.7, 1.0], [5, 6, 7, 8, 9])
    target_logits = rng.normal(size=(lanes, k + 1, vocab)).astype(np.float32) * 2
    draft_lp = sampling.process(target_logits[:, :k] + rng.normal(size=(lanes, k, vocab)),
                                arrays)
    drafts = np.asarray(jnp.argmax(draft_lp, -1), np.int32)  # any tokens in q's support
    num_draft = np.array([4, 2, 4, 3, 0], np.int32)
    positions = np.array([10, 20, 30, 40, 50], np.int32)
    out = rejection_sample(target_logits, draft_lp, drafts, num_draft, arrays, positions)
    n = np.asarray(out.num_emitted)
    assert np.all((1 <= n) & (n <= num_draft + 1))
    # Each lane again, alone among greedy padding lanes (same shapes: no recompile).
    padding = dataclasses.replace(SamplingArrays.padding(lanes), filter_paths=arrays.filter_paths)
    for lane in range(lanes):
        put = lambda pad, mine: np.concatenate(
            [np.asarray(pad)[:lane], np.asarray(mine)[lane:lane + 1],
             np.asarray(pad)[lane + 1:]])
        alone_arrays = jax.tree.map(put, padding, arrays)
        alone = rejection_sample(put(np.zeros_like(target_logits), target_logits),
                                 put(np.zeros_like(draft_lp), draft_lp), put(drafts * 0, drafts),
                                 put(num_draft * 0, num_draft), alone_arrays,
                                 put(positions * 0, positions))
        np.testing.assert_array_equal(alone.tokens[lane], out.tokens[lane])
        np.testing.assert_array_equal(alone.num_emitted[lane], out.num_emitted[lane])
        # XLA may fuse differently per batch: log-probs agree to an ulp, not bit-for-bit
        np.testing.assert_allclose(alone.logprobs[lane], out.logprobs[lane], rtol=1e-6)
    # the emitted log-probs are the processed target's
    target_lp = np.asarray(sampling.process(target_logits, arrays))
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    for lane in range(lanes):
        for i in range(n[lane]):
            np.testing.assert_allclose(logprobs[lane, i], target_lp[lane, i, tokens[lane, i]],
                                       rtol=1e-6)
    # K = 0 degenerates to one plain draw from p_0
    plain = rejection_sample(target_logits[:, :1], draft_lp[:, :0], drafts[:, :0], num_draft,
                             arrays, positions)
    assert np.all(np.asarray(plain.num_emitted) == 1)


# ---------------------------------------------------------------------------- the law


VOCAB, K, LENGTH = 12, 7, 8  # LENGTH tokens generated per request, in rounds of <= K+1
SEQ = LENGTH + K + 1
_rng = np.random.default_rng(2024)
P_LOGITS = (_rng.normal(size=(LENGTH + 2 * K + 1, VOCAB)) * 1.5).astype(np.float32)  # by pos
Q_LOGITS = (P_LOGITS + _rng.normal(size=P_LOGITS.shape) * 0.9).astype(np.float32)
CONFIGS = [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.0, 0, 0.8), (0.6, 7, 0.9), (1.0, 6, 0.85)]
LANES_PER_CONFIG = 12_000
CONTROL_LANES_PER_CONFIG = 6_000  # the broken samplers fail by orders of magnitude
GREEDY_LANES = 64
NUM_DRAFT_PURPOSE = 99  # the simulated scheduler's own key, independent of the drafts


def accept_all(target_logits, draft_lp, draft_tokens, num_draft, arrays, positions):
    """Broken control: emit every proposed draft, then a bonus from p_{num_draft}."""
    target_lp = sampling.process(target_logits, arrays)
    keys = sampling.token_keys(arrays.seed, positions + num_draft, sampling.PURPOSE_RESIDUAL)
    bonus = sampling.sample_from_logprobs(
        jnp.take_along_axis(target_lp, num_draft[:, None, None], 1)[:, 0], keys)
    slots = jnp.arange(K + 1)[None]
    drafts = jnp.concatenate([draft_tokens, draft_tokens[:, :1]], 1)
    tokens = jnp.where(slots < num_draft[:, None], drafts, bonus[:, None])
    return tokens, num_draft + 1


def residual_from_p(target_logits, draft_lp, draft_tokens, num_draft, arrays, positions):
    """Broken control: the right accept test, but the replacement is drawn from p_a."""
    target_lp = sampling.process(target_logits, arrays)
    keys = sampling.token_keys(arrays.seed, positions[:, None] + jnp.arange(K)[None],
                               sampling.PURPOSE_ACCEPT)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key))(keys.reshape(-1)).reshape(keys.shape)
    _, accepted = rejection.accept_drafts(target_lp, draft_lp, draft_tokens, num_draft,
                                          arrays.greedy, uniforms)
    keys = sampling.token_keys(arrays.seed, positions + accepted, sampling.PURPOSE_RESIDUAL)
    new = sampling.sample_from_logprobs(
        jnp.take_along_axis(target_lp, accepted[:, None, None], 1)[:, 0], keys)
    slots = jnp.arange(K + 1)[None]
    drafts = jnp.concatenate([draft_tokens, draft_tokens[:, :1]], 1)
    return jnp.where(slots < accepted[:, None], drafts, new[:, None]), accepted + 1


def lossless(target_logits, draft_lp, draft_tokens, num_draft, arrays, positions):
    out = rejection_sample(target_logits, draft_lp, draft_tokens, num_draft, arrays, positions)
    return out.tokens, out.num_emitted


def lossless_block(target_logits, draft_lp, draft_tokens, num_draft, arrays, positions):
    out = rejection_sample(target_logits, draft_lp, draft_tokens, num_draft, arrays, positions,
                           rule="block")
    return out.tokens, out.num_emitted


@functools.partial(jax.jit, static_argnames=("verify", "fresh_drafts"))
def generate(arrays, verify, fresh_drafts=False):
    """LENGTH tokens per lane in speculative rounds. Returns (seq [B, LENGTH], first-round
    tokens [B, K+1], first-round num_emitted [B]); the first round always drafts K tokens.
    fresh_drafts: the drafts' keys fold in the round's start (what the block rule needs)."""
    p_logits, q_logits = jnp.asarray(P_LOGITS), jnp.asarray(Q_LOGITS)
    lanes = arrays.temperature.shape[0]

    def one_round(r, carry):
        start, seq, first_tokens, first_n = carry  # start: position of the next token

        def draft_step(_, k):  # x_{k+1} ~ q at position start + k, by the real drafter sampler
            return None, sampling.draft_sample(q_logits[start + k], arrays, start + k,
                                               start if fresh_drafts else None)

        _, (drafts, draft_lp) = jax.lax.scan(draft_step, None, jnp.arange(K))
        drafts, draft_lp = drafts.T, jnp.swapaxes(draft_lp, 0, 1)  # [B, K], [B, K, V]
        target_logits = p_logits[start[:, None] + jnp.arange(K + 1)[None]]  # p_{start + i}
        scheduler_keys = sampling.token_keys(arrays.seed, start, NUM_DRAFT_PURPOSE)
        random_num_draft = jax.vmap(lambda key: jax.random.randint(key, (), 0, K + 1))(
            scheduler_keys)
        num_draft = jnp.where(r == 0, K, random_num_draft)
        tokens, n = verify(target_logits, draft_lp, drafts, num_draft, arrays, start)
        n = jnp.where(start < LENGTH, n, 0)  # finished lanes idle
        offset = jnp.arange(SEQ)[None] - start[:, None]
        written = (offset >= 0) & (offset < n[:, None])
        seq = jnp.where(written, jnp.take_along_axis(tokens, jnp.clip(offset, 0, K), 1), seq)
        first_tokens = jnp.where(r == 0, tokens, first_tokens)
        first_n = jnp.where(r == 0, n, first_n)
        return start + n, seq, first_tokens, first_n

    init = (jnp.zeros(lanes, jnp.int32), jnp.full((lanes, SEQ), -2, jnp.int32),
            jnp.zeros((lanes, K + 1), jnp.int32), jnp.zeros(lanes, jnp.int32))
    _, seq, first_tokens, first_n = jax.lax.fori_loop(0, LENGTH, one_round, init)
    return seq[:, :LENGTH], first_tokens, first_n


def population(configs, lanes_per_config, greedy_lanes=0):
    temperature, top_k, top_p = [], [], []
    for t, k, p in configs:
        temperature += [t] * lanes_per_config
        top_k += [k] * lanes_per_config
        top_p += [p] * lanes_per_config
    temperature += [0.0] * greedy_lanes
    top_k += [0] * greedy_lanes
    top_p += [1.0] * greedy_lanes
    seeds = list(range(1000, 1000 + len(temperature)))
    return SamplingArrays.from_lists(temperature, top_k, top_p, seeds)


def target_law(temperature, top_k, top_p):
    """[LENGTH + K, V] processed target probabilities, by absolute position."""
    rows = P_LOGITS.shape[0]
    lp = sampling.processed_logprobs(
        P_LOGITS, np.full(rows, temperature, np.float32), np.full(rows, top_k, np.int32),
        np.full(rows, top_p, np.float32), np.zeros(rows, bool))
    return np.exp(np.asarray(lp, np.float64))


def law_failures(configs, lanes_per_config, seq, first_tokens, first_n):
    """Every check of the lossless law; returns the failed ones (p-value < ALPHA)."""
    failures = []
    for c, config in enumerate(configs):
        law = target_law(*config)
        lanes = slice(c * lanes_per_config, (c + 1) * lanes_per_config)
        s, ft, fn = seq[lanes], first_tokens[lanes], first_n[lanes]
        checks = []
        for t in range(LENGTH):  # marginal of the generated token at every position
            checks.append((f"position {t}", np.bincount(s[:, t], minlength=VOCAB), law[t]))
        joint = np.bincount(s[:, 0] * VOCAB + s[:, 1], minlength=VOCAB * VOCAB)
        checks.append(("joint of positions 0, 1", joint, np.outer(law[0], law[1])))
        for i in range(K + 1):  # one round, output slot i given that the round reached it
            reached = fn > i
            counts = np.bincount(ft[reached, i], minlength=VOCAB)
            checks.append((f"first round slot {i} (n={reached.sum()})", counts, law[i]))
        for name, counts, probs in checks:
            p_value = chi2_pvalue(counts, probs)
            if p_value < ALPHA:
                failures.append((config, name, p_value))
    return failures


@pytest.fixture(scope="module")
def lossless_run():
    arrays = population(CONFIGS, LANES_PER_CONFIG, GREEDY_LANES)
    return [np.asarray(x) for x in generate(arrays, lossless)]


def test_every_position_and_the_joint_follow_the_target_law(lossless_run):
    seq, first_tokens, first_n = lossless_run
    assert np.all((seq >= 0) & (seq < VOCAB))
    reached_last_slot = (first_n[:len(CONFIGS) * LANES_PER_CONFIG] > K).mean()
    assert reached_last_slot > 0.02  # enough acceptance for slot K to be tested
    assert law_failures(CONFIGS, LANES_PER_CONFIG, seq, first_tokens, first_n) == []


def test_greedy_lanes_emit_the_argmax_chain(lossless_run):
    seq, first_tokens, first_n = lossless_run
    greedy = slice(len(CONFIGS) * LANES_PER_CONFIG, None)
    chain = P_LOGITS.argmax(-1)
    np.testing.assert_array_equal(seq[greedy], np.broadcast_to(chain[:LENGTH], (GREEDY_LANES,
                                                                                 LENGTH)))
    for tokens, n in zip(first_tokens[greedy], first_n[greedy]):
        np.testing.assert_array_equal(tokens[:n], chain[:n])
    assert np.any(first_n[greedy] <= K)  # the drafter (argmax q) was wrong somewhere


@pytest.mark.parametrize("broken", [accept_all, residual_from_p])
def test_broken_samplers_fail_the_same_checks(broken):
    configs = [CONFIGS[0], CONFIGS[3]]  # T = 1.0 plain, T = 0.6 with top-k and top-p
    arrays = population(configs, CONTROL_LANES_PER_CONFIG)
    seq, first_tokens, first_n = (np.asarray(x) for x in generate(arrays, broken))
    failures = law_failures(configs, CONTROL_LANES_PER_CONFIG, seq, first_tokens, first_n)
    failed_configs = {config for config, _, _ in failures}
    assert failed_configs == set(configs), failures


# ---------------------------------------------------------------------------- the block rule


@pytest.fixture(scope="module")
def block_run():
    arrays = population(CONFIGS, LANES_PER_CONFIG, GREEDY_LANES)
    return [np.asarray(x) for x in generate(arrays, lossless_block, fresh_drafts=True)]


def test_block_rule_follows_the_target_law_and_accepts_more(block_run, lossless_run):
    seq, first_tokens, first_n = block_run
    assert np.all((seq >= 0) & (seq < VOCAB))
    assert law_failures(CONFIGS, LANES_PER_CONFIG, seq, first_tokens, first_n) == []
    # The first round always drafts K: its mean accept length is never below the token rule's.
    sampled = slice(0, len(CONFIGS) * LANES_PER_CONFIG)
    block_mean, token_mean = first_n[sampled].mean(), lossless_run[2][sampled].mean()
    standard_error = np.sqrt(first_n[sampled].var() / first_n[sampled].size)
    assert block_mean > token_mean + 3 * standard_error, (block_mean, token_mean)


def test_block_rule_greedy_lanes_emit_the_argmax_chain(block_run):
    seq, _, _ = block_run
    greedy = slice(len(CONFIGS) * LANES_PER_CONFIG, None)
    np.testing.assert_array_equal(seq[greedy], np.broadcast_to(P_LOGITS.argmax(-1)[:LENGTH],
                                                               (GREEDY_LANES, LENGTH)))


def test_block_rule_with_drafts_reused_across_rounds_fails_the_same_checks():
    """Negative control: the block rule with per-position draft keys (what the token rule may
    use): a round's accept length depends on drafts it does not emit, which the next round
    draws again with the same keys, so the law breaks."""
    configs = [CONFIGS[0], CONFIGS[3]]
    arrays = population(configs, CONTROL_LANES_PER_CONFIG)
    seq, first_tokens, first_n = (np.asarray(x) for x in generate(arrays, lossless_block,
                                                                  fresh_drafts=False))
    failures = law_failures(configs, CONTROL_LANES_PER_CONFIG, seq, first_tokens, first_n)
    assert failures, "stale draft keys went unnoticed"
