"""DSpark's prefix rule on a trained pair: tokens per verify step (tau) and drafts verified per
step at several confidence thresholds, through the engine, at T = 1 on the humaneval + mbpp
first turns (chat template). Every threshold runs the same prompts and seeds.

With a cost table of the speculative iteration against its verify rows (scripts/bench_steps.py
--num-draft, on the GPU), it also prints what each threshold would give per unit of time at a
lane count: tau / iteration_ms(rows), rows = lanes x (1 + drafts per step) rounded up to the
engine's static verify size (jspec.spec_steps.verify_buckets). That is an estimate from two
measurements, not a benchmark: `jspec bench --verify-threshold` is.

  python scripts/verify_gate_acceptance.py --prompts-dir ../shared/data/prompts --limit 10 \\
      --thresholds 0,0.05,0.1,0.2,0.3 --out gate.json [--cost width_sweep.json --lanes 16,32]
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


def add_cost_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that price a probe's result with a GPU cost sweep (bench_steps.py JSON)."""
    ap.add_argument("--cost", help="bench_steps.py JSON with --num-draft rows (optional)")
    ap.add_argument("--lanes", default="16,32", help="lane counts to estimate at (with --cost)")
    ap.add_argument("--contexts", default="512,3072", help="the cost table's context per lane "
                    "count, in the same order")


def cost_by_rows(cost: dict, lanes: int, context: int) -> dict[int, float]:
    """{verify rows: iteration ms} of the cost sweep's speculative rows at `lanes` and `context`."""
    return {r["verify_rows"]: r["iteration_ms"] for r in cost.get("spec", [])
            if r["lanes"] == lanes and r["context"] == context and "iteration_ms" in r}


def estimate(record: dict, cost: dict, lanes: int, context: int) -> dict | None:
    """tau / iteration_ms at the bucket that holds lanes x (1 + drafts per step) rows, from the
    cost sweep's rows at this lane count and context."""
    from jspec.spec_steps import verify_buckets
    rows_cost = cost_by_rows(cost, lanes, context)
    if not rows_cost:
        return None
    need = lanes * (1 + record["drafts_per_step"])
    bucket = next(b for b in verify_buckets(lanes, 8) if b >= need - 1e-9)
    known = sorted(rows_cost)
    at = next((r for r in known if r >= bucket), known[-1])  # the nearest measured size above
    return {"lanes": lanes, "context": context, "rows": bucket, "cost_rows": at,
            "iteration_ms": rows_cost[at], "tokens_per_ms": record["tau"] / rows_cost[at]}


def code_first_turns(prompts_dir: str, limit: int) -> list[str]:
    """The first `limit` HumanEval and MBPP first turns (the issue's code prompts)."""
    from jspec.prompts import first_turn, load_prompts
    return [first_turn(r) for name in ("humaneval", "mbpp")
            for r in load_prompts(Path(prompts_dir) / f"{name}.jsonl", limit=limit)]


