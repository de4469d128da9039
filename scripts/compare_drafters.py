"""Tokens per verify step of two drafters measured on the same prompts, as a ratio with a paired
bootstrap interval: is DSpark >= 1.15x DFlash (issue 5's target) resolved by the measurement?

  python scripts/compare_drafters.py engine_eval_dspark.json engine_eval_dflash.json [--out x.json]
  python scripts/compare_drafters.py eval.json eval.json --a-name dspark --b-name dflash

Inputs are train_standin's engine-eval records (one per drafter; the drafter is the name before
`_t1` / `_greedy` in their keys; a record of several drafters, as
scripts/standin_acceptance.py writes, needs the name). Each setting (t1, greedy, and t1 on long prompts where both
have it) needs `per_request` tokens and verify steps in prompt order, written since 2026-12-02's
third session. tau = sum(tokens) / sum(steps) over the prompts, as the records' own
tokens_per_step; the interval resamples prompts, the same indices for both drafters (the prompts
and seeds are the same, so the pair is the prompt). Where the records say which prompts came from
which set (`sets`, {name: count} in prompt order, written since 2026-12-06's fourth session; or
--sets for older records), each set gets its own ratio too (t1_humaneval, t1_mbpp, ...)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def paired_tau_ratio(tokens_a, steps_a, tokens_b, steps_b, *, resamples: int = 4000,
                     seed: int = 0, level: float = 0.95) -> dict:
    """(sum tokens_a / sum steps_a) / (sum tokens_b / sum steps_b) and its percentile interval
    over `resamples` paired bootstrap draws of the prompts."""
    arrays = [np.asarray(v, np.float64) for v in (tokens_a, steps_a, tokens_b, steps_b)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        raise ValueError(f"paired_tau_ratio: the four arrays must be non-empty and of one length, "
                         f"got {[len(a) for a in arrays]}")
    ta, sa, tb, sb = arrays
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    draws = (ta[idx].sum(1) / sa[idx].sum(1)) / (tb[idx].sum(1) / sb[idx].sum(1))
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    ratio = (ta.sum() / sa.sum()) / (tb.sum() / sb.sum())
    return {"ratio": float(ratio), "low": float(lo), "high": float(hi),
            "level": level, "prompts": n, "tau_a": float(ta.sum() / sa.sum()),
            "tau_b": float(tb.sum() / sb.sum())}


def _drafter(rec: dict, name: str | None = None) -> str:
    names = {k.rsplit("_", 1)[0] for k in rec if k.endswith(("_t1", "_greedy"))}
    if name is not None:
        if name not in names:
            raise SystemExit(f"no engine eval of drafter {name!r} in the record; it has "
                             f"{sorted(names) or 'none'}")
        return name
    if len(names) != 1:
        raise SystemExit(f"expected one drafter's engine eval, found {sorted(names) or 'none'} "
                         "(name one with --a-name / --b-name)")
    return names.pop()


def _sets(rec_a: dict, rec_b: dict, given: dict | None) -> dict:
    """{set name: count} in prompt order, the same in both records (or given), else {}."""
    if given:
        return given
    sa, sb = rec_a.get("sets"), rec_b.get("sets")
    if not (sa and sb):
        return {}  # a record from before "sets": no split unless --sets gives it
    if list(sa.items()) != list(sb.items()):
        raise SystemExit(f"the records' prompt sets differ ({sa} against {sb}): not the same prompts")
    return dict(sa)


def compare(rec_a: dict, rec_b: dict, name_a: str | None = None,
            name_b: str | None = None, sets: dict | None = None) -> dict:
    a, b = _drafter(rec_a, name_a), _drafter(rec_b, name_b)
    out = {"a": a, "b": b}
    sets = _sets(rec_a, rec_b, sets)
    for label in ("t1", "greedy", "t1_long"):
        key, sub = (label, None) if label != "t1_long" else ("t1", "long")
        ea, eb = rec_a.get(f"{a}_{key}"), rec_b.get(f"{b}_{key}")
        if sub:
            ea, eb = (ea or {}).get(sub), (eb or {}).get(sub)
        if not ea or not eb:
            continue
        if "per_request" not in ea or "per_request" not in eb:
            raise SystemExit(f"{label}: a record has no per_request data (written since "
                             "2026-12-02's third session); no interval can be computed")
        pa, pb = ea["per_request"], eb["per_request"]
        out[label] = paired_tau_ratio(pa["tokens"], pa["steps"], pb["tokens"], pb["steps"])
        if sub or not sets:
            continue
        if sum(sets.values()) != len(pa["tokens"]):
            raise SystemExit(f"{label}: the sets {sets} count {sum(sets.values())} prompts, the "
                             f"records {len(pa['tokens'])}")
        start = 0
        for name, count in sets.items():
            part = slice(start, start + count)
            start += count
            out[f"{label}_{name}"] = paired_tau_ratio(pa["tokens"][part], pa["steps"][part],
                                                      pb["tokens"][part], pb["steps"][part])
    return out


def parse_sets(text: str) -> dict:
    """'humaneval=100,mbpp=100' -> {'humaneval': 100, 'mbpp': 100}."""
    try:
        sets = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--sets {text!r}: expected NAME=COUNT[,NAME=COUNT...]") from None
    if not sets or any(n <= 0 for n in sets.values()):
        raise SystemExit(f"--sets {text!r}: every count must be positive")
    return sets


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="engine eval of the drafter on top of the ratio")
    ap.add_argument("b", type=Path, help="engine eval of the drafter below it")
    ap.add_argument("--a-name", help="the drafter in A (when A holds several)")
    ap.add_argument("--b-name", help="the drafter in B (when B holds several)")
    ap.add_argument("--sets", type=parse_sets,
                    help="NAME=COUNT,... the prompt sets in order, for records written before they "
                         "said so (train_standin's eval: humaneval=N,mbpp=N at --eval-limit N)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()),
                  args.a_name, args.b_name, args.sets)
    for label, r in res.items():
        if label not in ("a", "b"):
            print(f"{label}: {res['a']} {r['tau_a']:.3f} / {res['b']} {r['tau_b']:.3f} = "
                  f"{r['ratio']:.3f}x [{r['low']:.3f}, {r['high']:.3f}] ({r['prompts']} prompts)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
