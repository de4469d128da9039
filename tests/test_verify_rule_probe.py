"""scripts/verify_rule_probe.py's per-round expectations against the rules' definitions."""
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from stats_helpers import random_round  # noqa: E402
from verify_rule_probe import expected_accepts  # noqa: E402

from jspec import rejection  # noqa: E402
from jspec.sampling import SamplingArrays  # noqa: E402


def test_expected_accepts_match_the_rules():
    rng = np.random.default_rng(3)
    lanes, k, vocab = 16, 4, 5
    p, q, drafts, num_draft = random_round(rng, lanes, k, vocab, 0.8)
    arrays = SamplingArrays.from_lists([1.0] * lanes, [0] * lanes, [1.0] * lanes, list(range(lanes)))
    token, block = expected_accepts(jnp.log(p).astype(jnp.float32), jnp.log(q).astype(jnp.float32),
                                    drafts, num_draft, arrays)
    stop, _ = rejection.block_acceptance(jnp.log(p).astype(jnp.float32),
                                         jnp.log(q).astype(jnp.float32), drafts, num_draft)
    stop = np.asarray(stop, np.float64)
    for b in range(lanes):
        n = num_draft[b]
        ratios = [min(1.0, p[b, i, drafts[b, i]] / q[b, i, drafts[b, i]]) for i in range(n)]
        want_token = sum(np.prod(ratios[:j]) for j in range(1, n + 1))
        want_block = sum(a * stop[b, a - 1] * np.prod(1 - stop[b, a:n]) for a in range(1, n + 1))
        np.testing.assert_allclose(token[b], want_token, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(block[b], want_block, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(block)[num_draft == 0] == 0)
