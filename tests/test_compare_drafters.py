"""scripts/compare_drafters.py: the paired bootstrap interval of one drafter's tokens per verify
step over another's, on synthetic engine-eval records."""

import json

import numpy as np
import pytest

from script_loader import load_script


def _replies(rng, n, tau, spread=0.6):
    """n replies of 64-256 tokens whose own tokens per step scatter around tau."""
    tokens = rng.integers(64, 257, size=n).astype(float)
    taus = np.clip(tau + spread * rng.standard_normal(n), 1.0, 8.0)
    return tokens, tokens / taus


def test_exact_ratios_and_the_interval_around_them():
    cd = load_script("compare_drafters")
    t = np.array([100.0, 200.0, 50.0])
    s = np.array([40.0, 90.0, 25.0])
    same = cd.paired_tau_ratio(t, s, t, s)
    assert same["ratio"] == pytest.approx(1.0) and same["low"] == same["high"] == pytest.approx(1.0)
    faster = cd.paired_tau_ratio(t * 1.2, s, t, s)  # 1.2x the tokens in the same steps, every prompt
    assert faster["ratio"] == pytest.approx(1.2) and faster["low"] == pytest.approx(1.2)
    assert faster["tau_a"] == pytest.approx(t.sum() * 1.2 / s.sum())
    with pytest.raises(ValueError, match="one length"):
        cd.paired_tau_ratio(t, s, t[:2], s[:2])


def test_the_interval_resolves_a_real_gap_and_covers_a_null_one():
    """200 prompts, 60 repetitions: a 2.5-vs-2.2 drafter pair's interval excludes 1 nearly always;
    the negative control, two draws from one drafter, holds 1 about 95 % of the time (the level),
    and a 50 % interval of the same draws misses 1 far more often (so coverage is no accident)."""
    cd = load_script("compare_drafters")
    rng = np.random.default_rng(3)
    resolved = covered = covered_half = 0
    reps = 60
    for r in range(reps):
        ta, sa = _replies(rng, 200, 2.5)
        tb, sb = _replies(rng, 200, 2.2)
        tc, sc = _replies(rng, 200, 2.5)
        gap = cd.paired_tau_ratio(ta, sa, tb, sb, resamples=1000, seed=r)
        resolved += gap["low"] > 1.0
        null = cd.paired_tau_ratio(ta, sa, tc, sc, resamples=1000, seed=r)
        covered += null["low"] <= 1.0 <= null["high"]
        half = cd.paired_tau_ratio(ta, sa, tc, sc, resamples=1000, seed=r, level=0.5)
        covered_half += half["low"] <= 1.0 <= half["high"]
    assert resolved >= 0.9 * reps
    assert 0.85 * reps <= covered
    assert covered_half <= 0.75 * reps


def test_compare_reads_engine_eval_records(tmp_path, capsys):
    cd = load_script("compare_drafters")
    rng = np.random.default_rng(0)

    def record(name, tau):
        rec = {"prompts": 50}
        for label in ("t1", "greedy"):
            t, s = _replies(rng, 50, tau)
            rec[f"{name}_{label}"] = {"tokens_per_step": t.sum() / s.sum(),
                                      "per_request": {"tokens": t.tolist(), "steps": s.tolist()}}
        t, s = _replies(rng, 8, tau)
        rec[f"{name}_t1"]["long"] = {"tokens_per_step": t.sum() / s.sum(),
                                     "per_request": {"tokens": t.tolist(), "steps": s.tolist()}}
        return rec

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(record("dspark", 2.5)))
    b.write_text(json.dumps(record("dflash", 2.2)))
    cd.main([str(a), str(b), "--out", str(tmp_path / "r.json")])
    res = json.loads((tmp_path / "r.json").read_text())
    assert (res["a"], res["b"]) == ("dspark", "dflash") and set(res) >= {"t1", "greedy", "t1_long"}
    rec_a = json.loads(a.read_text())
    assert res["t1"]["tau_a"] == pytest.approx(rec_a["dspark_t1"]["tokens_per_step"])
    assert res["t1_long"]["prompts"] == 8
    assert "t1: dspark" in capsys.readouterr().out
    old = {"dflash_t1": {"tokens_per_step": 2.2}, "dflash_greedy": {"tokens_per_step": 3.0}}
    b.write_text(json.dumps(old))  # a record from before per_request: refused by name
    with pytest.raises(SystemExit, match="per_request"):
        cd.main([str(a), str(b)])


