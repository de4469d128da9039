"""Block verification (rejection.py, rule="block"): the law checked exactly, by enumeration.

A vocabulary of 3, at most K = 3 drafts a round, 4 generated tokens. The target's and the
drafter's laws depend on the whole prefix (random tables, some entries 0). For each context the
round enumerates every draft block with its q-probability, takes h and w from
`block_acceptance`, the chance of each accept length a (h_a times the chance that no longer
prefix stopped) and the replacement law from `residual_logprobs`, and recurses until 4 tokens
exist. The law of those 4 tokens must be the target's to fp32 accuracy; the same enumeration
with a broken rule (h_i = w_i at every i, the token rule's weights without the residual mass)
must not be. The number of drafts may be a stopping time of the drafts, as under the
confidence gate.
"""

import itertools

import jax
import numpy as np
import pytest
from stats_helpers import random_round

from jspec import rejection

VOCAB, K, LENGTH = 3, 3, 4


class Tables:
    """Random prefix-dependent laws p(. | prefix) and q(. | prefix)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.p, self.q = {}, {}

    def _law(self, table, prefix):
        if prefix not in table:
            x = self.rng.gamma(0.6, size=VOCAB)
            if self.rng.random() < 0.3:
                x[self.rng.integers(VOCAB)] = 0.0
            table[prefix] = x / x.sum()
        return table[prefix]

    def target(self, prefix):
        return self._law(self.p, prefix)

    def drafter(self, prefix):
        return self._law(self.q, prefix)


def log(x):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(x, np.float64)).astype(np.float32)


@jax.jit
def _round_numbers(target_lp, draft_lp, drafts, num_draft):
    stop, log_w = rejection.block_acceptance(target_lp, draft_lp, drafts, num_draft)
    # residual law at every accept length a < K: max(w_a p_a - q_{a+1}, 0) normalised
    res = [rejection.residual_logprobs(target_lp[:, a], draft_lp[:, a], log_w[:, a])
           for a in range(K)]
    return stop, log_w, jax.numpy.stack(res, 1)


def fixed_k(block):
    return K


def stop_after_a_two(block):
    """A stopping time: after drafting x_k, go on only if x_k != 2."""
    for k, x in enumerate(block, 1):
        if x == 2:
            return k
    return K


def round_law(tables, ctx, num_draft_of, broken=False):
    """{emitted tuple: probability} of one round from context ctx, and its mean accept length."""
    blocks = list(itertools.product(range(VOCAB), repeat=K))
    target_lp = np.stack([[log(tables.target(ctx + b[:i])) for i in range(K + 1)] for b in blocks])
    draft_lp = np.stack([[log(tables.drafter(ctx + b[:i])) for i in range(K)] for b in blocks])
    num_draft = np.array([num_draft_of(b) for b in blocks], np.int32)
    stop, log_w, residual = (np.asarray(x, np.float64) for x in _round_numbers(
        target_lp, draft_lp, np.array(blocks, np.int32), num_draft))
    if broken:
        stop = np.where(np.arange(1, K + 1)[None] <= num_draft[:, None], np.exp(log_w[:, 1:]), 0)
    law, mean_accepted = {}, 0.0
    for j, block in enumerate(blocks):
        weight = np.prod([tables.drafter(ctx + block[:i])[block[i]] for i in range(K)])
        if weight == 0:
            continue
        n = num_draft[j]
        for a in range(n + 1):
            chance = (stop[j, a - 1] if a else 1.0) * np.prod(1 - stop[j, a:n])
            if chance <= 0:
                continue
            mean_accepted += weight * chance * a
            nxt = tables.target(ctx + block[:n]) if a == n else np.exp(residual[j, a])
            for y in range(VOCAB):
                if nxt[y] > 0:
                    key = block[:a] + (y,)
                    law[key] = law.get(key, 0.0) + weight * chance * nxt[y]
    return law, mean_accepted


def generated_law(tables, num_draft_of, broken=False):
    out = {}

    def extend(ctx, prob):
        if len(ctx) >= LENGTH:
            out[ctx[:LENGTH]] = out.get(ctx[:LENGTH], 0.0) + prob
            return
        for emitted, chance in round_law(tables, ctx, num_draft_of, broken)[0].items():
            extend(ctx + emitted, prob * chance)

    extend((), 1.0)
    return out


def target_law(tables):
    law = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        law[seq] = np.prod([tables.target(seq[:i])[seq[i]] for i in range(LENGTH)])
    return law


def max_gap(law, want):
    return max(abs(law.get(seq, 0.0) - prob) for seq, prob in want.items())


@pytest.mark.parametrize("num_draft_of", [fixed_k, stop_after_a_two])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_rule_emits_the_target_law_exactly(seed, num_draft_of):
    tables = Tables(seed)
    assert max_gap(generated_law(tables, num_draft_of), target_law(tables)) < 2e-5


def test_the_broken_rule_does_not():
    tables = Tables(0)
    assert max_gap(generated_law(tables, fixed_k, broken=True), target_law(tables)) > 1e-2


def token_rule_mean_accepted(tables, ctx):
    """Expected accepted drafts of the token rule at K drafts: sum_k prod_{i<=k} min(1, p/q)."""
    mean = 0.0
    for block in itertools.product(range(VOCAB), repeat=K):
        weight = np.prod([tables.drafter(ctx + block[:i])[block[i]] for i in range(K)])
        if weight == 0:
            continue
        survive = 1.0
        for i in range(K):
            p = tables.target(ctx + block[:i])[block[i]]
            survive *= min(1.0, p / tables.drafter(ctx + block[:i])[block[i]])
            mean += weight * survive
    return mean


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_block_rule_accepts_at_least_as_much_as_the_token_rule(seed):
    tables = Tables(seed)
    gains = []
    for ctx in [(), (0,), (1, 2)]:
        block = round_law(tables, ctx, fixed_k)[1]
        token = token_rule_mean_accepted(tables, ctx)
        assert block >= token - 1e-5, (ctx, block, token)
        gains.append(block - token)
    assert max(gains) > 1e-3  # and strictly more somewhere


def test_the_papers_two_token_example():
    """Sun et al.'s example: p = (1/3, 2/3), q = (2/3, 1/3), two drafts: 10/9 accepted drafts a
    round token by token, 11/9 by block verification."""
    p, q = np.log([1 / 3, 2 / 3]), np.log([2 / 3, 1 / 3])
    blocks = np.array(list(itertools.product(range(2), repeat=2)), np.int32)
    stop, _ = rejection.block_acceptance(np.broadcast_to(p, (4, 3, 2)).astype(np.float32),
                                         np.broadcast_to(q, (4, 2, 2)).astype(np.float32),
                                         blocks, np.full(4, 2, np.int32))
    stop = np.asarray(stop, np.float64)
    weight = np.exp(q)[blocks].prod(1)
    mean = sum(w * (2 * s[1] + 1 * s[0] * (1 - s[1])) for w, s in zip(weight, stop))
    np.testing.assert_allclose(mean, 11 / 9, rtol=1e-5)


def test_core_block_rule_with_fixed_randomness_matches_a_reference():
    """rejection_sample_core(rule='block') against a float64 transcription of the rule."""
    rng = np.random.default_rng(5)
    lanes, k, vocab = 64, 5, 6
    p, q, drafts, num_draft = random_round(rng, lanes, k, vocab, 0.7)
    uniforms = rng.random((lanes, k)).astype(np.float32)
    gumbel = rng.gumbel(size=(lanes, vocab)).astype(np.float32)
    out = rejection.rejection_sample_core(log(p), log(q), drafts, num_draft,
                                          np.zeros(lanes, bool), uniforms, gumbel, rule="block")
    tokens, emitted = np.asarray(out.tokens), np.asarray(out.num_emitted)
    for b in range(lanes):
        n, w, h = num_draft[b], [1.0], []
        for i in range(1, n + 1):
            x = drafts[b, i - 1]
            w.append(min(w[-1] * p[b, i - 1, x] / q[b, i - 1, x], 1.0))
            if i < n:
                m = np.maximum(w[i] * p[b, i] - q[b, i], 0).sum()
                h.append(m / (m + 1 - w[i]) if m + 1 - w[i] > 0 else 0.0)
            else:
                h.append(w[i])
        a = max([i for i in range(1, n + 1) if uniforms[b, i - 1] < h[i - 1]], default=0)
        law = p[b, n] if a == n else np.maximum(w[a] * p[b, a] - q[b, a], 0)
        with np.errstate(divide="ignore"):
            y = int(np.argmax(np.log(law) + gumbel[b]))
        assert emitted[b] == a + 1, b
        assert tokens[b, :a + 1].tolist() == drafts[b, :a].tolist() + [y], b


def test_rules_are_named():
    with pytest.raises(ValueError, match="verify rule"):
        rejection.rejection_sample_core(np.zeros((1, 2, 3), np.float32),
                                        np.zeros((1, 1, 3), np.float32), np.zeros((1, 1), np.int32),
                                        np.ones(1, np.int32), np.zeros(1, bool),
                                        np.zeros((1, 1), np.float32), np.zeros((1, 3), np.float32),
                                        rule="blocks")
