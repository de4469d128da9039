"""scripts/multi_draft_probe.py: the first position's acceptance with n candidates, against a
simulation of recursive rejection sampling that also checks the scheme emits exactly p (and that
a wrong residual does not)."""

import numpy as np
import pytest

from script_loader import load_script

md = load_script("multi_draft_probe")


def simulate(p, q, n, trials, rng, residual_rule=True):
    """Recursive rejection sampling with n i.i.d. candidates from q: (emitted tokens, accepted)."""
    V = len(p)
    out, accepted = np.empty(trials, int), np.zeros(trials, bool)
    cand = rng.choice(V, size=(trials, n), p=q)
    u = rng.random((trials, n))
    for t in range(trials):
        r = p.copy()
        for i in range(n):
            x = cand[t, i]
            if u[t, i] < min(1.0, r[x] / q[x]):
                out[t], accepted[t] = x, True
                break
            if residual_rule:  # what is left of the target once this candidate is rejected
                r = np.maximum(r - q, 0.0)
                r = r / r.sum()
        else:
            out[t] = rng.choice(V, p=r)
    return out, accepted


@pytest.mark.parametrize("n", [1, 2, 3])
def test_acceptance_matches_simulation_and_output_is_exact(n):
    rng = np.random.default_rng(n)
    p = np.array([0.40, 0.25, 0.15, 0.12, 0.05, 0.03])
    q = np.array([0.10, 0.45, 0.05, 0.20, 0.15, 0.05])
    trials = 40000
    out, accepted = simulate(p, q, n, trials, rng)
    a = md.candidates_acceptance(p, q, n)
    assert accepted.mean() == pytest.approx(a[n - 1], abs=4 * np.sqrt(a[n - 1] / trials))
    freq = np.bincount(out, minlength=len(p)) / trials
    chi2 = trials * np.sum((freq - p) ** 2 / p)
    assert chi2 < 20.5  # 5 degrees of freedom: p about 0.001


def test_negative_control_without_the_residual_is_not_exact():
    # Testing the second candidate against p instead of the residual over-emits q's favourites.
    rng = np.random.default_rng(7)
    p = np.array([0.40, 0.25, 0.15, 0.12, 0.05, 0.03])
    q = np.array([0.10, 0.45, 0.05, 0.20, 0.15, 0.05])
    trials = 40000
    out, _ = simulate(p, q, 2, trials, rng, residual_rule=False)
    freq = np.bincount(out, minlength=len(p)) / trials
    assert trials * np.sum((freq - p) ** 2 / p) > 100


def test_more_candidates_never_accept_less_and_equal_laws_always_accept():
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(50), 8), rng.dirichlet(np.ones(50), 8)
    a = md.candidates_acceptance(p, q, 4)
    assert np.all(np.diff(a, axis=-1) >= -1e-12)
    assert np.allclose(a[:, 0], np.minimum(p, q).sum(-1))
    assert np.allclose(md.candidates_acceptance(p, p, 3), 1.0)


def test_round_estimates_on_a_worked_round():
    # One lane, K = 2 drafts over V = 2: p_1 = (.5, .5), q_1 = (1, 0): a_1 = .5, and with two
    # candidates the residual (0, 1) cannot be drawn from q: a_2 = .5 too. Draft 2 has ratio .25.
    p = np.log(np.array([[[0.5, 0.5], [0.2, 0.8], [0.5, 0.5]]]))
    q = np.log(np.array([[[1.0, 1e-30], [0.8, 0.2]]]))
    a, rest = md.round_estimates(p, q, np.array([[0, 0]]), np.array([2]), 2)
    assert a[0] == pytest.approx([0.5, 0.5])
    assert rest[0] == pytest.approx(0.25)
    a, rest = md.round_estimates(p, q, np.array([[0, 0]]), np.array([1]), 2)
    assert rest[0] == 0.0  # the second draft was not proposed


def test_matched_rounds_follow_each_requests_steps():
    # A request of prompt length 5 that emitted 3, 1 and 2 tokens ran rounds whose first drafted
    # position was 6, 9 and 10; a round recorded for another seed or position is not its.
    from types import SimpleNamespace
    vg = load_script("verify_gate_acceptance")
    reqs = [SimpleNamespace(prompt_ids=[0] * 5, step_tokens=[3, 1, 2], seed=7),
            SimpleNamespace(prompt_ids=[0] * 2, step_tokens=[1], seed=8)]
    rounds = {(7, 6): "a", (7, 9): "b", (7, 10): "c", (8, 3): "d", (7, 7): "x", (9, 6): "y"}
    assert vg.matched_rounds(reqs, rounds) == (["a", "b", "c", "d"], 0)
    del rounds[(7, 9)]
    assert vg.matched_rounds(reqs, rounds) == (["a", "c", "d"], 1)
