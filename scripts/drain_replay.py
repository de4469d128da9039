"""How many speculative iterations a bench workload spends draining, and what sharing the verify
rows among the lanes still running would save (a CPU replay of a bench record).

A workload gives each lane a new prompt while the queue lasts (at dispatch boundaries, every
`--steps` iterations); after that the lanes drain. A stock lane needs one step a token, so
replies capped at the same length finish together. A speculative lane needs reply / tau_r
iterations, and tau_r varies by request, so the drain runs at a few lanes while the verify keeps
every lane's rows. This replay schedules the bench's own reply lengths (a record's parts/<w>.json,
the speculative engine's replies, by pass) over its lanes:

  fixed      every active lane verifies K drafts (the bench's --num-draft-tokens)
  shared     the lanes' rows R = lanes x (K + 1) are split among the active lanes:
             min(7, R // active - 1) drafts each (never more rows than the fixed verify)

The shared count depends only on how many lanes are active when the iteration starts, never on
its drafts, so the rejection sampler stays exact (though a request's tokens then depend on the
other lanes' timing, not only on its own seed). Acceptance is modelled per request: drafts are
accepted one after another with a request's own rate alpha_r until the first rejection (block
verification accepts about that prefix), alpha_r drawn from an acceptance eval's per-request
tokens per verify step (standin_acceptance.py, 7 drafts) and scaled so that the mean tau at K
drafts equals the record's. Both policies read the same uniforms (request, round, position), so
their difference is not sampling noise. An estimate from a model of acceptance, not a
measurement: it prices no iteration (the shared verify reads more query rows per lane in
attention and samples 7 drafts, not K).

  python scripts/drain_replay.py --record docs/results/2026-12-04-8b-bench-drafter2/parts/busy.json \\
      --eval docs/results/2026-12-04-gpu-cost-probes/shipped_eval_all.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

MAX_DRAFTS = 7


def tau_at(alpha, n):
    """Tokens per round with n drafts when each is accepted with probability alpha after the
    one before it: 1 + alpha + ... + alpha^n."""
    alpha = np.asarray(alpha, dtype=np.float64)
    return np.sum([alpha ** i for i in range(n + 1)], axis=0)


def solve_alpha(tau, n, tol=1e-10):
    """alpha in [0, 1) with tau_at(alpha, n) == tau (clipped into the reachable 1 .. n + 1)."""
    tau = float(np.clip(tau, 1.0, n + 1 - 1e-6))
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_at(mid, n) < tau else (lo, mid)
    return lo


def scale_to_mean_tau(alphas, target, n):
    """alphas x c (clipped below 1) whose mean tau at n drafts is `target`."""
    lo, hi = 0.0, 1.0 / max(float(np.max(alphas)), 1e-9)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(tau_at(np.minimum(alphas * mid, 0.999), n)) < target else (lo, mid)
    return np.minimum(alphas * lo, 0.999)


def shared_drafts(active: int, lanes: int, num_draft: int) -> int:
    """Drafts per active lane when the fixed verify's rows are split among `active` lanes."""
    return min(MAX_DRAFTS, lanes * (num_draft + 1) // active - 1)


def schedule(reply_tokens, alphas, uniforms, *, lanes, num_draft, steps, policy):
    """Replay one pass: requests in order, admitted at dispatch boundaries. Returns
    (iterations, active lanes per iteration). uniforms[r, t, k]: request r's round t, draft k."""
    remaining = np.asarray(reply_tokens, dtype=np.int64).copy()
    rounds = np.zeros(len(remaining), dtype=np.int64)
    queue = list(range(len(remaining)))
    slot = [None] * lanes
    active_per_iteration = []
    while True:
        for i in range(lanes):
            if slot[i] is None and queue:
                slot[i] = queue.pop(0)
        if all(s is None for s in slot):
            break
        for _ in range(steps):
            running = [i for i in range(lanes) if slot[i] is not None]
            if not running:
                break
            n = num_draft if policy == "fixed" else shared_drafts(len(running), lanes, num_draft)
            active_per_iteration.append(len(running))
            for i in running:
                r = slot[i]
                u = uniforms[r, rounds[r]]
                accepted = 0
                while accepted < n and u[accepted] < alphas[r]:
                    accepted += 1
                rounds[r] += 1
                remaining[r] -= accepted + 1
                if remaining[r] <= 0:
                    slot[i] = None
    return len(active_per_iteration), np.asarray(active_per_iteration)


def replay(record: dict, eval_taus, *, steps: int = 8, seeds: int = 4) -> list[dict]:
    lanes = int(record["engine"]["max_lanes"])
    num_draft = int(record["engine"]["num_draft_tokens"])
    target_tau = float(record["verify"]["tau"])
    base = np.array([solve_alpha(t, MAX_DRAFTS) for t in eval_taus])
    rows = []
    passes = sorted({r["pass"] for r in record["replies"] if r["engine"] == "spec"})
    for p in passes:
        replies = sorted((r for r in record["replies"] if r["engine"] == "spec" and r["pass"] == p),
                         key=lambda r: r["prompt"])
        tokens = [r["n"] for r in replies]
        measured = next((q for q in record["passes"] if q["engine"] == "spec" and q["index"] == p), None)
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            alphas = scale_to_mean_tau(rng.choice(base, len(tokens)), target_tau, num_draft)
            uniforms = rng.random((len(tokens), max(tokens) + 1, MAX_DRAFTS))
            out = {"pass": p, "seed": seed,
                   "measured_iterations": None if measured is None else
                   measured["engine_time"]["decode_dispatches"] * steps}
            for policy in ("fixed", "shared"):
                n, active = schedule(tokens, alphas, uniforms, lanes=lanes, num_draft=num_draft,
                                     steps=steps, policy=policy)
                out[policy] = {"iterations": n, "lane_use": float(active.mean() / lanes),
                               "share_at_half_lanes_or_fewer": float(np.mean(active <= lanes // 2))}
            rows.append(out)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", required=True, help="a bench part: parts/team.json or busy.json")
    ap.add_argument("--eval", required=True, help="standin_acceptance.py output (per-request tau)")
    ap.add_argument("--drafter", default="dspark_t1", help="which eval entry gives the taus")
    ap.add_argument("--steps", type=int, default=8, help="speculative iterations per dispatch")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    record = json.load(open(args.record))
    per_request = json.load(open(args.eval))[args.drafter]["per_request"]
    taus = np.asarray(per_request["tokens"], float) / np.asarray(per_request["steps"], float)
    rows = replay(record, taus, steps=args.steps, seeds=args.seeds)
    lanes, k = record["engine"]["max_lanes"], record["engine"]["num_draft_tokens"]
    print(f"{record['part']}: {lanes} lanes, {k} drafts, tau {record['verify']['tau']:.3f}")
    print("| pass | measured iterations | fixed: iterations | lane use | iterations at <= half the lanes "
          "| shared: iterations | saved |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for p in sorted({r["pass"] for r in rows}):
        sel = [r for r in rows if r["pass"] == p]
        f = np.mean([r["fixed"]["iterations"] for r in sel])
        s = np.mean([r["shared"]["iterations"] for r in sel])
        use = np.mean([r["fixed"]["lane_use"] for r in sel])
        half = np.mean([r["fixed"]["share_at_half_lanes_or_fewer"] for r in sel])
        print(f"| {p} | {sel[0]['measured_iterations']} | {f:.1f} | {use:.3f} | {half:.3f} | {s:.1f} "
              f"| {1 - s / f:.3f} |")
    f = np.mean([r["fixed"]["iterations"] for r in rows])
    s = np.mean([r["shared"]["iterations"] for r in rows])
    print(f"all passes: shared saves {1 - s / f:.3f} of the fixed policy's iterations")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"record": args.record, "eval": args.eval, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
