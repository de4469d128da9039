"""The transformers + PyTorch peer at solo: the external yardstick for stock (protocol section 1).

Run as a subprocess by `jspec bench` (so that PyTorch and JAX never share the GPU in one process):

    python -m jspec.bench.peer --job job.json --out peer.json

job.json: {"model": HF dir, "prompts": [[ids]...], "max_new_tokens", "sampling": {temperature,
top_k, top_p}, "seeds": [[per prompt] per pass], "eos_ids", "passes"}. The same token ids as
jspec's solo workload, one prompt after another, EOS honoured; throughput = generated tokens /
wall time of the pass (prefill included), median of the timed passes after a full untimed pass
(which compiles every prompt shape). On CUDA: bf16 weights as stored, static cache, and
transformers' own compilation inside generate (CompileConfig, torch.compile mode "reduce-overhead"),
as scripts/bench_peer_transformers.py (whose docstring says why not a hand-wrapped forward).
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    job = json.load(open(args.job))

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, CompileConfig

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype="auto").to(device).eval()
    if cuda:
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(mode="reduce-overhead")
    s = job["sampling"]
    greedy = s["temperature"] == 0
    kw = dict(max_new_tokens=job["max_new_tokens"], do_sample=not greedy,
              eos_token_id=list(job["eos_ids"]) or None, pad_token_id=(job["eos_ids"] or [0])[0])
    if not greedy:
        # Explicit values override a generation_config.json: top_k 0 and top_p 1.0 mean off.
        kw.update(temperature=s["temperature"], top_k=int(s["top_k"]), top_p=float(s["top_p"]))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "mode": "static cache + generate's torch.compile(reduce-overhead)" if cuda else "eager (cpu)",
           "passes": [], "tokens": [], "wall_s": []}

    def one_pass(seeds):
        total = 0
        sync()
        t0 = time.perf_counter()
        for ids, seed in zip(job["prompts"], seeds):
            torch.manual_seed(seed)
            x = torch.tensor([ids], device=device)
            out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
            total += int(out.shape[1] - x.shape[1])
        sync()
        return total, time.perf_counter() - t0

    with torch.no_grad():
        t = time.time()
        one_pass(job["seeds"][0])  # compile + warm-up, untimed
        rec["warmup_s"] = time.time() - t
        for seeds in job["seeds"]:
            n, wall = one_pass(seeds)
            rec["tokens"].append(n)
            rec["wall_s"].append(wall)
            rec["passes"].append(n / wall)
            with open(args.out, "w") as f:
                json.dump(rec, f, indent=2)
    rec["tokens_per_s"] = sorted(rec["passes"])[len(rec["passes"]) // 2]
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=2)
    print(json.dumps({k: rec[k] for k in ("device", "mode", "passes", "tokens_per_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
