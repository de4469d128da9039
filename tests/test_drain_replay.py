"""scripts/drain_replay.py: the drain schedule and the shared-rows policy on cases worked by hand."""

import numpy as np
import pytest

from script_loader import load_script

dr = load_script("drain_replay")


def test_shared_drafts_never_exceed_the_fixed_rows():
    assert dr.shared_drafts(32, 32, 3) == 3
    assert dr.shared_drafts(21, 32, 3) == 5      # 128 // 21 = 6 rows
    assert dr.shared_drafts(16, 32, 3) == 7      # capped at the drafter's block
    assert dr.shared_drafts(1, 16, 3) == 7
    for active in range(1, 33):
        assert active * (dr.shared_drafts(active, 32, 3) + 1) <= 32 * 4


@pytest.mark.parametrize("tau", [1.0, 1.7, 2.5, 4.0, 7.5])
def test_solve_alpha_inverts_tau_at(tau):
    alpha = dr.solve_alpha(tau, 7)
    assert dr.tau_at(alpha, 7) == pytest.approx(tau, abs=1e-6)


def test_scale_to_mean_tau_hits_the_target():
    alphas = np.array([0.2, 0.5, 0.7, 0.8])
    scaled = dr.scale_to_mean_tau(alphas, 2.0, 3)
    assert np.mean(dr.tau_at(scaled, 3)) == pytest.approx(2.0, abs=1e-6)
    assert np.all(np.diff(scaled) > 0)  # one factor for all: the order is kept


def test_schedule_admits_at_dispatch_boundaries():
    # No draft is ever accepted: one token a round. Two lanes, three replies of 4 tokens, 2
    # iterations a dispatch: the third request waits for the first dispatch boundary after a
    # lane frees (iteration 4), then runs 4 more.
    tokens = [4, 4, 4]
    u = np.ones((3, 8, 7))
    for policy in ("fixed", "shared"):
        n, active = dr.schedule(tokens, np.zeros(3), u, lanes=2, num_draft=3, steps=2, policy=policy)
        assert n == 8
        assert list(active) == [2, 2, 2, 2, 1, 1, 1, 1]


def test_shared_rows_shorten_the_drain():
    # Every draft accepted. Fixed: 4 tokens a round. Shared: the lone lane gets 7 drafts (8
    # tokens) once the short reply is done.
    tokens, alphas, u = [4, 16], np.ones(2), np.zeros((2, 8, 7))
    fixed, _ = dr.schedule(tokens, alphas, u, lanes=2, num_draft=3, steps=1, policy="fixed")
    shared, _ = dr.schedule(tokens, alphas, u, lanes=2, num_draft=3, steps=1, policy="shared")
    assert (fixed, shared) == (4, 3)
