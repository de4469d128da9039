"""Would a verify width chosen per lane from its own past rounds beat a fixed width? (CPU probe)

The engine generates at T = 1 on the code prompts (seeds 1000 + i) with all 7 drafts verified
under the draft-by-draft (token) rule, and keeps each request's accepted drafts per round, a_t.
Under the token rule the test of draft k reads only x_1..x_k, so a round verified at width n
would have accepted exactly min(a_t, n) of the same drafts. That replays any width policy on
the same rounds:

  fixed n        n_t = n
  last+d         n_t = clip(a_{t-1} + d, lo, 7)          (a_0: the policy's start width)
  ema c          n_t = clip(round(c * EMA of a), lo, 7)

A policy may read only rounds before t, so the draft count is fixed before the round's drafts
exist and the output law is the target's (the rejection sampler is exact for any such count).
Each policy is reported as tokens per round (tau), verify rows per lane (n_t + 1) and tokens per
row, and, where a bench_steps.py width sweep is given (--cost, its spec rows at --lanes /
--context), as tokens per millisecond: tau over the iteration time at the policy's mean rows
(interpolated between the swept widths; lanes' rows packed into one verify, as the engine's
confidence gate packs them). The replay keeps each request's rounds in order but not its exact
positions (a narrower width would have ended rounds elsewhere): an estimate of the effect of
the policy's information, not a measurement of it.

  python scripts/width_policy_probe.py --prompts-dir ../shared/data/prompts --limit 30 \\
      --max-tokens 128 --cost docs/results/2026-12-03-verify-width/width_sweep.json --out wp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MAX_DRAFTS = 7


def replay(accepts: list[list[int]], policy) -> dict:
    """Tokens and rows per round of `policy` (a function of a request's past accepts -> n)
    over every request's rounds; accepts[r][t] = drafts accepted at width 7 (token rule)."""
    tokens = rows = rounds = 0
    widths = []
    for seq in accepts:
        for t, a in enumerate(seq):
            n = int(policy(seq[:t]))
            if not 0 <= n <= MAX_DRAFTS:
                raise ValueError(f"policy chose width {n}, outside 0..{MAX_DRAFTS}")
            tokens += min(a, n) + 1
            rows += n + 1
            rounds += 1
            widths.append(n)
    return {"tau": tokens / rounds, "rows_per_lane": rows / rounds, "tokens_per_row": tokens / rows,
            "rounds": rounds, "widths": widths}


def bucketed_rows_per_lane(widths: list[int], lanes: int, sizes, draws: int = 4000,
                           seed: int = 0) -> float:
    """Mean verify rows per lane an engine pays when `lanes` independent lanes each pick a width
    from `widths` (drafts) and the packed verify runs at the smallest of the static `sizes`
    (rows, ascending; the last holds any choice) that holds their rows."""
    rng = np.random.default_rng(seed)
    totals = (rng.choice(np.asarray(widths), size=(draws, lanes)) + 1).sum(axis=1)
    sizes = np.asarray(sizes)
    if totals.max() > sizes[-1]:
        raise ValueError(f"{totals.max()} rows do not fit the largest bucket, {sizes[-1]}")
    return float(sizes[np.searchsorted(sizes, totals)].mean() / lanes)


def fixed(n):
    return lambda past: n


def last_plus(d, lo=1, start=3):
    return lambda past: start if not past else min(MAX_DRAFTS, max(lo, past[-1] + d))


def ema(c, lo=1, start=3, decay=0.5):
    def policy(past):
        if not past:
            return start
        m = past[0]
        for a in past[1:]:
            m = decay * m + (1 - decay) * a
        return min(MAX_DRAFTS, max(lo, int(round(c * m))))
    return policy


POLICIES = {**{f"fixed {n}": fixed(n) for n in range(1, MAX_DRAFTS + 1)},
            **{f"last+{d} (min {lo})": last_plus(d, lo) for d in (1, 2) for lo in (1, 2)},
            **{f"ema x{c} (min {lo})": ema(c, lo) for c in (1.0, 1.5, 2.0) for lo in (1, 2)}}


def iteration_ms(cost_rows: dict, rows_per_lane: float) -> tuple[float, bool]:
    """(iteration ms at a mean of `rows_per_lane` verify rows, extrapolated?): linear between the
    swept widths, and below the narrowest along the line through the two narrowest (the sweep
    of 2026-12-03 starts at 3 drafts); above the widest it refuses."""
    xs = sorted(cost_rows)
    if rows_per_lane > xs[-1]:
        raise ValueError(f"{rows_per_lane:.2f} rows per lane is above the swept {xs[-1]}")
    if rows_per_lane >= xs[0]:
        return float(np.interp(rows_per_lane, xs, [cost_rows[x] for x in xs])), False
    slope = (cost_rows[xs[1]] - cost_rows[xs[0]]) / (xs[1] - xs[0])
    return cost_rows[xs[0]] - slope * (xs[0] - rows_per_lane), True


def cost_table(path: str, lanes: int, context: int) -> dict:
    """{rows per lane: iteration ms} from a bench_steps.py record's spec rows."""
    from verify_gate_acceptance import cost_by_rows
    rows = {total // lanes: ms for total, ms in
            cost_by_rows(json.loads(Path(path).read_text()), lanes, context).items()}
    if len(rows) < 2:
        raise ValueError(f"{path}: fewer than two widths at {lanes} lanes, context {context}")
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from verify_gate_acceptance import (add_cost_arguments, add_t1_probe_arguments,
                                        code_first_turns, generate_t1)
    add_t1_probe_arguments(ap)
    add_cost_arguments(ap)
    ap.add_argument("--replay", help="a record this script wrote: replay its accepts (no engine run)")
    args = ap.parse_args(argv)

    if args.replay:
        rec = json.loads(Path(args.replay).read_text())
        accepts = rec["accepts"]
        rec["policies"] = {}
    else:
        from jspec import LLM
        prompts = code_first_turns(args.prompts_dir, args.limit)
        llm = LLM(args.target, draft=args.draft, max_lanes=8, verify_rule="token")
        t = time.time()
        reqs = generate_t1(llm, prompts, args.max_tokens)
        accepts = [[n - 1 for n in r.step_tokens] for r in reqs]
        rec = {"target": args.target, "draft": args.draft, "prompts": len(prompts),
               "max_tokens": args.max_tokens, "temperature": 1.0, "rule": "token",
               "wall_s": time.time() - t, "accepts": accepts, "policies": {}}
    costs = {}
    if args.cost:
        for lanes, ctx in zip(map(int, args.lanes.split(",")), map(int, args.contexts.split(","))):
            costs[f"{lanes} lanes, context {ctx}"] = cost_table(args.cost, lanes, ctx)
    # The static verify sizes a per-lane width is packed into: the engine's confidence-gate
    # buckets (spec_steps.verify_buckets), and one per row per lane.
    from jspec.spec_steps import verify_buckets
    bucket_sets = {"engine buckets": lambda lanes: verify_buckets(lanes, MAX_DRAFTS + 1),
                   "every row": lambda lanes: [lanes * w for w in range(1, MAX_DRAFTS + 2)]}
    for name, policy in POLICIES.items():
        row = replay(accepts, policy)
        widths = row.pop("widths")
        for where, table in costs.items():
            lanes = int(where.split()[0])
            ms, extrapolated = iteration_ms(table, row["rows_per_lane"])
            row[f"tokens_per_ms, {where}"] = row["tau"] / ms
            row[f"extrapolated, {where}"] = extrapolated
            for bname, sizes in bucket_sets.items():
                paid = bucketed_rows_per_lane(widths, lanes, sizes(lanes))
                ms, extrapolated = iteration_ms(table, paid)
                row[f"tokens_per_ms, {where}, {bname}"] = row["tau"] / ms
                row[f"extrapolated, {where}, {bname}"] = extrapolated
        rec["policies"][name] = row
    Path(args.out).write_text(json.dumps(rec, indent=1))
    cols = ["tau", "rows_per_lane", "tokens_per_row"] + [
        f"tokens_per_ms, {w}{b}" for w in costs for b in ("", ", engine buckets", ", every row")]
    print("| policy | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, row in rec["policies"].items():
        cells = [f"{row[c]:.3f}" + ("*" if c.startswith("tokens_per_ms")
                                     and row[c.replace("tokens_per_ms", "extrapolated")] else "")
                 for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if costs:
        print("(* priced below the narrowest swept width, along the line through the two narrowest)")
    return rec


if __name__ == "__main__":
    main()
