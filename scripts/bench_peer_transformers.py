"""The transformers + PyTorch peer: batch-1 greedy decode with a static cache and torch.compile,
random bf16 weights of the given checkpoint directory, 512-token prompt.

Compilation is transformers' own: `generate` with a static cache compiles the forward itself
(CompileConfig, torch.compile mode "reduce-overhead", i.e. CUDA graphs) and marks each CUDA-graph
step. Wrapping `model.forward` in torch.compile by hand, the recipe older transformers documented,
fails under transformers 5.x (measured on the H200 with 5.17: the static cache's index_copy_
writes into a CUDA-graph output that the next replay overwrites).

  python3 scripts/bench_peer_transformers.py --model /tmp/q8b --out $OUT/peer.json
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks "
                    "that the script runs (transformers does not compile there)")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, CompileConfig

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = compile_config = CompileConfig(mode="reduce-overhead")
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device=args.device)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              pad_token_id=0)
    rec = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens,
           "mode": "static cache; generate's auto-compile: torch.compile(mode=%r, fullgraph=%r)"
                   % (compile_config.mode, compile_config.fullgraph) if cuda else
                   "static cache, not compiled (cpu: a run check, not a measurement)"}
    t = time.time()
    with torch.no_grad():
        model.generate(ids, **kw)  # compile + warm-up
        sync()
        rec["warmup_s"] = time.time() - t
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            sync()
            times.append(time.perf_counter() - t)
        # Prefill share: one generate of a single token.
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        sync()
        prefill_s = time.perf_counter() - t
    med = sorted(times)[1]
    rec.update(generate_s=med, prefill_s=prefill_s, new_tokens_out=int(out.shape[1] - args.prompt_len),
               tokens_per_s_end_to_end=args.new_tokens / med,
               tokens_per_s_decode=(args.new_tokens - 1) / max(med - prefill_s, 1e-9))
    print(json.dumps(rec, indent=2))
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=2)


if __name__ == "__main__":
    main()
