"""scripts/width_policy_probe.py: replaying verify-width policies on recorded accept counts."""

import pytest

from script_loader import load_script


ACCEPTS = [[7, 7, 0, 2], [1, 0, 5]]  # drafts accepted per round at width 7, two requests


def test_fixed_widths_cut_each_round_at_the_width():
    wp = load_script("width_policy_probe")
    full = wp.replay(ACCEPTS, wp.fixed(7))
    assert full["tau"] == pytest.approx((8 + 8 + 1 + 3 + 2 + 1 + 6) / 7)
    assert full["rows_per_lane"] == 8
    three = wp.replay(ACCEPTS, wp.fixed(3))
    assert three["tau"] == pytest.approx((4 + 4 + 1 + 3 + 2 + 1 + 4) / 7)
    assert three["tokens_per_row"] == pytest.approx(19 / 28)
    assert wp.replay(ACCEPTS, wp.fixed(0))["tau"] == 1.0


def test_history_policies_see_only_earlier_rounds():
    wp = load_script("width_policy_probe")
    seen = []

    def spy(past):
        seen.append(list(past))
        return 2
    wp.replay(ACCEPTS, spy)
    assert seen == [[], [7], [7, 7], [7, 7, 0], [], [1], [1, 0]]
    # last+1 (min 1), start 3: widths 3, 7, 7, 1 and 3, 2, 1
    got = wp.replay(ACCEPTS, wp.last_plus(1, lo=1, start=3))
    assert got["tau"] == pytest.approx((4 + 8 + 1 + 2 + 2 + 1 + 2) / 7)
    assert got["rows_per_lane"] == pytest.approx((4 + 8 + 8 + 2 + 4 + 3 + 2) / 7)
    with pytest.raises(ValueError, match="outside 0..7"):
        wp.replay(ACCEPTS, wp.fixed(8))


def test_iteration_time_interpolates_and_extrapolates_below_only():
    wp = load_script("width_policy_probe")
    table = {4: 10.0, 5: 11.0, 8: 14.0}
    assert wp.iteration_ms(table, 4.5) == (pytest.approx(10.5), False)
    assert wp.iteration_ms(table, 3.0) == (pytest.approx(9.0), True)
    with pytest.raises(ValueError, match="above the swept 8"):
        wp.iteration_ms(table, 8.5)
