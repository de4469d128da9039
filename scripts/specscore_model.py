"""What acceptance the bench would need for a SpecScore: a what-if over a bench record's passes.

Each speculative pass of a record splits into the device wait of its decode dispatches
(engine_time.wait_s) and the rest (prefill, host work, emission). The model keeps the rest and the
cost of an iteration as measured and lets the acceptance change: the wait scales as tau / tau',
fewer iterations for the same tokens. The stock passes stay as measured, so at tau' = tau the
model gives back the record's pass ratios exactly, and as tau' grows a workload's ratio is
bounded by stock's time over the speculative pass's rest (busy's prefill, for instance).

Acceptance is one number per workload: drafts accepted one after another at a constant rate
alpha (drain_replay.tau_at), at the workload's own verify width (the record's drafts a step).
The sweep variable is solo's tau (7 drafts); every workload's alpha is scaled by the factor that
takes solo's alpha to the swept value, so team and busy, which verify 3 drafts, can never pass 4.

A better drafter makes wider verifies pay at team and busy. With `--width-sweep` (a
bench_steps.py record with spec rows at several --num-draft), each of team and busy may verify
any width of the sweep: its iterations then cost t(n) / t(n0) as many milliseconds (the sweep's
row at the workload's lanes and nearest context, n0 the record's width), and the model keeps the
width with the best ratio. `--prefill-speedup F` divides both engines' prefill time by F.

An estimate, not a measurement: lane use is held as measured (a better drafter also shortens the
drain, which this ignores), so is the cost of an iteration (or its ratio from the sweep, which
may come from another GPU or commit) and of everything outside the decode.

  python scripts/specscore_model.py --parts docs/results/2026-12-06-h100-bench/parts --target 2.4
  python scripts/specscore_model.py --parts ... --width-sweep docs/results/2026-12-03-verify-width/width_sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drain_replay import solve_alpha, tau_at  # noqa: E402

from jspec.bench.gate import geometric_mean
from jspec.bench.report import paired_passes

WORKLOADS = ("solo", "team", "busy")


def read_parts(parts_dir: Path) -> dict:
    parts = {}
    for w in WORKLOADS:
        path = Path(parts_dir) / f"{w}.json"
        if not path.exists():
            raise SystemExit(f"specscore_model: {path} is missing: SpecScore needs solo, team "
                             f"and busy from one run")
        parts[w] = json.loads(path.read_text())
    return parts


class PassPair(NamedTuple):
    """One pass index of a workload: what the model keeps and what it scales."""
    stock_tokens: int
    stock_wall_s: float
    stock_prefill_s: float
    spec_tokens: int
    spec_rest_s: float      # the speculative pass outside its decode dispatches' device wait
    spec_wait_s: float      # that wait: what acceptance and the iteration's cost scale
    spec_prefill_s: float


def pass_pairs(part: dict) -> list[PassPair]:
    pairs = []
    for stock, spec in paired_passes(part):
        wait = spec["engine_time"]["wait_s"]
        pairs.append(PassPair(stock["tokens"], stock["wall_s"], stock["engine_time"]["prefill_s"],
                              spec["tokens"], spec["wall_s"] - wait, wait,
                              spec["engine_time"]["prefill_s"]))
    return pairs


def workload_ratio(part: dict, tau_new: float, cost: float = 1.0,
                   prefill_speedup: float = 1.0) -> float:
    """The median pass ratio with the decode wait scaled to tau_new, each iteration costing
    `cost` times the measured one, and both engines' prefill `prefill_speedup` times faster."""
    scale = part["verify"]["tau"] / tau_new * cost
    cut = 1.0 - 1.0 / prefill_speedup
    return statistics.median(
        (p.spec_tokens / (p.spec_rest_s - p.spec_prefill_s * cut + p.spec_wait_s * scale))
        / (p.stock_tokens / (p.stock_wall_s - p.stock_prefill_s * cut))
        for p in pass_pairs(part))


def width(part: dict) -> int:
    return int(round(part["verify"]["drafts_per_step"]))


def workload_alphas(parts: dict, solo_tau: float) -> dict[str, float]:
    """Each workload's alpha when solo's tau is `solo_tau`: every alpha scaled by solo's factor."""
    factor = solve_alpha(solo_tau, width(parts["solo"])) / solve_alpha(
        parts["solo"]["verify"]["tau"], width(parts["solo"]))
    return {w: min(solve_alpha(parts[w]["verify"]["tau"], width(parts[w])) * factor, 1.0)
            for w in WORKLOADS}


def drafter_route(record: dict) -> str:
    """The drafter's matmul route of a bench part's engine or a sweep row; records from before
    EngineConfig.draft_linear existed ran XLA's."""
    return record.get("draft_linear") or "xla"