def add_t1_probe_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every T = 1 probe on the code prompts takes."""
    ap.add_argument("--target", default="standin")
    ap.add_argument("--draft", default="standin-dspark")
    ap.add_argument("--prompts-dir", required=True)
    ap.add_argument("--limit", type=int, default=10, help="first N prompts of each set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)


def t1_record(args, prompts: list[str], reqs: list) -> dict:
    """What a T = 1 run measured: tau over its verify steps, their histogram (tokens 1..8), and
    per prompt, in prompt order, the tokens and steps compare_drafters.paired_tau_ratio pairs."""
    steps = [n for r in reqs for n in r.step_tokens]
    return {"target": args.target, "draft": args.draft, "prompts": len(prompts),
            "max_tokens": args.max_tokens, "temperature": 1.0, "verify_steps": len(steps),
            "tokens": sum(steps), "tau": sum(steps) / len(steps),
            "tokens_histogram": [steps.count(k) for k in range(1, 9)],
            "per_request": {"tokens": [sum(r.step_tokens) for r in reqs],
                            "steps": [len(r.step_tokens) for r in reqs]}}


def matched_rounds(reqs: list, rounds: dict) -> tuple[list, int]:
    """What a probe recorded at each verify round a request really ran, in order: rounds maps
    (seed, first position) to a value; the first positions come from the request's step sizes.
    Returns (values, rounds missing)."""
    values, missing = [], 0
    for r in reqs:
        start = len(r.prompt_ids) + np.concatenate([[0], np.cumsum(r.step_tokens)[:-1]])
        for pos in start + 1:
            got = rounds.get((int(r.seed), int(pos)))
            if got is None:
                missing += 1
            else:
                values.append(got)
    return values, missing


def token_rule_survival(target_lp, draft_lp, drafts, num_draft, xp=None):
    """P(drafts 1..k all accepted) under the token rule, [B, K]: prod_{i <= k} min(1,
    p_i(x_i) / q_i(x_i)), 0 past num_draft. target_lp [B, K+1, V] and draft_lp [B, K, V] are
    log-probs, drafts [B, K], num_draft [B]. xp: numpy (host, the default) or jax.numpy (traced)."""
    xp = np if xp is None else xp
    K = drafts.shape[1]
    tok = xp.clip(drafts, 0, target_lp.shape[-1] - 1)[..., None]
    log_ratio = (xp.take_along_axis(target_lp[:, :K], tok, -1)[..., 0]
                 - xp.take_along_axis(draft_lp, tok, -1)[..., 0])
    proposed = xp.arange(K)[None] < xp.clip(num_draft, 0, K)[:, None]
    return xp.cumprod(xp.where(proposed, xp.exp(xp.minimum(log_ratio, 0.0)), 0.0), axis=1)


def probe_rounds(args, traced, host, verify_rule: str):
    """Generate the T = 1 code prompts (generate_t1) with a probe at every verify round.

    traced(target_logits, q, drafts, num_draft, arrays) runs inside the jitted step and returns
    a tuple of per-lane arrays; host(*those, as numpy) returns one value per lane, recorded by
    (seed, first drafted position). The engine's rejection_sample is patched only for this run.
    Returns (prompts, requests, the values of the rounds the requests ran, rounds missing, wall s).
    """
    import jax
    import jspec.spec_steps as spec_steps
    from jspec import LLM

    rounds = {}

    def record(seeds, positions, *outs):
        for s, pos, value in zip(np.asarray(seeds), np.asarray(positions),
                                 host(*[np.asarray(o) for o in outs])):
            rounds[(int(s), int(pos))] = value

    base = spec_steps.rejection_sample

    def probed(target_logits, q, drafts, num_draft, arrays, positions, rule="token"):
        outs = traced(target_logits, q, drafts, num_draft, arrays)
        jax.debug.callback(record, arrays.seed, positions, *outs)
        return base(target_logits, q, drafts, num_draft, arrays, positions, rule=rule)

    prompts = code_first_turns(args.prompts_dir, args.limit)
    spec_steps.rejection_sample = probed
    try:
        llm = LLM(args.target, draft=args.draft, max_lanes=8, verify_rule=verify_rule)
        t = time.time()
        reqs = generate_t1(llm, prompts, args.max_tokens)
        wall = time.time() - t
    finally:
        spec_steps.rejection_sample = base
    got, missing = matched_rounds(reqs, rounds)
    return prompts, reqs, got, missing, wall


def generate_t1(llm, prompts: list[str], max_tokens: int) -> list:
    """Every prompt in the chat template at T = 1, seeds 1000 + i: the requests, after the run."""
    from jspec import SamplingParams
    ids = [llm.encode_prompt(p, chat=True) for p in prompts]
    reqs = [llm.make_request(p, SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                               seed=1000 + i), i) for i, p in enumerate(ids)]
    llm.engine.generate(reqs)
    return reqs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_t1_probe_arguments(ap)
    ap.add_argument("--thresholds", default="0,0.05,0.1,0.2,0.3")
    ap.add_argument("--lanes-engine", type=int, default=8, help="the engine's lanes (CPU: few)")
    add_cost_arguments(ap)
    args = ap.parse_args(argv)

    from jspec import LLM

    prompts = code_first_turns(args.prompts_dir, args.limit)
    rec = {"target": args.target, "draft": args.draft, "prompts": len(prompts),
           "max_tokens": args.max_tokens, "temperature": 1.0, "runs": []}
    cost = json.loads(Path(args.cost).read_text()) if args.cost else None
    for threshold in [float(t) for t in args.thresholds.split(",")]:
        llm = LLM(args.target, draft=args.draft, max_lanes=args.lanes_engine,
                  verify_threshold=threshold)
        t = time.time()
        reqs = generate_t1(llm, prompts, args.max_tokens)
        steps = [n for r in reqs for n in r.step_tokens]
        drafts = [d for r in reqs for d in r.step_drafts]
        run = {"threshold": threshold, "verify_steps": len(steps), "tokens": sum(steps),
               "tau": sum(steps) / len(steps), "drafts_per_step": sum(drafts) / len(drafts),
               "draft_histogram": [drafts.count(k) for k in range(8)],
               # tokens committed per step (1..8): with the whole block verified, tau at any
               # fixed width n follows: 1 + sum_{k <= n} P(tokens > k)
               "tokens_histogram": [steps.count(k) for k in range(1, 9)],
               "wall_s": time.time() - t}
        if cost:
            run["estimates"] = [estimate(run, cost, int(lanes), int(ctx)) for lanes, ctx in
                                zip(args.lanes.split(","), args.contexts.split(","))]
        rec["runs"].append(run)
        print(json.dumps(run), flush=True)
        Path(args.out).write_text(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
