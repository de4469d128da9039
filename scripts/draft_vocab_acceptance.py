"""What a draft vocabulary (EngineConfig.draft_vocab) does to acceptance: tokens per verify step
of the shipped stand-in pair through the engine, with the whole vocabulary and with the N most
frequent ids, on the first humaneval + mbpp turns (chat template), same seeds for every N.

  python scripts/draft_vocab_acceptance.py --limit 20 --sizes 0,24574,8192,2048 --out dv.json

Size 0 means the whole vocabulary. Acceptance, not speed, is the point (run it on a CPU as well as
a GPU): the output law is the same for every size (tests/test_draft_vocab.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def acceptance_run(llm, prompts, params, *, chat: bool) -> dict:
    """Generate `prompts` once (timed) and pool tokens per verify step over the replies."""
    t = time.perf_counter()
    out = llm.generate(prompts, params, chat=chat)
    wall = time.perf_counter() - t
    spec = [r for r in out if r.tokens_per_step]
    # A reply's first token comes from prefill; the rest from verify steps.
    committed = sum(len(r.token_ids) - 1 for r in spec)
    verify_steps = sum((len(r.token_ids) - 1) / r.tokens_per_step for r in spec)
    # At T = 1 the sampled tokens' mean -log p estimates the target's entropy per token: how
    # predictable the replies are to any drafter.
    logprobs = [lp for r in out for lp in r.logprobs[1:]]
    return {"tokens": sum(len(r.token_ids) for r in out), "wall_s": wall,
            "target_nll_per_token": -sum(logprobs) / max(len(logprobs), 1),
            "tokens_per_step": committed / verify_steps,
            "tokens_per_step_mean_of_replies": statistics.mean(r.tokens_per_step for r in spec),
            "acceptance_per_position": [statistics.mean(p) for p in zip(
                *[r.acceptance_per_position for r in out if r.acceptance_per_position])]}


def record_run(rec: dict, run: dict, path: str) -> None:
    """Append one run to the record, print it, and rewrite the record (a cut-off run keeps the
    runs before it)."""
    rec["runs"].append(run)
    print(json.dumps(run), flush=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=2)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="standin")
    ap.add_argument("--draft", default="standin-dspark")
    ap.add_argument("--sets", default="humaneval,mbpp")
    ap.add_argument("--limit", type=int, default=20, help="first N prompts of each set")
    ap.add_argument("--sizes", default="0,24574,8192,2048", help="draft vocabulary sizes (0: all)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-lanes", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import jax

    from jspec.api import LLM, SamplingParams
    from jspec.prompts import first_turn, load_prompts

    texts = [first_turn(r) for s in args.sets.split(",") for r in load_prompts(s, args.limit)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
              for i in range(len(texts))]
    rec = {"model": args.model, "draft": args.draft, "prompts": len(texts),
           "temperature": args.temperature, "max_tokens": args.max_tokens,
           "backend": jax.default_backend(), "jax": jax.__version__, "runs": []}
    for size in [int(s) for s in args.sizes.split(",")]:
        llm = LLM(args.model, draft=args.draft, draft_vocab=size or None,
                  max_lanes=args.max_lanes, max_context=2048)
        llm.generate(texts[:1], params[0], chat=True)  # compile
        record_run(rec, {"draft_vocab": size or None, **acceptance_run(llm, texts, params, chat=True)},
                   args.out)
    return rec


if __name__ == "__main__":
    main()
