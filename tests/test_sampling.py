"""Sampler: exact processed distributions, sampling law, keys and batch independence (CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import sampling
from jspec.sampling import SamplingArrays
from stats_helpers import chi2_pvalue

ALPHA = 1e-5  # per-test significance; the seeds are fixed, so each verdict is deterministic


def lane_arrays(num_lanes, temperature, top_k=0, top_p=1.0, seed=0):
    return SamplingArrays.from_lists(
        [temperature] * num_lanes, [top_k] * num_lanes, [top_p] * num_lanes, [seed] * num_lanes)


def probs_of(logits, temperature, top_k=0, top_p=1.0, greedy=False):
    logits = jnp.asarray(logits, jnp.float32)
    batch = logits.shape[0]
    lp = sampling.processed_logprobs(
        logits, jnp.full((batch,), temperature, jnp.float32), jnp.full((batch,), top_k, jnp.int32),
        jnp.full((batch,), top_p, jnp.float32), jnp.full((batch,), greedy))
    return np.exp(np.asarray(lp, np.float64))


# ---------------------------------------------------------------------------- parameters


def test_from_lists_builds_validated_host_arrays():
    arrays = SamplingArrays.from_lists([0.0, 0.7, 1e-6], top_k=[None, 20, 0],
                                       top_p=[1.0, 0.8, None], seed=[1, 2**32 - 1, 3])
    assert arrays.temperature.dtype == np.float32 and arrays.top_k.dtype == np.int32
    assert arrays.top_p.dtype == np.float32 and arrays.seed.dtype == np.uint32
    np.testing.assert_array_equal(arrays.greedy, [True, False, True])
    np.testing.assert_array_equal(arrays.top_k, [0, 20, 0])
    np.testing.assert_array_equal(arrays.top_p, np.float32([1.0, 0.8, 1.0]))
    assert arrays.pad_to(5).num_lanes == 5 and bool(arrays.pad_to(5).greedy[-1])
    assert len(jax.tree.leaves(arrays)) == 5  # a pytree of arrays, nothing static

    unseeded = SamplingArrays.from_lists([1.0] * 4)
    assert len(set(unseeded.seed.tolist())) > 1  # fresh host seeds, not one shared stream

    class Req:
        temperature, top_k, top_p, seed = 0.7, 20, 0.8, 9

    stacked = SamplingArrays.stack([Req(), {"temperature": 0.0, "seed": 4}])
    np.testing.assert_array_equal(stacked.top_k, [20, 0])
    np.testing.assert_array_equal(stacked.seed, [9, 4])

    for bad in (dict(temperature=[-1.0]), dict(temperature=[float("nan")]),
                dict(temperature=[1.0], top_k=[-1]), dict(temperature=[1.0], top_k=[1.5]),
                dict(temperature=[1.0], top_p=[0.0]), dict(temperature=[1.0], top_p=[1.5]),
                dict(temperature=[1.0], seed=[-1]), dict(temperature=[1.0], seed=[2**32]),
                dict(temperature=[1.0, 1.0], top_k=[1])):
        with pytest.raises(ValueError):
            SamplingArrays.from_lists(**bad)


# ---------------------------------------------------------------------------- exact processing


def test_temperature_scaling_is_log_softmax_of_scaled_logits():
    logits = np.random.default_rng(0).normal(size=(3, 11)).astype(np.float32) * 3
    for temperature in (0.3, 1.0, 2.5):
        got = probs_of(logits, temperature)
        want = np.exp(logits / temperature) / np.exp(logits / temperature).sum(-1, keepdims=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_top_k_keeps_the_k_largest():
    logits = np.random.default_rng(1).normal(size=(4, 20)).astype(np.float32)
    for k in (1, 3, 19):
        probs = probs_of(logits, 0.8, top_k=k)
        for row, prob in zip(logits, probs):
            top = np.sort(np.argsort(-row)[:k])
            np.testing.assert_array_equal(np.flatnonzero(prob), top)
            want = np.exp(row[top] / 0.8) / np.exp(row[top] / 0.8).sum()
            np.testing.assert_allclose(prob[top], want, rtol=1e-5)
    # k >= V is "off"
    np.testing.assert_allclose(probs_of(logits, 0.8, top_k=20), probs_of(logits, 0.8), rtol=1e-6)


def test_top_k_keeps_every_tie_at_the_kth_value():
    logits = [[5.0, 3.0, 1.0, 3.0, -2.0, 3.0]]
    assert np.flatnonzero(probs_of(logits, 1.0, top_k=2)[0]).tolist() == [0, 1, 3, 5]
    assert np.flatnonzero(probs_of(logits, 1.0, top_k=1)[0]).tolist() == [0]
    # -0.0 and +0.0 tie
    assert np.flatnonzero(probs_of([[1.0, -0.0, 0.0, -1.0]], 1.0, top_k=2)[0]).tolist() == [0, 1, 2]


def test_top_p_cut_point_by_hand():
    base = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(base)[None].astype(np.float32)
    cases = {0.1: [0], 0.45: [0], 0.75: [0, 1], 0.85: [0, 1, 2], 0.97: [0, 1, 2, 3]}
    for top_p, kept in cases.items():
        probs = probs_of(logits, 1.0, top_p=top_p)[0]
        assert np.flatnonzero(probs).tolist() == kept, top_p
        np.testing.assert_allclose(probs[kept], base[kept] / base[kept].sum(), rtol=1e-5)
    # Ties with the last token of the nucleus are kept: 0.4 + 0.3 reaches 0.6, the other 0.3 stays.
    tied = np.log(np.array([[0.4, 0.3, 0.3]])).astype(np.float32)
    assert np.flatnonzero(probs_of(tied, 1.0, top_p=0.6)[0]).tolist() == [0, 1, 2]


def test_top_p_is_a_nucleus_of_the_tempered_top_k_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]])).astype(np.float32)
    # top-k 2 renormalises to (0.625, 0.375): 0.6 needs only token 0, 0.7 needs both.
    assert np.flatnonzero(probs_of(logits, 1.0, top_k=2, top_p=0.6)[0]).tolist() == [0]
    assert np.flatnonzero(probs_of(logits, 1.0, top_k=2, top_p=0.7)[0]).tolist() == [0, 1]
    # T = 0.5 squares and renormalises: (0.25, .09, .0225, .0025)/0.365 = (.685, .247, .062, .007)
    assert np.flatnonzero(probs_of(logits, 0.5, top_p=0.9)[0]).tolist() == [0, 1]
    assert np.flatnonzero(probs_of(logits, 1.0, top_p=0.9)[0]).tolist() == [0, 1, 2]


def test_greedy_is_one_hot_at_the_argmax_and_ignores_filters():
    logits = np.array([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 0.0]], np.float32)
    lp = np.asarray(sampling.processed_logprobs(
        logits, np.zeros(2, np.float32), np.array([1, 3], np.int32),
        np.array([0.1, 0.5], np.float32), np.array([True, True])))
    np.testing.assert_array_equal(lp[0], [-np.inf, 0.0, -np.inf, -np.inf])  # tie -> lowest id
    np.testing.assert_array_equal(lp[1], [0.0, -np.inf, -np.inf, -np.inf])


def test_per_lane_params_in_one_batch_and_broadcast_over_positions():
    rng = np.random.default_rng(2)
    configs = [(1.0, 0, 1.0, False), (0.6, 5, 1.0, False), (0.9, 0, 0.7, False),
               (0.7, 4, 0.8, False), (0.0, 3, 0.5, True), (1.3, 30, 0.95, False)]
    logits = rng.normal(size=(len(configs), 3, 30)).astype(np.float32) * 2
    temp, top_k, top_p, greedy = (np.array(c) for c in zip(*configs))
    batched = np.asarray(sampling.processed_logprobs(
        logits, temp.astype(np.float32), top_k.astype(np.int32), top_p.astype(np.float32),
        greedy))  # [B, K, V] with params [B]
    for lane, (t, k, p, g) in enumerate(configs):
        for pos in range(3):
            alone = probs_of(logits[lane, pos][None], t, k, p, g)[0]
            np.testing.assert_allclose(np.exp(batched[lane, pos]), alone, rtol=1e-6, atol=1e-7)


def _sort_reference(row, temperature, top_k, top_p):
    """Sort-based float64 definition of the processed law (module docstring of sampling)."""
    x = row.astype(np.float64) / temperature
    keep = np.ones(x.shape, bool)
    if 0 < top_k < len(x):
        keep = x >= np.sort(x)[::-1][top_k - 1]
    x = np.where(keep, x, -np.inf)
    if top_p < 1.0:
        order = np.sort(x)[::-1]
        pi = np.exp(order - order[0])
        pi /= pi.sum()
        last = np.searchsorted(np.cumsum(pi), top_p)  # shortest prefix with mass >= top_p
        keep &= x >= order[min(last, len(order) - 1)]
    keep &= x > -np.inf
    x = np.where(keep, x, -np.inf)
    return keep, x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


@pytest.mark.parametrize("vocab,integer_logits", [(64, False), (64, True), (9000, True),
                                                  (9000, False)])
def test_matches_a_sort_based_reference_on_random_rows(vocab, integer_logits):
    """Both filter paths (candidates for top_k <= 64, bit search otherwise) against the
    sort-based definition; integer logits make top-k and top-p ties frequent, also across the
    128-token chunks of the candidate path (which preselects chunks once V > 64 * 128)."""
    rng = np.random.default_rng(vocab + integer_logits)
    rows = 192 if vocab < 1000 else 48
    logits = rng.normal(size=(rows, vocab)) * 2
    if integer_logits:
        logits = np.round(logits)
    logits = logits.astype(np.float32)
    logits[::7, -vocab // 5:] = -np.inf  # masked vocabulary (e.g. padding ids)
    temp = rng.uniform(0.3, 1.5, rows).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5, 20, 64, 65, 150, vocab - 1, vocab + 5], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.2, 0.01], rows).astype(np.float32)
    got = np.asarray(sampling.processed_logprobs(logits, temp, top_k, top_p, np.zeros(rows, bool)))
    for i in range(rows):
        keep, want = _sort_reference(logits[i], temp[i], top_k[i], top_p[i])
        np.testing.assert_array_equal(np.isfinite(got[i]), keep, err_msg=f"row {i}")
        np.testing.assert_allclose(got[i][keep], want[keep], rtol=1e-5, atol=1e-5)


def test_candidate_and_search_paths_agree():
    rng = np.random.default_rng(7)
    rows, vocab = 32, 9000  # > 64 chunks of 128: the chunk preselection runs
    x = jnp.asarray(np.round(rng.normal(size=(rows, vocab)) * 3) / 2, jnp.float32)
    top_k = jnp.asarray(rng.integers(1, 65, size=(rows, 1)), jnp.int32)
    top_p = jnp.asarray(rng.choice([0.3, 0.6, 0.9, 0.99], size=(rows, 1)), jnp.float32)
    x_max = jnp.max(x, axis=-1, keepdims=True)
    candidates = jax.jit(sampling._candidate_top_k_top_p)
    cand_k = candidates(x, top_k, top_p, jnp.zeros((rows, 1), bool))
    cand_kp = candidates(x, top_k, top_p, jnp.ones((rows, 1), bool))
    for bits_per_pass in (1, 2):  # the search is exact whatever its radix (CPU 1, GPU 2)
        search = jax.jit(lambda x, k, p: (
            k_cut := sampling._search_top_k(x, k, bits_per_pass),
            sampling._search_top_p(x, x_max, p, k_cut, bits_per_pass)))
        search_k, search_kp = search(x, top_k, top_p)
        np.testing.assert_array_equal(cand_k, search_k)
        np.testing.assert_array_equal(cand_kp, search_kp)


def test_changing_parameters_compiles_at_most_three_times():
    """Parameters are arrays; only the static `filter_paths` (which filtering paths the batch
    needs) picks another variant: none, the top-k candidate path, or all paths."""
    traces = []

    @jax.jit
    def step(logits, arrays, positions):
        traces.append(arrays.filter_paths)
        return sampling.sample(logits, arrays, positions)

    logits = jnp.zeros((4, 32))
    plain = (lane_arrays(4, 1.0), lane_arrays(4, 0.0, seed=3), lane_arrays(4, 0.5, seed=9),
             SamplingArrays.from_lists([0.0, 0.0], [5, 0], [0.3, 1.0]).pad_to(4))  # greedy: no cut
    candidate = (lane_arrays(4, 0.7, 5, 0.9),  # Qwen3-style: a small top-k, with or without top-p
                 SamplingArrays.from_lists([0.0, 1.0, 0.5, 2.0], [0, 3, 0, 64],
                                           [0.1, 1.0, 1.0, 0.9], [1, 2, 3, 4]))
    everything = (SamplingArrays.from_lists([1.0], [0], [0.8]).pad_to(4),  # top-p alone
                  SamplingArrays.from_lists([1.0, 1.0], [5, 65], [1.0, 1.0]).pad_to(4))  # large k
    for arrays in plain + candidate + everything:
        jax.block_until_ready(step(logits, arrays, jnp.arange(4)))
    assert [a.filter_paths for a in plain + candidate + everything] == (
        [sampling.FILTER_NONE] * 4 + [sampling.FILTER_CANDIDATE] * 2 + [sampling.FILTER_ALL] * 2)
    assert traces == [sampling.FILTER_NONE, sampling.FILTER_CANDIDATE, sampling.FILTER_ALL]


def test_bad_filter_paths_is_refused():
    with pytest.raises(ValueError, match="filter_paths"):
        dataclasses.replace(lane_arrays(2, 1.0), filter_paths="some")
    with pytest.raises(ValueError, match="filter_paths"):
        sampling.processed_logprobs(jnp.zeros((1, 8)), 1.0, 0, 1.0, False, filter_paths=True)


@pytest.mark.parametrize("arrays", [
    SamplingArrays.from_lists([1.0, 0.0, 0.7]),
    SamplingArrays.from_lists([1.0, 0.7, 0.0], [20, 3, 5], [0.8, 1.0, 0.5]),
    SamplingArrays.from_lists([1.0, 0.7, 0.9], [0, 100, 20], [0.8, 0.9, 1.0]),
], ids=lambda a: a.filter_paths)
def test_filtering_has_no_device_conditional(arrays):
    """No variant tests on the device whether a path is needed: a cond on the GPU blocks the host
    until the stream drains (SamplingArrays). A sampler that used lax.cond would fail here."""
    logits = jnp.zeros((3, 2, 200))
    jaxpr = jax.make_jaxpr(lambda x, a: sampling.process(x, a))(logits, arrays)

    def sub_jaxprs(value):  # the jaxprs in an equation's params (pjit, cond, while, scan ...)
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for v in value:
                yield from sub_jaxprs(v)

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for value in eqn.params.values():
                for sub in sub_jaxprs(value):
                    yield from primitives(sub)

    names = set(primitives(jaxpr.jaxpr))
    assert "cond" not in names and "while" not in names, names


def test_filter_variants_are_the_same_law():
    """Each variant that serves a batch gives the law of the all-paths variant: XLA fuses them
    differently, so the log-probs agree to fp32 rounding, not bit for bit. And the static field
    is what it claims: a variant without a lane's path would not cut that lane."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 5, 200)) * 3
    for arrays, narrower in (
            (SamplingArrays.from_lists([1.0, 0.0, 0.6, 1.0]), None),
            (SamplingArrays.from_lists([1.0, 0.0, 0.6, 1.3], [4, 0, 20, 64], [1.0, 0.5, 0.8, 0.3]),
             sampling.FILTER_NONE),
            (SamplingArrays.from_lists([1.0, 1.0, 0.6, 1.0], [4, 80, 0, 250], [1.0, 0.9, 0.8, 0.7]),
             sampling.FILTER_CANDIDATE)):
        a = np.asarray(sampling.process(logits, arrays))
        b = np.asarray(sampling.process(logits, dataclasses.replace(
            arrays, filter_paths=sampling.FILTER_ALL)))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        if narrower is not None:
            uncut = np.asarray(sampling.process(logits, dataclasses.replace(
                arrays, filter_paths=narrower)))
            assert np.isinf(a).sum() > np.isinf(uncut).sum()


