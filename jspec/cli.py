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
              max_lanes=args.max_lanes, max_context=args.max_context, attn_impl=args.attn_impl,
              batch_invariant=args.batch_invariant, draft_kv_dtype=args.draft_kv_dtype,
              draft_weight_dtype=args.draft_weight_dtype, draft_linear=args.draft_linear,
              draft_vocab=args.draft_vocab, verify_threshold=args.verify_threshold,
              verify_rule=args.verify_rule)
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


def _cmd_demo(args) -> int:
    """Stock and speculative greedy decoding of the same prompts: text, speed, tokens per verify
    step, and whether the two outputs are token-identical (exit 1 if not: a losslessness bug)."""
    import json
    import time

    from jspec.api import LLM, SamplingParams
    from jspec.standin import demo_prompts, resolve_drafter, resolve_model
    from jspec.tokenizer import Tokenizer

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    texts = _read_prompt_file(args.prompts) if args.prompts else demo_prompts()
    if not texts or not all(texts):
        raise ValueError("the prompts must be non-empty")
    model, draft = resolve_model(args.model), resolve_drafter(args.draft)
    tokenizer = Tokenizer.from_dir(model)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])
                                if args.chat else t) for t in texts]
    page = 16
    # Small engine knobs: a few lanes, a page pool just big enough for these prompts.
    knobs = dict(max_lanes=min(len(prompts), 4), page_size=page, prefill_chunk=128,
                 max_context=-(-(max(map(len, prompts)) + args.max_tokens + 16) // page) * page)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))

    def run(what, llm):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, seed=0))  # compile
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        log(f"{what}: {sum(len(r.token_ids) for r in results)} tokens in {seconds:.2f} s")
        return results, seconds

    log(f"loading {args.model} ({model})")
    stock, stock_s = run("stock", LLM(model, **knobs))
    log(f"loading {args.model} + {args.draft} ({draft})")
    spec, spec_s = run("speculative", LLM(model, draft=draft,
                                          num_draft_tokens=args.num_draft_tokens, **knobs))
    n_stock = sum(len(r.token_ids) for r in stock)
    n_spec = sum(len(r.token_ids) for r in spec)
    # Verify steps per request: its tokens / its mean tokens per step; overall = tokens / steps.
    steps = sum(len(r.token_ids) / r.tokens_per_step for r in spec if r.tokens_per_step)
    matches = [a.token_ids == b.token_ids for a, b in zip(stock, spec)]
    import jax
    summary = {"model": str(args.model), "draft": str(args.draft), "max_tokens": args.max_tokens,
               "device": jax.default_backend(),
               "stock_tokens_per_s": n_stock / stock_s, "spec_tokens_per_s": n_spec / spec_s,
               "speedup": (n_spec / spec_s) / (n_stock / stock_s),
               "tokens_per_step": n_spec / steps if steps else None,
               "greedy_match": all(matches)}
    if args.json:
        for text, a, b, same in zip(texts, stock, spec, matches):
            print(json.dumps({"prompt": text, "text": b.text, "token_ids": b.token_ids,
                              "stock_token_ids": a.token_ids, "match": same,
                              "tokens_per_step": b.tokens_per_step}), flush=True)
        print(json.dumps(summary), flush=True)
    else:
        for i, (text, a, b, same) in enumerate(zip(texts, stock, spec, matches)):
            tps = f"{b.tokens_per_step:.2f}" if b.tokens_per_step else "-"
            print(f"=== prompt {i}\n{text}")
            print(f"--- reply ({len(b.token_ids)} tokens, {tps} tokens per verify step, "
                  f"{'identical to stock' if same else 'DIFFERS FROM STOCK'})")
            print(b.text, flush=True)
        print(f"=== stock {summary['stock_tokens_per_s']:.1f} tokens/s, speculative "
              f"{summary['spec_tokens_per_s']:.1f} tokens/s ({summary['speedup']:.2f}x), "
              f"{summary['tokens_per_step'] or 0:.2f} tokens per verify step, on {summary['device']}")
        print("greedy outputs match token for token" if all(matches) else
              f"greedy outputs DIFFER for prompt(s) {[i for i, m in enumerate(matches) if not m]}: "
              "speculative decoding was not lossless")
    return 0 if all(matches) else 1


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
    p.add_argument("--model", required=True, help="model directory (Hugging Face or jspec), or "
                   "standin (the shipped stand-in)")
    p.add_argument("--draft", help="DSpark / DFlash drafter directory (or standin-dspark, "
                   "standin-dflash): speculative decoding")
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
    p.add_argument("--batch-invariant", action="store_true", help="GPU: batch-invariant target "
                   "kernels (a request's numbers never depend on its batch or the verify width)")
    p.add_argument("--draft-kv-dtype", choices=["float8_e4m3fn"], help="with --draft: the "
                   "drafter's KV pool dtype (default: the model's); float8_e4m3fn halves it and "
                   "changes acceptance only, never the output distribution")
    p.add_argument("--draft-weight-dtype", choices=["int8"], help="with --draft: store the "
                   "drafter's layers, fc and Markov W2 as int8 with a scale per output channel "
                   "(half their reads); changes acceptance only, never the output distribution")
    p.add_argument("--draft-linear", default="xla", choices=["xla", "triton"], help="with "
                   "--draft: the drafter's matmuls on XLA's GEMMs (the default) or, on a GPU, "
                   "jspec's linear kernel, which reads int8 weights itself; speed only, never "
                   "the output distribution")
    p.add_argument("--draft-vocab", type=int, metavar="N", help="with --draft: the drafter "
                   "proposes only the N most frequent ids (ranked in DRAFT/draft_vocab.json); "
                   "changes acceptance only, never the output distribution")
    p.add_argument("--verify-threshold", type=float, default=0.0, metavar="T", help="with a "
                   "DSpark --draft: verify only the drafts whose cumulative confidence stays >= T "
                   "(0, the default: every draft); fewer verify rows, the same output law")
    p.add_argument("--verify-rule", default="block", choices=["block", "token"], help="with "
                   "--draft: decide the accept length by block verification (the default; never "
                   "fewer accepted drafts in expectation) or draft by draft; both lossless")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=_cmd_generate)

    from jspec.bench.run import add_bench_parser
    add_bench_parser(sub)

    p = sub.add_parser("demo", help="the shipped stand-in: stock vs speculative greedy decoding of "
                       "three HumanEval prompts, speed and token-for-token match")
    p.add_argument("--model", default="standin", help="target (default: standin)")
    p.add_argument("--draft", default="standin-dspark", help="drafter (default: standin-dspark; "
                   "standin-dflash is the DFlash ablation)")
    p.add_argument("--prompts", help="JSONL file of {\"turns\": [...]} records (first turn used; "
                   "default: HumanEval/0, /2, /4)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the Qwen3 chat template (default: on, as the stand-in is "
                   "trained and benchmarked)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, help="tokens proposed per step (default: "
                   "the drafter's block size)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then a summary")
    p.set_defaults(func=_cmd_demo)
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
