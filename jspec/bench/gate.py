"""The lossless gate of `jspec bench` (protocol.md section 4): the statistics and the checks.

Everything here is pure numpy on per-reply numbers, so it is unit-tested with hand-made inputs.

Statistical methods (all intervals are two-sided 95 %, z = 1.959964, normal approximation):

* The unit of sampling is a reply, never a token: tokens of one reply are dependent. Each engine's
  replies come from independent per-request seeds (the candidate's seeds differ from stock's).
* Per-token means are pooled ratio estimators: mean log-likelihood = sum over replies of the
  reply's summed log p / sum of reply lengths (likewise the share of first choices). Their
  standard errors use the delta method with reply-level influence values
  IF_i = (y_i - R x_i) / mean(x), i.e. the cluster-robust (by reply) linearisation.
* Reply lengths: ratio of means R = mean(n_cand) / mean(n_stock), delta method likewise.
* Paired design. In the benchmark, reply i of stock and reply i of the candidate answer the same
  prompt in the same pass with independent seeds, so the pairs are independent of each other and
  the variance of a difference is estimated from the per-pair differences of influence values
  (se^2 = var(D_i) / n, sample variance with n - 1). This removes prompt-to-prompt variance,
  which is shared by the pair, and is valid because the pairs are independent. When the two
  samples do not pair up one to one, the unpaired (Welch-type) form
  se^2 = var(IF_cand) / n_cand + var(IF_stock) / n_stock is used.
* A check passes when its interval intersects the allowed band. A check whose half-width exceeds
  twice its margin is `underpowered` and fails (more samples, not a wider margin); so does a
  sampled-reply check with fewer than 200 replies per engine (`too_few_replies`), and any check
  whose inputs are missing or not finite (a check that cannot be evaluated does not pass).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

Z95 = 1.959963984540054

# Section 4's limits.
MEMORY_ALLOWANCE_MIB = 4096.0
FIDELITY_MEAN_LIMIT = 0.002  # nats, mean |log p_verify - log p_decode|
LIKELIHOOD_MARGIN = 0.05  # nats per token, difference of means
ARGMAX_MARGIN = 0.01  # share of first choices, difference
LENGTH_MARGIN = 0.05  # ratio of mean reply lengths, band [0.95, 1.05]
GREEDY_BAR = 0.99  # jspec's own bar for greedy agreement
MIN_REPLIES = 200  # sampled replies per engine
STOCK_HBM_BAR = 0.85  # section 5: solo stock tokens/s >= 85 % of the HBM bound
BUSY_MIN_OCCUPANCY = 0.90  # section 3: busy KV pool >= 90 % occupied at steady state


def _finite(*xs) -> bool:
    return all(x is not None and math.isfinite(float(x)) for x in xs)


def _var(x: np.ndarray) -> float:
    return float(np.var(x, ddof=1)) if len(x) >= 2 else math.inf


def interval_check(estimate: float | None, se: float | None, band: tuple[float, float],
                   margin: float) -> dict:
    """Estimate +- z se against the allowed band; underpowered when z se > 2 margin."""
    if not _finite(estimate, se):
        return {"estimate": estimate, "se": se, "low": None, "high": None, "half_width": None,
                "band": list(band), "margin": margin, "intersects": False, "underpowered": True,
                "ok": False}
    half = Z95 * float(se)
    low, high = float(estimate) - half, float(estimate) + half
    intersects = high >= band[0] and low <= band[1]
    underpowered = half > 2 * margin
    return {"estimate": float(estimate), "se": float(se), "low": low, "high": high,
            "half_width": half, "band": list(band), "margin": margin, "intersects": intersects,
            "underpowered": underpowered, "ok": bool(intersects and not underpowered)}


def pooled_ratio(y: Sequence[float], x: Sequence[float]) -> tuple[float, np.ndarray]:
    """R = sum(y) / sum(x) and each unit's influence value (y_i - R x_i) / mean(x)."""
    y, x = np.asarray(y, np.float64), np.asarray(x, np.float64)
    if len(x) == 0 or x.sum() <= 0:
        return math.nan, np.zeros(0)
    r = y.sum() / x.sum()
    return float(r), (y - r * x) / x.mean()


