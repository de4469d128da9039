"""The transformers + PyTorch peer: batch-1 greedy decode with a static cache and torch.compile,
random bf16 weights of the given checkpoint directory, 512-token prompt.

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
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device="cuda")
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              pad_token_id=0)
    rec = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(), "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "mode": "static cache + torch.compile(reduce-overhead)"}
    t = time.time()
    with torch.no_grad():
        model.generate(ids, **kw)  # compile + warm-up
        torch.cuda.synchronize()
        rec["warmup_s"] = time.time() - t
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        # Prefill share: one generate of a single token.
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
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
