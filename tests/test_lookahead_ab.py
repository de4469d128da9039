"""scripts/lookahead_ab.py: the ABBA order and the summary's ratios, on made-up passes."""

import pytest

from script_loader import load_script

ab = load_script("lookahead_ab")


def test_settings_alternate_abba():
    assert ab.settings_order(1) == [False, True]
    assert ab.settings_order(2) == [False, True, True, False]
    order = ab.settings_order(3)
    assert order.count(True) == order.count(False) == 3


def test_summary_ratios_and_gains():
    def p(engine, la, tps):
        return {"engine": engine, "lookahead_admission": la, "tokens_per_s": tps}
    passes = [p("stock", False, 100), p("stock", False, 104), p("stock", True, 110),
              p("spec", False, 130), p("spec", True, 150), p("spec", True, 160),
              p("stock", True, 112), p("spec", False, 126)]
    s = ab.summarize(passes)
    assert s["median_tokens_per_s"] == {"stock_off": 102, "stock_on": 111, "spec_off": 128,
                                        "spec_on": 155}
    assert s["ratio"]["off"] == pytest.approx(128 / 102)
    assert s["ratio"]["on"] == pytest.approx(155 / 111)
    assert s["gain"]["spec"] == pytest.approx(155 / 128)


def test_a_setting_without_passes_has_no_ratio():
    s = ab.summarize([{"engine": "stock", "lookahead_admission": False, "tokens_per_s": 1.0}])
    assert "ratio" not in s and s["median_tokens_per_s"]["spec_on"] is None