def test_top_k_at_or_above_the_vocabulary_keeps_every_token():
    """top_k >= V is top-k off, on the candidate path (V <= 64) and the bit search alike."""
    for vocab, k in ((40, 40), (40, 64), (300, 300), (300, 1000)):
        logits = jnp.tile(jax.random.normal(jax.random.PRNGKey(vocab + k), (1, vocab)), (2, 1))
        cut = sampling.process(logits, SamplingArrays.from_lists([1.0, 1.0], [k, 0], [0.9, 0.9]))
        np.testing.assert_allclose(np.asarray(cut[0]), np.asarray(cut[1]), rtol=1e-6, atol=1e-6)
        off = sampling.process(logits, SamplingArrays.from_lists([1.0], [k], [1.0]))
        assert not np.isinf(np.asarray(off)).any()


# ---------------------------------------------------------------------------- sampling law


SAMPLING_LOGITS = np.random.default_rng(4).normal(size=16).astype(np.float32) * 1.5


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 6, 1.0),
                                                     (1.0, 0, 0.8), (0.6, 8, 0.9)])
def test_sample_frequencies_match_the_processed_law(temperature, top_k, top_p):
    draws = 40_000
    arrays = lane_arrays(draws, temperature, top_k, top_p, seed=11)
    logits = jnp.broadcast_to(SAMPLING_LOGITS, (draws, 16))
    tokens, token_lp = jax.jit(sampling.sample)(logits, arrays, jnp.arange(draws))  # positions
    counts = np.bincount(np.asarray(tokens), minlength=16)
    law = probs_of(SAMPLING_LOGITS[None], temperature, top_k, top_p)[0]
    assert chi2_pvalue(counts, law) > ALPHA
    np.testing.assert_allclose(np.asarray(token_lp), np.log(law[np.asarray(tokens)]), rtol=1e-5)

    # Negative controls: the same test must reject the unfiltered law and a wrong temperature.
    assert chi2_pvalue(counts, probs_of(SAMPLING_LOGITS[None], temperature)[0]
                       if (top_k or top_p < 1) else
                       probs_of(SAMPLING_LOGITS[None], temperature * 1.3)[0]) < ALPHA


