"""On the GPU: a random Qwen3-8B-shaped checkpoint loads through jspec's path, and an 8 x 512
forward agrees with transformers on the same GPU within bf16 tolerance. Records load time and
peak host memory. Run after scripts/make_random_qwen3.py.

  python scripts/gpu_check_qwen3_8b.py --model /tmp/qwen3-8b-random --convert-to /tmp/q8b-jspec --out $OUT/qwen3_8b_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--convert-to")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jspec.loading import load_model
    from jspec.qwen3 import forward_logits

    rec = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    rss0 = peak_rss_gib()
    t0 = time.time()
    cfg, model = load_model(args.model, progress=False)
    jax.block_until_ready(nnx.state(model))
    rec["hf_load_s"] = time.time() - t0
    rec["peak_host_rss_gib_after_load"] = peak_rss_gib()
    rec["peak_host_rss_gib_before_load"] = rss0
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    rec["weight_gib"] = weight_bytes / 2**30

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: forward_logits(nnx.merge(graphdef, s), t)[0])
    ours = np.asarray(fwd(state, jnp.asarray(tokens)), np.float32)

    if args.convert_to:
        from jspec.convert.hf_to_jspec import convert_checkpoint
        del model
        t0 = time.time()
        convert_checkpoint(args.model, args.convert_to, force=True, progress=False)
        rec["convert_s"] = time.time() - t0
        state = None
        t0 = time.time()
        _, model2 = load_model(args.convert_to)
        jax.block_until_ready(nnx.state(model2))
        rec["orbax_load_s"] = time.time() - t0
        g2, s2 = nnx.split(model2)
        fwd2 = jax.jit(lambda s, t: forward_logits(nnx.merge(g2, s), t)[0])
        rec["orbax_logits_identical"] = bool(np.array_equal(
            np.asarray(fwd2(s2, jnp.asarray(tokens)), np.float32), ours))
        del model2, s2
    jax.clear_caches()
    print(json.dumps(rec, indent=2), flush=True)

    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        t = torch.tensor(tokens).cuda()
        theirs = hf(t).logits.float().cpu().numpy()
        hf = hf.float()  # exact reference: the same bf16 weights, fp32 arithmetic
        exact = hf(t).logits.float().cpu().numpy()
    del hf
    norm = np.linalg.norm(exact)
    rec["rel_err_jspec_bf16_vs_fp32"] = float(np.linalg.norm(ours - exact) / norm)
    rec["rel_err_transformers_bf16_vs_fp32"] = float(np.linalg.norm(theirs - exact) / norm)
    rec["rel_diff_jspec_vs_transformers_bf16"] = float(np.linalg.norm(ours - theirs) / norm)
    rec["argmax_agreement_jspec_vs_fp32"] = float((ours.argmax(-1) == exact.argmax(-1)).mean())
    rec["argmax_agreement_transformers_vs_fp32"] = float((theirs.argmax(-1) == exact.argmax(-1)).mean())
    # bf16 tolerance = transformers' own bf16 error against the fp32 answer (random 36-layer
    # weights accumulate a few % of rounding error in either engine).
    rec["pass"] = bool(rec["rel_err_jspec_bf16_vs_fp32"]
                       <= 1.25 * rec["rel_err_transformers_bf16_vs_fp32"] + 1e-3)
    print(json.dumps(rec, indent=2))
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=2)


if __name__ == "__main__":
    main()