def test_compare_picks_named_drafters_from_one_record(tmp_path, capsys):
    """standin_acceptance.py writes both drafters into one record: --a-name / --b-name pick them,
    and without names the record is refused, naming the drafters it holds."""
    cd = load_script("compare_drafters")
    rng = np.random.default_rng(1)
    rec = {"prompts": 40}
    for name, tau in (("dspark", 2.6), ("dflash", 2.2)):
        t, s = _replies(rng, 40, tau)
        rec[f"{name}_t1"] = {"tokens_per_step": t.sum() / s.sum(),
                             "per_request": {"tokens": t.tolist(), "steps": s.tolist()}}
    path = tmp_path / "both.json"
    path.write_text(json.dumps(rec))
    cd.main([str(path), str(path), "--a-name", "dspark", "--b-name", "dflash",
             "--out", str(tmp_path / "r.json")])
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["t1"]["ratio"] == pytest.approx(
        rec["dspark_t1"]["tokens_per_step"] / rec["dflash_t1"]["tokens_per_step"])
    with pytest.raises(SystemExit, match=r"\['dflash', 'dspark'\]"):
        cd.main([str(path), str(path)])
    with pytest.raises(SystemExit, match="no engine eval of drafter 'eagle'"):
        cd.main([str(path), str(path), "--a-name", "eagle"])


def test_each_prompt_set_gets_its_own_ratio(tmp_path, capsys):
    """Records that name their prompt sets (in prompt order) give a ratio per set, computed on that
    set's prompts alone; older records take --sets; records of other sets are refused."""
    cd = load_script("compare_drafters")
    rng = np.random.default_rng(2)
    sets = {"humaneval": 30, "mbpp": 20}
    recs = {}
    for name, taus in (("dspark", (3.2, 2.2)), ("dflash", (2.7, 1.9))):
        parts = [_replies(rng, n, tau) for n, tau in zip(sets.values(), taus)]
        t, s = (np.concatenate(x) for x in zip(*parts))
        recs[name] = {"prompts": 50, "sets": sets,
                      f"{name}_t1": {"per_request": {"tokens": t.tolist(), "steps": s.tolist()}}}
    res = cd.compare(recs["dspark"], recs["dflash"])
    he, mb = res["t1_humaneval"], res["t1_mbpp"]
    pa = recs["dspark"]["dspark_t1"]["per_request"]
    assert he["prompts"] == 30 and mb["prompts"] == 20
    assert he["tau_a"] == pytest.approx(sum(pa["tokens"][:30]) / sum(pa["steps"][:30]))
    assert mb["tau_a"] == pytest.approx(sum(pa["tokens"][30:]) / sum(pa["steps"][30:]))
    assert he["tau_a"] > res["t1"]["tau_a"] > mb["tau_a"]  # the whole lies between its parts
    # an older record without "sets": none unless given
    old = {k: v for k, v in recs["dflash"].items() if k != "sets"}
    assert "t1_mbpp" not in cd.compare(recs["dspark"], old)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(recs["dspark"]))
    b.write_text(json.dumps(old))
    cd.main([str(a), str(b), "--sets", "humaneval=30,mbpp=20"])
    assert "t1_mbpp: dspark" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="count 40 prompts, the records 50"):
        cd.main([str(a), str(b), "--sets", "humaneval=30,mbpp=10"])
    with pytest.raises(SystemExit, match="NAME=COUNT"):
        cd.main([str(a), str(b), "--sets", "humaneval"])
    other = dict(recs["dflash"], sets={"humaneval": 25, "mbpp": 25})
    with pytest.raises(SystemExit, match="prompt sets differ"):
        cd.compare(recs["dspark"], other)