def test_sample_over_seeds_and_draft_sample_follow_the_law():
    draws = 20_000
    arrays = SamplingArrays.from_lists([0.8] * draws, [5] * draws, [0.9] * draws,
                                       list(range(draws)))  # one seed per lane, same position
    logits = jnp.broadcast_to(SAMPLING_LOGITS, (draws, 16))
    law = probs_of(SAMPLING_LOGITS[None], 0.8, 5, 0.9)[0]
    positions = jnp.full((draws,), 7)
    tokens, q_lp = jax.jit(sampling.draft_sample)(logits, arrays, positions)
    assert chi2_pvalue(np.bincount(np.asarray(tokens), minlength=16), law) > ALPHA
    np.testing.assert_allclose(np.exp(np.asarray(q_lp[0])), law, rtol=1e-5, atol=1e-7)
    # draft and plain-sample streams are different draws
    plain, _ = jax.jit(sampling.sample)(logits, arrays, positions)
    assert np.mean(np.asarray(plain) == np.asarray(tokens)) < 0.9


def test_greedy_sample_is_argmax():
    logits = np.random.default_rng(5).normal(size=(6, 50)).astype(np.float32)
    arrays = SamplingArrays.from_lists([0.0] * 6, [3] * 6, [0.2] * 6, list(range(6)))
    tokens, lp = sampling.sample(jnp.asarray(logits), arrays, jnp.arange(6))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    np.testing.assert_array_equal(lp, 0.0)


