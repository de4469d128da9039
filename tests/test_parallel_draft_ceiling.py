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


def test_tokens_over_steps_is_the_engines_ratio_and_the_mix_weights_prompts():
    """Two contexts of 256 tokens each at 2 and 8 tokens a step: 512 tokens in 128 + 32 steps,
    3.2 a step (the mean, 5.0, is not what the engine would measure); the 421 prompts' mix
    weights MBPP's 257 prompts over HumanEval's 164."""
    mod = load_script("parallel_draft_ceiling")
    assert mod.tokens_over_steps([2.0, 8.0]) == pytest.approx(512 / (128 + 32))
    assert mod.tokens_over_steps([2.0, 8.0]) != pytest.approx(5.0)
    assert mod.mix({"humaneval": 6.0, "mbpp": 3.0}, mod.SET_SIZES) == pytest.approx(
        421 / (164 / 6.0 + 257 / 3.0))
    with pytest.raises(ValueError, match="mbpp"):
        mod.mix({"humaneval": 6.0}, mod.SET_SIZES)
    with pytest.raises(ValueError, match="positive"):
        mod.tokens_over_steps([2.0, 0.0])


def test_summarize_record_names_sets_from_prompt_index(tmp_path):
    """An older record (rows without a set) is summarised in place given the prompts per set;
    without it the script stops with an error that says what to pass."""
    import json
    mod = load_script("parallel_draft_ceiling")
    rows = [{"prompt": i, "cut": c, "tokens_per_step": t}
            for i, c, t in [(0, 16, 8.0), (0, 80, 4.0), (1, 16, 2.0), (2, 16, 2.0), (3, 16, 4.0)]]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"rows": rows}))
    with pytest.raises(SystemExit, match="--prompts"):
        mod.summarize_record(str(path), None)
    record = mod.summarize_record(str(path), 2)
    sets = record["summary"]["sets"]
    assert sets["humaneval"]["contexts"] == 3 and sets["mbpp"]["contexts"] == 2
    assert sets["humaneval"]["tokens_over_steps"] == pytest.approx(3 / (1 / 8 + 1 / 4 + 1 / 2))
    assert sets["mbpp"]["mean"] == pytest.approx(3.0)
    lo, hi = record["summary"]["mix_421_95"]
    assert lo <= record["summary"]["mix_421"] <= hi
    assert json.loads(path.read_text())["summary"] == record["summary"]