def ratio_difference(y_c, x_c, y_s, x_s, paired: bool) -> dict:
    """Difference of pooled ratios, candidate minus stock: (gap, se, candidate, stock)."""
    r_c, if_c = pooled_ratio(y_c, x_c)
    r_s, if_s = pooled_ratio(y_s, x_s)
    gap = r_c - r_s
    if paired and len(if_c) == len(if_s):
        se = math.sqrt(_var(if_c - if_s) / len(if_c)) if len(if_c) else math.inf
    else:
        se = math.sqrt(_var(if_c) / max(len(if_c), 1) + _var(if_s) / max(len(if_s), 1))
    return {"gap": gap, "se": se, "candidate": r_c, "stock": r_s, "paired": bool(
        paired and len(if_c) == len(if_s))}


def ratio_of_means(a_c, a_s, paired: bool) -> dict:
    """R = mean(a_c) / mean(a_s) with its delta-method standard error."""
    a_c, a_s = np.asarray(a_c, np.float64), np.asarray(a_s, np.float64)
    if len(a_c) == 0 or len(a_s) == 0 or a_s.mean() <= 0:
        return {"ratio": math.nan, "se": math.nan, "candidate_mean": None, "stock_mean": None,
                "paired": False}
    m_c, m_s = a_c.mean(), a_s.mean()
    r = m_c / m_s
    if paired and len(a_c) == len(a_s):
        se = math.sqrt(_var((a_c - r * a_s) / m_s) / len(a_c))
    else:
        se = math.sqrt(_var(a_c) / (len(a_c) * m_s ** 2) + r ** 2 * _var(a_s) / (len(a_s) * m_s ** 2))
    return {"ratio": float(r), "se": se, "candidate_mean": float(m_c), "stock_mean": float(m_s),
            "paired": bool(paired and len(a_c) == len(a_s))}


def _paired(cand: Sequence[Mapping], stock: Sequence[Mapping]) -> tuple[list, list, bool]:
    """Order both samples by their pairing key (pass, prompt) when they pair one to one."""
    key = lambda r: (r.get("workload"), r.get("pass"), r.get("prompt"))
    kc, ks = [key(r) for r in cand], [key(r) for r in stock]
    complete = all(k[1] is not None and k[2] is not None for k in kc + ks)
    if complete and len(kc) == len(ks) == len(set(kc)) and set(kc) == set(ks):
        return sorted(cand, key=key), sorted(stock, key=key), True
    return list(cand), list(stock), False


def likelihood_check(cand: Sequence[Mapping], stock: Sequence[Mapping],
                     min_replies: int = MIN_REPLIES) -> dict:
    """Mean per-token log-likelihood under the target: candidate minus stock, band +-0.05.
    Replies are dicts with `n` (tokens) and `logp` (summed log p of those tokens)."""
    return _pooled_check(cand, stock, "logp", LIKELIHOOD_MARGIN, min_replies)


def argmax_check(cand: Sequence[Mapping], stock: Sequence[Mapping],
                 min_replies: int = MIN_REPLIES) -> dict:
    """Share of sampled tokens that are the target's argmax: candidate minus stock, band +-0.01.
    Replies are dicts with `n` and `hits` (tokens that were the argmax)."""
    return _pooled_check(cand, stock, "hits", ARGMAX_MARGIN, min_replies)


def _pooled_check(cand, stock, field: str, margin: float, min_replies: int) -> dict:
    cand = [r for r in cand if r.get(field) is not None]
    stock = [r for r in stock if r.get(field) is not None]
    cand, stock, paired = _paired(cand, stock)
    d = ratio_difference([r[field] for r in cand], [r["n"] for r in cand],
                         [r[field] for r in stock], [r["n"] for r in stock], paired)
    check = interval_check(d["gap"], d["se"], (-margin, margin), margin)
    too_few = min(len(cand), len(stock)) < min_replies
    return {"gap": _num(d["gap"]), "se": _num(d["se"]), "candidate": _num(d["candidate"]),
            "stock": _num(d["stock"]), "low": check["low"], "high": check["high"],
            "band": check["band"], "underpowered": check["underpowered"],
            "too_few_replies": too_few, "replies": {"candidate": len(cand), "stock": len(stock)},
            "min_replies": min_replies, "paired": d["paired"],
            "ok": bool(check["ok"] and not too_few)}


