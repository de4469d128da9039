"""How many tokens per verify step can a parallel (block) drafter reach on this target at T = 1?

A block drafter proposes draft k without seeing drafts 1..k-1 (DFlash), or seeing only draft k-1
(DSpark's Markov head). The best a DFlash-style drafter can do is propose, at every position k,
the target's exact marginal q_k(v) = P(x_k = v | context), with x_1..x_{k-1} summed out. This
script estimates the tokens per verify step of that ideal drafter on contexts from the benchmark
prompts, by Monte Carlo with the target alone:

  1. context: a benchmark prompt (chat template) + the first `cut` tokens of the target's own
     T = 1 reply to it;
  2. q_k: the mixture of the target's conditionals p(. | context, x_<k) over M sampled
     continuations x (an unbiased estimate of the marginal);
  3. M' draft paths y with y_k ~ q_k independently, verified as speculative sampling does:
     position k survives with prob. min(1, p(y_k | context, y_<k) / q_k(y_k)) once all before it
     survived; tokens per verify step = 1 + E[surviving run] (the bonus token included).

No drafter that sees no earlier draft can beat this on these contexts (up to the Monte Carlo
error of q: a noisy q loses a little, so the estimate is slightly low). The target's entropy at
the first drafted position is reported beside it: the wider the target's law at T = 1, the lower
the ceiling.

  python scripts/parallel_draft_ceiling.py --prompts-dir ../shared/data/prompts --out ceiling.json
  python scripts/parallel_draft_ceiling.py --summarize ceiling.json [--prompts N]  # an older record

Per set the record gives the mean over contexts and the engine's form: the engine's tau is
sum(tokens) / sum(steps) over prompts, which for contexts of equal reply length is the harmonic
mean of the contexts' tau (the mean weights the contexts where S copies, tau near 8, far more than
the engine does). `mix` combines the sets' harmonic means in a prompt mix (the 421 code prompts:
164 HumanEval, 257 MBPP), the figure to hold beside the engine's tau on all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def ideal_parallel_survival(p_x: np.ndarray, laws_along, rng: np.random.Generator) -> np.ndarray:
    """[M', K] survival of the ideal parallel drafter's draft positions along M' draft paths.

    p_x [M, K, V]: the target's law of x_k given the context and x_<k, along M continuations x
    the target sampled; their mean over the M continuations is the marginal q_k (the drafter).
    laws_along(paths [M', K]) -> [M', K, V]: the target's law along other paths. Draft paths
    y_k ~ q_k (independently, as a drafter that sees no earlier draft proposes them) are
    verified as speculative sampling does: position k survives with probability
    prod_{j <= k} min(1, p(y_j | y_<j) / q_j(y_j)). Tokens per verify step = 1 + E[sum of row]."""
    M, K, V = p_x.shape
    q_kv = p_x.mean(axis=0)
    y_mk = np.stack([rng.choice(V, size=M, p=q_kv[k] / q_kv[k].sum()) for k in range(K)], 1)
    p_at = np.take_along_axis(laws_along(y_mk), y_mk[:, :, None], axis=2)[:, :, 0]  # p(y_k | y_<k)
    q_at = q_kv[np.arange(K)[None, :], y_mk]                                          # q_k(y_k)
    return np.cumprod(np.minimum(1.0, p_at / q_at), axis=1)


SET_SIZES = {"humaneval": 164, "mbpp": 257}  # the code prompt sets, issue 5's 421 prompts


def tokens_over_steps(taus) -> float:
    """sum(tokens) / sum(steps) of contexts that each yield the same tokens: the harmonic mean."""
    taus = np.asarray(taus, np.float64)
    if taus.size == 0 or (taus <= 0).any():
        raise ValueError(f"tokens_over_steps: need positive tokens per step, got {taus.tolist()}")
    return float(taus.size / (1.0 / taus).sum())


def mix(per_set: dict[str, float], sizes: dict[str, int]) -> float:
    """Tokens per step over a prompt mix: `sizes[s]` prompts at tokens per step `per_set[s]` each."""
    missing = set(sizes) - set(per_set)
    if missing:
        raise ValueError(f"mix: no tokens per step for {sorted(missing)}")
    return float(sum(sizes.values()) / sum(n / per_set[s] for s, n in sizes.items()))


def summarize(rows: list[dict], resamples: int = 4000, seed: int = 0) -> dict:
    """Per set: contexts, mean, tokens over steps with a bootstrap 95 % interval; and `mix_421`,
    the sets' tokens over steps in SET_SIZES' mix, with its interval (contexts resampled per set)."""
    rng = np.random.default_rng(seed)
    by_set: dict[str, np.ndarray] = {}
    for r in rows:
        by_set.setdefault(r["set"], []).append(r["tokens_per_step"])
    by_set = {k: np.asarray(v, np.float64) for k, v in by_set.items()}
    draws = {k: np.array([tokens_over_steps(rng.choice(v, v.size)) for _ in range(resamples)])
             for k, v in by_set.items()}
    out = {"sets": {k: {"contexts": int(v.size), "mean": float(v.mean()),
                        "tokens_over_steps": tokens_over_steps(v),
                        "tokens_over_steps_95": np.quantile(draws[k], [0.025, 0.975]).tolist()}
                    for k, v in by_set.items()}}
    if set(SET_SIZES) <= set(by_set):
        out["mix_421"] = mix({k: out["sets"][k]["tokens_over_steps"] for k in SET_SIZES}, SET_SIZES)
        mixed = [mix({k: draws[k][i] for k in SET_SIZES}, SET_SIZES) for i in range(resamples)]
        out["mix_421_95"] = np.quantile(mixed, [0.025, 0.975]).tolist()
    return out


def print_summary(summary: dict) -> None:
    for k, v in summary["sets"].items():
        lo, hi = v["tokens_over_steps_95"]
        print(f"{k}: {v['contexts']} contexts, mean {v['mean']:.3f}, tokens over steps "
              f"{v['tokens_over_steps']:.3f} [{lo:.3f}, {hi:.3f}]")
    if "mix_421" in summary:
        lo, hi = summary["mix_421_95"]
        print(f"the 421 prompts' mix: {summary['mix_421']:.3f} [{lo:.3f}, {hi:.3f}] tokens per verify step")


def summarize_record(path: str, prompts_per_set: int | None) -> dict:
    """Add the per-set summary to a record written before rows named their set (prompt indices
    below prompts_per_set are HumanEval's, as main orders them)."""
    record = json.loads(Path(path).read_text())
    n = record.get("prompts_per_set", prompts_per_set)
    for r in record["rows"]:
        if "set" not in r:
            if n is None:
                raise SystemExit(f"{path}: rows name no set; pass --prompts (prompts per set of that run)")
            r["set"] = "humaneval" if r["prompt"] < n else "mbpp"
    record["prompts_per_set"] = n
    record["summary"] = summarize(record["rows"])
    tmp = Path(path).with_suffix(".tmp")  # written whole, then swapped in: the record is never half
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    print_summary(record["summary"])
    return record


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="standin", help="target directory or stand-in name")
    ap.add_argument("--prompts-dir", help="directory with humaneval.jsonl and mbpp.jsonl")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per set (default 8)")
    ap.add_argument("--cuts", default="0,48,96", help="reply tokens before each context ends")
    ap.add_argument("--samples", type=int, default=32, help="continuations for q (M) and draft paths (M')")
    ap.add_argument("--block", type=int, default=7, help="drafted tokens per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--summarize", metavar="RECORD", help="add the per-set summary to RECORD in place")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize_record(args.summarize, args.prompts)
    if not args.prompts_dir or not args.out:
        ap.error("--prompts-dir and --out are required (or --summarize RECORD)")
    args.prompts = 8 if args.prompts is None else args.prompts

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jspec.api import LLM, SamplingParams
    from jspec.loading import check_model_dir, load_model
    from jspec.prompts import load_prompts
    from jspec.qwen3 import causal_attention
    from jspec.tokenizer import Tokenizer

    model_dir = check_model_dir(args.model)
    tok = Tokenizer.from_dir(model_dir)
    named = [(s, r.first_turn) for s in ("humaneval", "mbpp")
             for r in load_prompts(Path(args.prompts_dir) / f"{s}.jsonl", limit=args.prompts)]
    texts = [t for _, t in named]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    cuts = sorted(int(c) for c in args.cuts.split(","))
    K, M = args.block, args.samples
    max_ctx = -(-(max(map(len, prompts)) + cuts[-1] + K + 16) // 64) * 64
    llm = LLM(model_dir, dtype="float32", max_lanes=M, max_context=max_ctx)
    _, model = load_model(model_dir, dtype="float32")
    attention = causal_attention()
    graphdef, state = nnx.split(model)  # weights as arguments: closed over, XLA would fold them

    @jax.jit
    def laws(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        T = tokens_bt.shape[1]
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_bt.shape)
        hidden, _, _ = m(tokens_bt, positions, attention=attention)
        return jax.nn.softmax(m.logits(hidden[:, -(K + 1):]).astype(jnp.float32), axis=-1)

    def next_laws(tokens_bt):
        """p(. | tokens[:t]) for the last K + 1 positions t (fp32 probabilities [B, K + 1, V])."""
        return laws(state, tokens_bt)

    rng = np.random.default_rng(args.seed)
    replies = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=args.seed * 1000 + i,
                                                    max_tokens=cuts[-1] + 1) for i in range(len(prompts))])
    rows = []
    t0 = time.time()
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        for cut in cuts:
            if cut > len(reply.token_ids) - 1:
                continue  # the reply ended before this cut
            ctx = list(prompt) + list(reply.token_ids[:cut])
            xs = llm.generate([ctx] * M, [SamplingParams(temperature=1.0, seed=10**6 + 7919 * i + 131 * cut + m,
                                                         max_tokens=K, ignore_eos=True) for m in range(M)])
            x_mk = np.array([r.token_ids for r in xs], np.int64)  # [M, K]
            ctx_m = np.broadcast_to(np.asarray(ctx, np.int64), (M, len(ctx)))
            laws_along = lambda paths: np.asarray(next_laws(jnp.asarray(
                np.concatenate([ctx_m, paths], 1), jnp.int32)))[:, :K]
            p_x = laws_along(x_mk)
            survive = ideal_parallel_survival(p_x, laws_along, rng)
            p0 = p_x[0, 0]
            entropy = float(-(p0[p0 > 0] * np.log(p0[p0 > 0])).sum())
            rows.append({"prompt": i, "set": named[i][0], "cut": cut, "context_tokens": len(ctx),
                         "tokens_per_step": 1.0 + float(survive.sum(1).mean()),
                         "survive_per_position": survive.mean(0).round(4).tolist(),
                         "entropy_first_position_nats": entropy})
            print(f"prompt {i:2d} cut {cut:3d}: ideal parallel tau {rows[-1]['tokens_per_step']:.3f}, "
                  f"entropy at the first position {entropy:.2f} nats ({time.time() - t0:.0f} s)", flush=True)
    taus = np.array([r["tokens_per_step"] for r in rows])
    result = {"model": str(args.model), "temperature": 1.0, "block": K, "samples": M, "cuts": cuts,
              "contexts": len(rows), "ideal_parallel_tokens_per_step_mean": float(taus.mean()),
              "ideal_parallel_tokens_per_step_se": float(taus.std(ddof=1) / np.sqrt(len(taus))) if len(taus) > 1 else None,
              "survive_per_position_mean": np.mean([r["survive_per_position"] for r in rows], 0).round(4).tolist(),
              "entropy_first_position_mean": float(np.mean([r["entropy_first_position_nats"] for r in rows])),
              "prompts_per_set": args.prompts, "summary": summarize(rows), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"ideal parallel drafter: {result['ideal_parallel_tokens_per_step_mean']:.3f} tokens per verify "
          f"step (se {result['ideal_parallel_tokens_per_step_se']}) over {len(rows)} contexts; mean entropy "
          f"at the first drafted position {result['entropy_first_position_mean']:.2f} nats")
    print_summary(result["summary"])
    return result


if __name__ == "__main__":
    main()