# ---------------------------------------------------------------------------- keys


def test_keys_depend_on_seed_position_and_purpose_only():
    data = lambda key: np.asarray(jax.random.key_data(key)).tolist()
    k = data(sampling.token_key(7, 100, sampling.PURPOSE_ACCEPT))
    assert k == data(sampling.token_key(jnp.uint32(7), jnp.int32(100), sampling.PURPOSE_ACCEPT))
    assert k == data(sampling.token_key(jax.random.key(7), 100, sampling.PURPOSE_ACCEPT))
    others = [data(sampling.token_key(8, 100, 2)), data(sampling.token_key(7, 101, 2)),
              data(sampling.token_key(7, 100, 3))]
    assert all(o != k for o in others)
    keys = sampling.token_keys(jnp.array([7, 8], jnp.uint32), jnp.array([[100, 101], [5, 6]]), 2)
    assert keys.shape == (2, 2) and data(keys[0, 0]) == k


def test_a_request_does_not_depend_on_its_lane_or_batch():
    rng = np.random.default_rng(6)
    mine = rng.normal(size=40).astype(np.float32)
    others = rng.normal(size=(4, 40)).astype(np.float32) * 3

    @jax.jit
    def both(logits, arrays, positions):
        return sampling.sample(logits, arrays, positions), sampling.draft_sample(
            logits, arrays, positions)[0]

    alone_arrays = SamplingArrays.from_lists([0.9], [12], [0.85], [1234])
    batch_arrays = SamplingArrays.from_lists([1.0, 0.0, 0.7, 0.9, 0.5], [0, 0, 3, 12, 0],
                                             [1.0, 1.0, 0.5, 0.85, 0.9], [1, 2, 3, 1234, 5])
    batch_logits = np.concatenate([others[:3], mine[None], others[3:]])
    seen = set()
    for position in range(0, 200, 7):
        (token, logprob), draft = both(mine[None], alone_arrays, jnp.array([position]))
        (tokens, logprobs), drafts = both(batch_logits, batch_arrays,
                                          jnp.array([9, 9, 9, position, 9]))
        assert int(token[0]) == int(tokens[3]) and int(draft[0]) == int(drafts[3])
        np.testing.assert_allclose(float(logprob[0]), float(logprobs[3]), rtol=1e-6)  # fusion
        seen.add(int(token[0]))
    assert len(seen) > 1  # the position really changes the draw


