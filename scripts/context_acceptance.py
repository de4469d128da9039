"""Does the drafter's acceptance fall with the context length? Tokens per verify step of the
shipped stand-in pair through the engine on prompts built as the bench's busy workload builds
them (consecutive humaneval + mbpp first turns concatenated into one chat prompt of at least N
tokens, jspec.bench.workloads.concatenated_prompts), for several N, same seeds for every N.

  python scripts/context_acceptance.py --count 12 --min-tokens 0,1000,1800,3000 --out ctx.json

N = 0 means the plain first turns (no concatenation). The drafters train on sequences of at most
2048 positions (prompt <= 1024 + reply <= 512), while busy prompts hold >= 3000 tokens: a fall
past 2048 that the 1800-token prompts do not show points at the positions, not the content.
"""

from __future__ import annotations

import argparse
import json

from draft_vocab_acceptance import acceptance_run, record_run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="standin")
    ap.add_argument("--draft", default="standin-dspark")
    ap.add_argument("--count", type=int, default=12, help="prompts per length")
    ap.add_argument("--min-tokens", default="0,1000,1800,3000")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-lanes", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import jax

    from jspec.api import LLM, SamplingParams
    from jspec.bench.workloads import chat_ids, concatenated_prompts, prompt_texts

    llm = LLM(args.model, draft=args.draft, max_lanes=args.max_lanes, max_context=args.max_context)
    tok = llm.tokenizer
    texts = prompt_texts(("humaneval", "mbpp"))
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
              for i in range(args.count)]
    rec = {"model": args.model, "draft": args.draft, "count": args.count,
           "temperature": args.temperature, "max_tokens": args.max_tokens,
           "backend": jax.default_backend(), "jax": jax.__version__, "runs": []}
    llm.generate([chat_ids(tok, texts[0])], params[0], chat=False)  # compile
    for n in [int(s) for s in args.min_tokens.split(",")]:
        prompts = (concatenated_prompts(tok, texts, args.count, n) if n
                   else [chat_ids(tok, t) for t in texts[:args.count]])
        lens = [len(p) for p in prompts]
        if max(lens) + args.max_tokens > args.max_context:
            raise SystemExit(f"--min-tokens {n}: a prompt of {max(lens)} tokens + {args.max_tokens} "
                             f"new ones exceeds --max-context {args.max_context}")
        record_run(rec, {"min_tokens": n, "prompt_tokens_mean": sum(lens) / len(lens),
                         **acceptance_run(llm, prompts, params, chat=False)}, args.out)
    return rec


if __name__ == "__main__":
    main()
