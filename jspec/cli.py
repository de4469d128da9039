"""The `jspec` command line: convert | generate | bench | demo."""

from __future__ import annotations

import argparse
import sys


def _cmd_convert(args) -> int:
    from jspec.convert.hf_to_jspec import convert_checkpoint
    dst = convert_checkpoint(args.src, args.dst, force=args.force, dtype=args.dtype,
                             progress=not args.quiet)
    print(f"wrote {dst}")
    return 0


def _read_prompt_file(path: str) -> list[str]:
    from jspec.prompts import first_turn, load_prompts
    return [first_turn(r) for r in load_prompts(path)]


def _cmd_generate(args) -> int:
    import json

    from jspec.api import LLM, SamplingParams

    if not args.prompt and not args.prompts:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    prompts = list(args.prompt or []) + (_read_prompt_file(args.prompts) if args.prompts else [])
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                            ignore_eos=args.ignore_eos)
    llm = LLM(args.model, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
              max_lanes=args.max_lanes, max_context=args.max_context, attn_impl=args.attn_impl)
    stream = not args.json and len(prompts) == 1

    def on_text(i, text):
        print(text, end="", flush=True)

    results = llm.generate(prompts, params, chat=args.chat, on_text=on_text if stream else None)
    for i, r in enumerate(results):
        if args.json:
            record = {"prompt": r.prompt, "text": r.text, "token_ids": r.token_ids,
                      "logprobs": r.logprobs, "finish_reason": r.finish_reason,
                      "num_prompt_tokens": len(r.prompt_token_ids)}
            if r.tokens_per_step is not None:
                record.update(tokens_per_step=r.tokens_per_step,
                              acceptance_per_position=r.acceptance_per_position)
            print(json.dumps(record), flush=True)
        elif stream:
            print()
            if r.tokens_per_step is not None:
                print(f"[{r.tokens_per_step:.2f} tokens per verify step]", file=sys.stderr)
        else:
            print(f"=== prompt {i} ({r.finish_reason}, {len(r.token_ids)} tokens)")
            print(r.text, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description="Lossless DSpark speculative "
                                     "decoding for Qwen3 in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="Hugging Face checkpoint directory -> jspec (Orbax) directory")
    p.add_argument("src", help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("dst", help="output directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="store weights in this dtype (default: the checkpoint's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("--model", required=True, help="model directory (Hugging Face or jspec)")
    p.add_argument("--draft", help="DSpark / DFlash drafter directory: speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, help="tokens proposed per step (default: "
                   "the drafter's block size)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--prompts", help="JSONL file of {\"turns\": [...]} records (first turn used)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the Qwen3 chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-lanes", type=int, default=8)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--attn-impl", default="auto", choices=["auto", "xla", "triton"])
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=_cmd_generate)

    from jspec.bench.run import add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("jspec: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileExistsError, FileNotFoundError, NotADirectoryError) as e:
        # ConfigError and CheckpointError are ValueErrors: one line naming the problem.
        print(f"jspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