def lengths_check(cand_lengths: Sequence[float], stock_lengths: Sequence[float], paired: bool,
                  min_replies: int = 0) -> dict:
    """Ratio of mean reply lengths, candidate / stock, with its 95 % CI against [0.95, 1.05]."""
    r = ratio_of_means(cand_lengths, stock_lengths, paired)
    check = interval_check(r["ratio"], r["se"], (1 - LENGTH_MARGIN, 1 + LENGTH_MARGIN), LENGTH_MARGIN)
    too_few = min(len(cand_lengths), len(stock_lengths)) < min_replies
    return {"ratio": _num(r["ratio"]), "low": check["low"], "high": check["high"],
            "se": _num(r["se"]), "candidate_mean": r["candidate_mean"],
            "stock_mean": r["stock_mean"], "n": {"candidate": len(cand_lengths),
                                                  "stock": len(stock_lengths)},
            "paired": r["paired"], "band": check["band"], "intersects": check["intersects"],
            "underpowered": check["underpowered"], "too_few_replies": too_few,
            "ok": bool(check["ok"] and not too_few)}


def replies_lengths_check(cand: Sequence[Mapping], stock: Sequence[Mapping],
                          min_replies: int = 0) -> dict:
    cand, stock, paired = _paired(cand, stock)
    return lengths_check([r["n"] for r in cand], [r["n"] for r in stock], paired, min_replies)


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Tokens before the first divergence / reply length, the longer of the two replies being
    the length (so a reply that stops early or runs on counts against agreement)."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return d / n


def greedy_check(stock_replies: Sequence[Sequence[int]], cand_replies: Sequence[Sequence[int]],
                 bar: float = GREEDY_BAR) -> dict:
    per = [agreement(a, b) for a, b in zip(stock_replies, cand_replies)]
    mean = float(np.mean(per)) if per else None
    return {"mean": mean, "per_prompt": per, "identical": int(sum(p == 1.0 for p in per)),
            "prompts": len(per), "bar": bar, "ok": bool(mean is not None and mean >= bar)}


def fidelity_check(diffs: Sequence[float], limit: float = FIDELITY_MEAN_LIMIT, **extra) -> dict:
    """Per-token |log p (candidate verify) - log p (stock decode)| over the fixed texts."""
    d = np.abs(np.asarray(diffs, np.float64))
    ok = bool(len(d) and np.isfinite(d).all() and d.mean() <= limit)
    return {"mean": float(d.mean()) if len(d) else None, "max": float(d.max()) if len(d) else None,
            "tokens": int(len(d)), "limit": limit, "ok": ok, **extra}


def memory_check(peak_stock_bytes: float | None, peak_spec_bytes: float | None,
                 allowance_mib: float = MEMORY_ALLOWANCE_MIB, **extra) -> dict:
    """Candidate peak <= stock peak + 4096 MiB. Without device statistics the check cannot be
    evaluated, and a check that cannot be evaluated does not pass."""
    mib = lambda b: None if b is None else float(b) / 2 ** 20
    s, c = mib(peak_stock_bytes), mib(peak_spec_bytes)
    allowed = None if s is None else s + allowance_mib
    ok = None if (s is None or c is None) else bool(c <= allowed)
    return {"peak_mib_stock": s, "peak_mib_spec": c, "allowed_mib": allowed, "ok": ok, **extra}


def geometric_mean(values: Sequence[float]) -> float:
    v = np.asarray(values, np.float64)
    return float(np.exp(np.mean(np.log(v))))


def specscore(ratios: Mapping[str, float | None], gates: Mapping[str, Mapping],
              required=("solo", "team", "busy")) -> tuple[float | None, str | None]:
    """Geometric mean of the workloads' median ratios, only when every gate passes; else
    (None, reason) naming every failing gate."""
    problems = []
    missing = [w for w in required if not _finite(ratios.get(w)) or ratios[w] <= 0]
    if missing:
        problems.append(f"workload(s) {', '.join(missing)} not measured")
    for name, g in gates.items():
        if g.get("ok") is not True:
            problems.append(f"{name}: {g.get('why') or 'failed'}")
    if problems:
        return None, "; ".join(problems)
    return geometric_mean([ratios[w] for w in required]), None


def _num(x):
    return float(x) if _finite(x) else None
