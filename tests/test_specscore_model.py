"""scripts/specscore_model.py: the what-if gives back a real record at its own tau, and moves as
its model says when the acceptance or the verify width changes."""

import json
import math
from pathlib import Path

import pytest

from script_loader import load_script

sm = load_script("specscore_model")
RUN = Path(__file__).resolve().parent.parent / "docs/results/2026-12-06-h100-bench"


@pytest.fixture(scope="module")
def parts():
    return sm.read_parts(RUN / "parts")


def test_at_the_measured_tau_it_is_the_record(parts):
    record = json.loads((RUN / "bench.json").read_text())
    got = sm.model(parts, parts["solo"]["verify"]["tau"])
    for w in sm.WORKLOADS:
        assert got["taus"][w] == pytest.approx(parts[w]["verify"]["tau"], rel=1e-6)
        assert got["ratios"][w] == pytest.approx(record["ratios"][w]["ratio"], rel=1e-6)
    assert got["specscore"] == pytest.approx(record["specscore"], rel=1e-6)


def test_more_acceptance_more_speed_up_to_the_rest_of_the_pass(parts):
    scores = [sm.model(parts, t)["specscore"] for t in (2.5, 3.0, 4.0, 6.0, 8.0)]
    assert scores == sorted(scores) and scores[0] < scores[-1]
    top = sm.model(parts, 8.0)
    for w in ("team", "busy"):  # 3 drafts: never more than 4 tokens a step
        assert top["taus"][w] <= 4.0 + 1e-9
    # Busy's bound: stock's time over the speculative pass without its decode wait.
    bound = max(p.spec_tokens / p.spec_rest_s / (p.stock_tokens / p.stock_wall_s)
                for p in sm.pass_pairs(parts["busy"]))
    assert top["ratios"]["busy"] < bound


def test_solo_tau_for_inverts_the_model(parts):
    need = sm.solo_tau_for(parts, 2.0)
    assert 3.0 < need < 8.0
    assert sm.model(parts, need)["specscore"] == pytest.approx(2.0, abs=1e-6)
    assert sm.solo_tau_for(parts, 50.0) is None


def _sweep(parts, cost_at_7):
    rows = []
    for w in ("team", "busy"):
        lanes, ctx = parts[w]["spec"]["lanes"], parts[w]["prompt_tokens"]["mean"]
        rows += [{"lanes": lanes, "context": ctx, "num_draft": 3, "iteration_ms": 10.0},
                 {"lanes": lanes, "context": ctx, "num_draft": 7, "iteration_ms": 10.0 * cost_at_7}]
    return {"spec": rows}


def test_a_width_sweep_picks_the_width_that_pays(parts):
    free = sm.model(parts, 4.0, _sweep(parts, 1.0))    # 7 drafts at 3's cost: always wider
    dear = sm.model(parts, 4.0, _sweep(parts, 10.0))   # 7 drafts at ten times: never
    plain = sm.model(parts, 4.0)
    for w in ("team", "busy"):
        assert free["widths"][w] == 7 and free["ratios"][w] > plain["ratios"][w]
        assert dear["widths"][w] == 3 and dear["ratios"][w] == pytest.approx(plain["ratios"][w])
    assert free["widths"]["solo"] == plain["widths"]["solo"] == 7


def test_a_sweep_of_two_drafter_routes_is_read_at_the_bench_route(parts):
    """An A/B sweep (bench_steps --draft-linear xla,triton) holds both routes' rows at each
    width: the model must read the route the bench ran (the part's engine.draft_linear), not
    whichever row came last."""
    cheap = _sweep(parts, 1.0)  # 7 drafts at 3's cost on XLA
    other = [{**r, "draft_linear": "triton", "iteration_ms": r["iteration_ms"] * (
        10.0 if r["num_draft"] == 7 else 1.0)} for r in cheap["spec"]]  # dear on the other route
    both = {"spec": cheap["spec"] + other}
    for w in ("team", "busy"):
        assert (parts[w]["engine"].get("draft_linear") or "xla") == "xla"
        assert sm.width_costs(both, parts[w]) == sm.width_costs(cheap, parts[w]) == {3: 1.0, 7: 1.0}
        on_triton = {**parts[w], "engine": {**parts[w]["engine"], "draft_linear": "triton"}}
        assert sm.width_costs(both, on_triton) == {3: 1.0, 7: 10.0}


def test_the_iteration_cost_scales_the_decode_wait_only(parts):
    part = parts["team"]
    tau = part["verify"]["tau"]
    slow = sm.workload_ratio(part, tau, cost=2.0)
    p = sm.pass_pairs(part)[0]
    first = [x for x in part["passes"] if x["index"] == 0]  # pass 0 of both engines
    assert sm.workload_ratio({**part, "passes": first}, tau, 2.0) == pytest.approx(
        p.spec_tokens / (p.spec_rest_s + 2 * p.spec_wait_s) / (p.stock_tokens / p.stock_wall_s))
    assert slow < sm.workload_ratio(part, tau)


def test_a_faster_prefill_lifts_busy_most(parts):
    tau = parts["solo"]["verify"]["tau"]
    base, fast = sm.model(parts, tau), sm.model(parts, tau, prefill_speedup=2.0)
    gain = {w: fast["ratios"][w] / base["ratios"][w] for w in sm.WORKLOADS}
    assert all(g > 1.0 for g in gain.values())
    assert gain["busy"] == max(gain.values())  # half of busy's pass is prefill
    # Pass 0 by hand: prefill halved in both engines, the rest as measured.
    p = sm.pass_pairs(parts["busy"])[0]
    first = [x for x in parts["busy"]["passes"] if x["index"] == 0]
    want = (p.spec_tokens / (p.spec_rest_s + p.spec_wait_s - p.spec_prefill_s / 2)) / (
        p.stock_tokens / (p.stock_wall_s - p.stock_prefill_s / 2))
    got = sm.workload_ratio({**parts["busy"], "passes": first}, parts["busy"]["verify"]["tau"],
                            prefill_speedup=2.0)
    assert got == pytest.approx(want)


def test_the_cli_names_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sm.main(["--parts", str(RUN / "parts"), "--solo-taus", "3,x"])
    assert "--solo-taus: not a comma list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sm.main(["--parts", str(RUN / "parts"), "--solo-taus", "9"])
    assert "must be in [1, 8]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sm.main(["--parts", str(RUN / "parts"), "--prefill-speedup", "0.5"])
    assert "--prefill-speedup must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="busy.json is missing"):
        (tmp_path / "solo.json").write_text("{}")
        (tmp_path / "team.json").write_text("{}")
        sm.main(["--parts", str(tmp_path)])
    out = tmp_path / "m.json"
    assert sm.main(["--parts", str(RUN / "parts"), "--solo-taus", "2.5,4", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["solo_tau"] for r in record["rows"]] == [2.5, 4.0]
    assert math.isfinite(record["rows"][1]["specscore"])
