"""Statistics shared by the sampler tests."""

import jax
import numpy as np


def chi2_pvalue(counts, probs, min_expected=5.0):
    """Goodness of fit of integer counts to a law. Draws in a zero-probability cell -> 0.0.

    Cells with expected count < min_expected are pooled (chi2 sf = gammaincc(df/2, stat/2)).
    """
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    expected = counts.sum() * probs / probs.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    if exp[-1] < min_expected:  # fold a still-small pool into the smallest big cell
        j = np.argmin(exp[:-1])
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 1.0
    stat = np.sum((obs - exp) ** 2 / exp)
    return float(jax.scipy.special.gammaincc((len(exp) - 1) / 2.0, stat / 2.0))


def random_round(rng, lanes, k, vocab, concentration):
    """One random verification round: p [lanes, k+1, vocab] and q [lanes, k, vocab] (Dirichlet
    laws), drafts [lanes, k] int32 drawn from q, num_draft [lanes] int32 in 0..k."""
    p = rng.dirichlet(np.full(vocab, concentration), size=(lanes, k + 1))
    q = rng.dirichlet(np.full(vocab, concentration), size=(lanes, k))
    drafts = np.array([[rng.choice(vocab, p=q[b, i]) for i in range(k)] for b in range(lanes)],
                      np.int32)
    num_draft = rng.integers(0, k + 1, size=lanes).astype(np.int32)
    return p, q, drafts, num_draft