def test_bit_search_alone_serves_small_top_k(monkeypatch):
    """CANDIDATE_TOP_K = 0 (how scripts time the bit search against the candidate path) sends a
    Qwen3-style lane (top-k 20, top-p 0.8) through the bit search: no top_k in the program, and
    the same law. (Traced afresh each time, so no cached trace of the default stands in.)"""
    logits = jax.random.normal(jax.random.PRNGKey(5), (3, 4, 300)) * 2
    arrays = SamplingArrays.from_lists([0.7, 1.0, 0.0], [20, 5, 0], [0.8, 1.0, 1.0])
    unjitted = sampling.processed_logprobs.__wrapped__

    def run():
        args = (logits, arrays.temperature, arrays.top_k, arrays.top_p, arrays.greedy,
                sampling.FILTER_ALL)
        fresh = lambda *a: unjitted(*a)  # a new function: make_jaxpr caches traces per function
        names = {e.primitive.name for e in jax.make_jaxpr(fresh, static_argnums=5)(*args).eqns}
        return np.asarray(unjitted(*args)), names

    default, names = run()
    assert "top_k" in names
    monkeypatch.setattr(sampling, "CANDIDATE_TOP_K", 0)
    assert SamplingArrays.from_lists([0.7], [20], [0.8]).filter_paths == sampling.FILTER_ALL
    searched, names = run()
    assert "top_k" not in names
    np.testing.assert_array_equal(np.isinf(default), np.isinf(searched))
    np.testing.assert_allclose(default, searched, rtol=1e-6, atol=1e-6)
    assert np.isinf(searched[0]).sum() >= 4 * (300 - 20)  # lane 0 keeps <= 20 tokens per row