def width_costs(sweep: dict, part: dict) -> dict[int, float]:
    """{drafts: iteration ms over the record width's} from a bench_steps sweep, at the part's
    lanes and the sweep's context nearest the part's mean prompt."""
    lanes, context = part["spec"]["lanes"], part["prompt_tokens"]["mean"]
    route = drafter_route(part.get("engine", {}))  # an A/B sweep holds both routes' rows
    rows = [r for r in sweep["spec"] if r["lanes"] == lanes and drafter_route(r) == route]
    if not rows:
        return {}
    near = min({r["context"] for r in rows}, key=lambda c: abs(c - context))
    ms = {r["num_draft"]: r["iteration_ms"] for r in rows if r["context"] == near}
    if width(part) not in ms:
        return {}
    return {n: t / ms[width(part)] for n, t in ms.items()}


def model(parts: dict, solo_tau: float, sweep: dict | None = None,
          prefill_speedup: float = 1.0) -> dict:
    alphas = workload_alphas(parts, solo_tau)
    taus, ratios, widths = {}, {}, {}
    for w in WORKLOADS:
        costs = {width(parts[w]): 1.0}
        if sweep is not None and w != "solo":  # solo verifies all 7 on its decode kernels
            costs.update(width_costs(sweep, parts[w]))
        def ratio(n):
            return workload_ratio(parts[w], float(tau_at(alphas[w], n)), costs[n], prefill_speedup)
        best = max(costs, key=ratio)
        widths[w], taus[w], ratios[w] = best, float(tau_at(alphas[w], best)), ratio(best)
    return {"solo_tau": solo_tau, "taus": taus, "widths": widths, "ratios": ratios,
            "specscore": geometric_mean([ratios[w] for w in WORKLOADS])}


def solo_tau_for(parts: dict, target: float, sweep: dict | None = None,
                 prefill_speedup: float = 1.0) -> float | None:
    """The least solo tau whose modelled SpecScore reaches `target`; None if even a drafter
    that is always accepted (tau = drafts + 1 at every width) does not."""
    top = width(parts["solo"]) + 1
    score = lambda t: model(parts, t, sweep, prefill_speedup)["specscore"]
    if score(top) < target:
        return None
    lo, hi = 1.0, float(top)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if score(mid) < target else (lo, mid)
    return hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", required=True, help="a bench run's parts/ folder")
    ap.add_argument("--solo-taus", default="2.5,3,3.5,4,4.5,5,6,7,8",
                    help="comma list of solo's tokens per verify step to model")
    ap.add_argument("--target", type=float, default=2.4, help="the SpecScore to solve for")
    ap.add_argument("--width-sweep", help="bench_steps.py JSON with spec rows at several "
                    "--num-draft: team and busy may then verify any of its widths")
    ap.add_argument("--prefill-speedup", type=float, default=1.0,
                    help="both engines' prefill this many times faster (what-if; 1 = as measured)")
    ap.add_argument("--out", help="JSON record of the table")
    args = ap.parse_args(argv)
    try:
        taus = [float(t) for t in args.solo_taus.split(",")]
    except ValueError:
        ap.error(f"--solo-taus: not a comma list of numbers: {args.solo_taus!r}")
    parts = read_parts(Path(args.parts))
    if not args.prefill_speedup >= 1.0:
        ap.error(f"--prefill-speedup must be >= 1, got {args.prefill_speedup}")
    sweep = json.loads(Path(args.width_sweep).read_text()) if args.width_sweep else None
    top = width(parts["solo"]) + 1
    if any(not 1.0 <= t <= top for t in taus):
        ap.error(f"--solo-taus: each must be in [1, {top}] (solo verifies {top - 1} drafts)")

    rows = [model(parts, t, sweep, args.prefill_speedup) for t in taus]
    measured = {w: parts[w]["verify"]["tau"] for w in WORKLOADS}
    print(f"measured tau: " + ", ".join(f"{w} {measured[w]:.3f}" for w in WORKLOADS))
    print("| solo tau | team tau (drafts) | busy tau (drafts) | solo | team | busy | SpecScore |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t, q, n = r["taus"], r["ratios"], r["widths"]
        print(f"| {t['solo']:.2f} | {t['team']:.2f} ({n['team']}) | {t['busy']:.2f} ({n['busy']}) | "
              f"{q['solo']:.2f} | {q['team']:.2f} | {q['busy']:.2f} | {r['specscore']:.3f} |")
    need = solo_tau_for(parts, args.target, sweep, args.prefill_speedup)
    print(f"SpecScore {args.target}: " + (f"solo tau {need:.2f}" if need is not None else
                                        "not reached even when every draft is accepted"))
    if args.out:
        Path(args.out).write_text(json.dumps({"parts": args.parts, "width_sweep": args.width_sweep,
                                              "prefill_speedup": args.prefill_speedup,
                                              "measured_tau": measured,
                                              "rows": rows, "target": args.target,
                                              "solo_tau_for_target": need}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
