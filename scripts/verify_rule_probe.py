"""Block verification against draft-by-draft verification on the same rounds (CPU probe).

The engine generates with --rule (T = 1, the code prompts, seeds 1000 + i). At every verify
round it also computes, from that round's own target and drafter laws and its drafted tokens,
the expected number of accepted drafts under both rules (the expectation over the accept
uniforms only):
  token: sum_k prod_{i <= k} min(1, p_{i-1}(x_i) / q_i(x_i))
  block: sum_a a h_a prod_{j > a} (1 - h_j)          (h from rejection.block_acceptance)
Averaged over the rounds a request really ran (matched by seed and first position), these
compare the two rules on identical contexts and drafts, which removes the noise of two runs
drawing different replies. The run's measured tau is reported too (the rule it ran with).

  python scripts/verify_rule_probe.py --prompts-dir ../shared/data/prompts --limit 30 \\
      --max-tokens 128 --rule token --out rules_token.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def expected_accepts(target_logits, draft_logprobs, draft_tokens, num_draft, arrays):
    """(token rule, block rule) expected accepted drafts per lane [B] (jnp)."""
    import jax.numpy as jnp
    from jspec import rejection, sampling
    from verify_gate_acceptance import token_rule_survival
    target_lp = sampling.process(target_logits, arrays)
    K = draft_tokens.shape[1]
    num_draft = jnp.clip(num_draft, 0, K)
    token = token_rule_survival(target_lp, draft_logprobs, draft_tokens, num_draft, xp=jnp).sum(1)
    stop, _ = rejection.block_acceptance(target_lp, draft_logprobs, draft_tokens, num_draft)
    # P(accept length = a) = h_a prod_{j > a} (1 - h_j)
    later_fail = jnp.flip(jnp.cumprod(jnp.flip(1.0 - stop, 1), 1), 1)  # prod_{j >= a}
    later_fail = jnp.concatenate([later_fail[:, 1:], jnp.ones_like(later_fail[:, :1])], 1)
    block = jnp.sum(jnp.arange(1, K + 1)[None] * stop * later_fail, axis=1)
    return token, block


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from verify_gate_acceptance import add_t1_probe_arguments, probe_rounds, t1_record
    add_t1_probe_arguments(ap)
    ap.add_argument("--rule", choices=["token", "block"], default="token",
                    help="the rule the engine generates with")
    args = ap.parse_args(argv)

    def host(token, block):
        return [(float(t), float(b)) for t, b in zip(token, block)]

    prompts, reqs, got, missing, wall = probe_rounds(args, expected_accepts, host, args.rule)
    token, block = np.array([g[0] for g in got]), np.array([g[1] for g in got])
    diff = block - token
    rec = {**t1_record(args, prompts, reqs), "rule": args.rule,
           "rounds_matched": len(token), "rounds_missing": missing,
           "expected_tau_token_rule": 1 + token.mean(), "expected_tau_block_rule": 1 + block.mean(),
           "block_over_token": (1 + block.mean()) / (1 + token.mean()),
           "gain_per_round": {"mean": diff.mean(), "stderr": diff.std() / np.sqrt(len(diff)),
                              "min": diff.min()},
           "wall_s": wall}
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "per_request"}))
    return rec


if __name__ == "__main__":
    main()
