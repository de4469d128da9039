"""What n drafted blocks a lane instead of one could bring (CPU probe, an estimate).

A lane may draw n blocks from the drafter with independent randomness and verify all of them in
one pass (a tree whose branches share the lane's last token). Recursive rejection sampling keeps
the first token exact: candidate i is accepted with min(1, r_{i-1}(x_i) / q(x_i)) against the
residual r_{i-1} = norm(max(r_{i-2} - q, 0)) left by the candidates before it (r_0 = p); the lane
then follows the accepted branch as a single chain. DSpark's first draft law q_1 depends only on
the context and the lane's last token, so every branch draws its first token from the same q_1.

The engine generates with the token rule (T = 1, the code prompts, seeds 1000 + i). At every
verify round this probe computes from the round's own laws:
  a_n   the first position's acceptance with n candidates (exact, from p_1 and q_1),
  rest  the realized chain's expected further accepts given its first draft was accepted:
        sum_{k >= 2} prod_{2 <= i <= k} min(1, p_i(x_i) / q_i(x_i)).
and estimates the round's accepted drafts with n candidates as a_n (1 + rest). The estimate
assumes a branch accepted at a later candidate continues as well as the first one does; such a
branch starts from a token the drafter under-weighted, so it is likely optimistic.

  python scripts/multi_draft_probe.py --prompts-dir ../shared/data/prompts --limit 20 \\
      --max-tokens 128 --out multi_draft.json
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


def candidates_acceptance(p, q, n: int) -> np.ndarray:
    """P(one of n i.i.d. candidates x_i ~ q is accepted) under recursive rejection sampling,
    for each candidate count 1..n: [..., n]. p, q: probabilities [..., V]."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    residual, left, total, out = p, np.ones(p.shape[:-1]), np.zeros(p.shape[:-1]), []
    for _ in range(n):
        accept = np.minimum(residual, q).sum(-1)
        total = total + left * accept
        out.append(total)
        rest = np.maximum(residual - q, 0.0)
        norm = rest.sum(-1, keepdims=True)
        residual = np.where(norm > 1e-12, rest / np.maximum(norm, 1e-300), residual)
        left = left * (1.0 - accept)
    return np.stack(out, -1)


def round_estimates(target_lp, draft_lp, drafts, num_draft, n: int):
    """(a [B, n]: first-position acceptance with 1..n candidates, rest [B]) from one round:
    target_lp [B, K+1, V], draft_lp [B, K, V] (log-probs), drafts [B, K], num_draft [B]."""
    from verify_gate_acceptance import token_rule_survival
    target_lp, draft_lp = np.asarray(target_lp, np.float64), np.asarray(draft_lp, np.float64)
    drafts, num_draft = np.asarray(drafts), np.asarray(num_draft)
    a = candidates_acceptance(np.exp(target_lp[:, 0]), np.exp(draft_lp[:, 0]), n)
    # drafts 2..k all accepted given the first was: the survival from draft 2 on
    survive = token_rule_survival(target_lp[:, 1:], draft_lp[:, 1:], drafts[:, 1:],
                                  np.maximum(num_draft - 1, 0))
    return a, survive.sum(1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from verify_gate_acceptance import add_t1_probe_arguments, probe_rounds, t1_record
    add_t1_probe_arguments(ap)
    ap.add_argument("--candidates", type=int, default=4, help="estimate 1..N candidates")
    args = ap.parse_args(argv)

    from jspec import sampling
    n = args.candidates

    def traced(target_logits, q, drafts, num_draft, arrays):
        return sampling.process(target_logits, arrays), q, drafts, num_draft

    def host(target_lp, q, drafts, num_draft):
        a, rest = round_estimates(target_lp, q, drafts, num_draft, n)
        return [(ai, float(ri)) for ai, ri in zip(a, rest)]

    prompts, reqs, got, missing, wall = probe_rounds(args, traced, host, "token")
    a, rest = np.array([g[0] for g in got]), np.array([g[1] for g in got])
    accepted = a * (1.0 + rest[:, None])  # [rounds, n]
    tau = 1.0 + accepted.mean(0)
    rec = {**t1_record(args, prompts, reqs), "rule": "token",
           "rounds_matched": len(rest), "rounds_missing": missing,
           "first_acceptance": {str(i + 1): float(a[:, i].mean()) for i in range(n)},
           "estimated_tau": {str(i + 1): float(tau[i]) for i in range(n)},
           "estimated_gain_over_one": {str(i + 1): float(tau[i] / tau[0]) for i in range(n)},
           "wall_s": wall}
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "per_request"}))
    return rec


if __name__ == "__main__":
    main()
