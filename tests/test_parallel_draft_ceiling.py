"""scripts/parallel_draft_ceiling.py's estimator against an exact value: on a Markov-chain target
the ideal parallel drafter's expected accepted run has a closed form (a small dynamic program),
and the Monte Carlo estimate must land on it; a target that is not the one sampled must not."""

import numpy as np
import pytest

from script_loader import load_script


V, K, START = 5, 4, 2
P = np.random.default_rng(3).dirichlet(np.full(V, 0.4), size=V)  # P[a, b] = p(next b | last a)


def exact_tau(P, start, K):
    """1 + sum_k E[prod_{j<=k} min(1, P[y_{j-1}, y_j] / q_j(y_j))], y_j ~ q_j = e_start P^j."""
    q = np.eye(V)[start]
    f = None
    total = 1.0
    for k in range(K):
        q = q @ P
        if k == 0:
            f = np.minimum(q, P[start])
        else:
            f = np.array([sum(f[u] * min(q[v], P[u, v]) for u in range(V)) for v in range(V)])
        total += f.sum()
    return total


def chain_laws(P, start):
    def laws_along(paths):
        prev = np.concatenate([np.full((len(paths), 1), start), paths[:, :-1]], 1)
        return P[prev]  # [M, K, V]
    return laws_along


def sample_chain(P, start, M, rng):
    x = np.zeros((M, K), np.int64)
    prev = np.full(M, start)
    for k in range(K):
        u = rng.random(M)[:, None]
        x[:, k] = (u > np.cumsum(P[prev], axis=1)).sum(1).clip(max=V - 1)
        prev = x[:, k]
    return x


def test_estimate_matches_the_exact_ceiling_and_a_wrong_target_does_not():
    mod = load_script("parallel_draft_ceiling")
    rng = np.random.default_rng(0)
    M = 20000
    exact = exact_tau(P, START, K)
    assert 1.5 < exact < K + 0.5  # the chain's law depends on the prefix: not a trivial K + 1
    x = sample_chain(P, START, M, rng)
    laws = chain_laws(P, START)
    survive = mod.ideal_parallel_survival(laws(x), laws, rng)
    assert survive.shape == (M, K) and np.allclose(survive[:, 0], 1.0, atol=0.03)
    estimate = 1.0 + survive.sum(1).mean()
    se = survive.sum(1).std() / np.sqrt(M)
    assert abs(estimate - exact) < 4 * se + 0.02, (estimate, exact, se)
    # Negative control: verify against another chain than the one the drafts came from.
    wrong = chain_laws(P[:, ::-1], START)
    off = 1.0 + mod.ideal_parallel_survival(laws(x), wrong, rng).sum(1).mean()
    assert abs(off - exact) > 10 * se + 0.05, (off, exact)


@pytest.mark.parametrize("P_id", ["deterministic", "prefix_free"])
def test_no_prefix_dependence_means_every_draft_survives(P_id):
    """A law that does not depend on the drafted prefix (each row the same) or a deterministic
    chain: the marginals are the conditionals along every drafted path, so all K survive."""
    mod = load_script("parallel_draft_ceiling")
    rng = np.random.default_rng(1)
    Q = np.tile(P[0], (V, 1)) if P_id == "prefix_free" else np.eye(V)[np.roll(np.arange(V), 1)]
    laws = chain_laws(Q, START)
    survive = mod.ideal_parallel_survival(laws(sample_chain(Q, START, 4000, rng)), laws, rng)
    assert survive.mean() > 0.97 and exact_tau(Q, START, K) == pytest.approx(K + 1)
