"""Device-side sampling: one processing law for target and drafter, per-request keys.

Everything here is pure `jax.random` + `jax.numpy`, jit-able, and takes the per-lane sampling
parameters as *arrays* (`SamplingArrays`), never as static arguments: changing a request's
temperature / top-k / top-p / seed never recompiles. One static field says which filtering
paths the batch needs (`SamplingArrays.filter_paths`: none, the top-k candidate path, or all
paths), so a program compiles at most three times. The variants compute the same law; XLA
fuses them differently, so a lane's log-probs may differ between them in the last fp32 bit (a
token could change only where two candidates tie to ~1e-7). Within a variant a request never
depends on its batch.

The processed distribution (`processed_logprobs`), exactly:

  1. x = logits.astype(f32) / T                     (T = the lane's temperature)
  2. top-k (k > 0 and k < V): keep v iff x_v >= t_k, where t_k is the k-th largest value of x
     counted with multiplicity. Ties at t_k are all kept, so more than k tokens may survive
     (same rule as HF `TopKLogitsWarper` / vLLM). -0.0 and +0.0 count as equal.
  3. top-p (0 < top_p < 1): pi = softmax(x restricted to the top-k survivors) in fp32. Keep v iff
     x_v >= x_(m), where x_(1) >= x_(2) >= ... is x sorted descending and m is the shortest
     prefix whose mass pi_(1) + ... + pi_(m) reaches top_p (an fp32 sum). Ties with x_(m) are
     kept, as for top-k. The argmax always survives, so top_p -> 0 means "argmax and its ties".
  4. renormalise: log-softmax over the survivors; filtered tokens get exactly -inf.
  5. greedy lanes (temperature <= SAMPLING_EPS): one-hot at argmax(logits), i.e. log-prob 0 at
     the argmax and -inf elsewhere; top-k / top-p are ignored. Ties in the argmax go to the
     lowest token id (`jnp.argmax`).

How it is computed without a full sort, per lane (the choice depends only on the lane's own
parameters, never on the batch):
  * 0 < top_k <= CANDIDATE_TOP_K (64; Qwen3's default is 20): candidate path. The row is cut
    into chunks of 128; `lax.top_k` over the chunk maxima picks the 64 chunks that must hold the
    top 64 values (see `_candidate_top_k_top_p` for why this is exact, ties included); one
    `lax.top_k` over those 8192 candidates gives the k-th value, and a cumsum over the sorted
    survivors gives the top-p cut. About four vocab passes in all.
  * larger top_k, or top-p without top-k: a bitwise search over the order-preserving uint32
    image of x (the tpu-inference / T5X trick, widened to 2 bits per pass on accelerators): 16
    vocab passes, each counting (top-k) or summing the mass (top-p) above 3 candidate thresholds
    at once (1 bit, 32 passes, on CPU). No sort, gather or scatter over the vocabulary.
  Only the paths that the static `filter_paths` names are in the program: with no filtering
  lane, plain temperature sampling costs one log-softmax. There is no `lax.cond`: on the GPU a
  cond copies its predicate to the host and blocks it until the stream drains, every step.
  The two paths compute the same cut up to the order of the fp32 mass summation, which matters
  only when a prefix mass is within rounding of top_p.

The public functions are `jax.jit`-wrapped so that eager calls are fast; inside an outer jit
they simply inline.

Randomness: every draw uses a key derived from the request's seed, the absolute position of
the token it concerns, and a small purpose tag (`token_key`). A request's tokens therefore never
depend on its lane index or on what else is batched with it (up to the static variant above),
and a key is never shared between two different kinds of draw.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SAMPLING_EPS = 1e-5  # temperature at or below this means greedy (DeepSpec / vLLM use the same)

# Purpose tags folded into the key together with the absolute token position.
PURPOSE_SAMPLE = 0  # plain (non-speculative) decode of the token at `position`
PURPOSE_DRAFT = 1  # the drafter's proposal for the token at `position`
PURPOSE_ACCEPT = 2  # the acceptance uniform of the draft at `position`
PURPOSE_RESIDUAL = 3  # the verifier's own token at `position`: residual or bonus
PURPOSE_BLOCK_ACCEPT = 4  # block verification's uniform for the draft at `position` (per round)

_MAX_SEED = 2**32

# Lanes with 0 < top_k <= this use the few-pass candidate path (0: every top-k lane takes the bit
# search; read when a program is traced, so scripts may set it first to time the two paths).
CANDIDATE_TOP_K = 64

# SamplingArrays.filter_paths: the filtering paths compiled into a program (module docstring).
FILTER_NONE = "none"  # no lane filters: no cut at all
FILTER_CANDIDATE = "candidate"  # only lanes with 0 < top_k <= CANDIDATE_TOP_K filter
FILTER_ALL = "all"  # some lane needs the bit search: larger top_k, or top-p without a small top_k
FILTER_PATHS = (FILTER_NONE, FILTER_CANDIDATE, FILTER_ALL)


def filter_paths_for(top_k, top_p, greedy) -> str:
    """The variant that serves every lane of a batch (host values, one per lane)."""
    top_k, top_p, greedy = (np.asarray(a) for a in (top_k, top_p, greedy))
    sampled = ~greedy.astype(bool)
    candidate = sampled & (top_k > 0) & (top_k <= CANDIDATE_TOP_K)
    search = sampled & ~candidate & ((top_k > 0) | (top_p < 1.0))
    if search.any():
        return FILTER_ALL
    return FILTER_CANDIDATE if candidate.any() else FILTER_NONE


_CHUNK = 128  # vocabulary chunk of the candidate preselection (151936 = 1187 * 128)
SEARCH_BITS_PER_PASS = 2  # bit search on accelerators: 16 vocab passes, 3 thresholds each


def _bits_per_pass(bits_per_pass):
    """An accelerator pays per vocab pass, a CPU per comparison: 1 bit per pass there."""
    if bits_per_pass:
        return bits_per_pass
    return 1 if jax.default_backend() == "cpu" else SEARCH_BITS_PER_PASS


# ----------------------------------------------------------------------------------------------
# Per-lane parameters
# ----------------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "greedy", "seed"],
    meta_fields=["filter_paths"],
)
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-lane sampling parameters; a pytree of [B] arrays (never static), plus one static field.

    `filter_paths` (static, part of the pytree structure): which filtering paths the batch
    needs (FILTER_NONE / FILTER_CANDIDATE / FILTER_ALL, from `filter_paths_for`). Only those
    are compiled, and every lane runs them with its own cut picked by `jnp.where`, instead of a
    device test of whether any lane needs a path: a `lax.cond` on the GPU copies its predicate
    to the host and blocks the host until the stream drains (measured on the H200: about 77 us
    of idle GPU per cond, 8 conds per speculative iteration, and no launch can run ahead). So
    a program has at most three compiled variants; they agree to fp32 rounding (module
    docstring).
    """

    temperature: Any  # [B] f32; only meaningful where not greedy
    top_k: Any  # [B] i32; 0 = off
    top_p: Any  # [B] f32; 1.0 = off
    greedy: Any  # [B] bool; temperature <= SAMPLING_EPS
    seed: Any  # [B] u32; the request's seed
    filter_paths: str = FILTER_ALL  # static: the filtering paths compiled (filter_paths_for)

    def __post_init__(self):
        if self.filter_paths not in FILTER_PATHS:
            raise ValueError(f"filter_paths must be one of {FILTER_PATHS}, "
                             f"got {self.filter_paths!r}")

    @property
    def num_lanes(self) -> int:
        return int(np.shape(self.temperature)[0])

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int | None] | None = None,
        top_p: Sequence[float | None] | None = None,
        seed: Sequence[int | None] | None = None,
    ) -> "SamplingArrays":
        """Host-side (numpy) arrays for B lanes, validated.

        None (for a whole list or one entry) means "off" for top_k / top_p. A None seed draws a
        fresh random seed on the host, so unseeded requests do not all share one stream; pass
        explicit seeds for reproducible output.
        """
        temperature = [float(t) for t in temperature]
        num_lanes = len(temperature)

        def per_lane(values, name):
            values = [None] * num_lanes if values is None else list(values)
            if len(values) != num_lanes:
                raise ValueError(f"{name} has {len(values)} entries, temperature has {num_lanes}")
            return values

        top_k = [0 if k is None else k for k in per_lane(top_k, "top_k")]
        top_p = [1.0 if p is None else float(p) for p in per_lane(top_p, "top_p")]
        seeds = per_lane(seed, "seed")
        fresh = np.random.default_rng()
        seeds = [int(fresh.integers(_MAX_SEED)) if s is None else s for s in seeds]
        for lane, (t, k, p, s) in enumerate(zip(temperature, top_k, top_p, seeds)):
            if not (np.isfinite(t) and t >= 0.0):
                raise ValueError(f"lane {lane}: temperature must be finite and >= 0, got {t}")
            if isinstance(k, bool) or int(k) != k or k < 0:
                raise ValueError(f"lane {lane}: top_k must be an integer >= 0 (0 = off), got {k}")
            if not (0.0 < p <= 1.0):
                raise ValueError(f"lane {lane}: top_p must be in (0, 1] (1 = off), got {p}")
            if isinstance(s, bool) or int(s) != s or not (0 <= s < _MAX_SEED):
                raise ValueError(f"lane {lane}: seed must be an integer in [0, 2**32), got {s}")
        temperature = np.asarray(temperature, np.float32)
        greedy = temperature <= SAMPLING_EPS
        return cls(
            temperature=temperature,
            top_k=np.asarray([int(k) for k in top_k], np.int32),
            top_p=np.asarray(top_p, np.float32),
            greedy=greedy,
            seed=np.asarray([int(s) for s in seeds], np.uint32),
            filter_paths=filter_paths_for(top_k, top_p, greedy),
        )

    @classmethod
    def stack(cls, requests: Sequence[Any]) -> "SamplingArrays":
        """From per-request objects or dicts with temperature / top_k / top_p / seed."""

        def get(r, name, default):
            value = r.get(name, default) if isinstance(r, dict) else getattr(r, name, default)
            return default if value is None else value

        return cls.from_lists(
            temperature=[get(r, "temperature", 1.0) for r in requests],
            top_k=[get(r, "top_k", 0) for r in requests],
            top_p=[get(r, "top_p", 1.0) for r in requests],
            seed=[get(r, "seed", None) for r in requests],
        )

    @classmethod
    def padding(cls, num_lanes: int) -> "SamplingArrays":
        """Parameters for empty lanes: greedy (cheapest: no filtering, no noise needed), seed 0."""
        return cls.from_lists([0.0] * num_lanes, seed=[0] * num_lanes)

    def pad_to(self, num_lanes: int) -> "SamplingArrays":
        """Append greedy padding lanes up to `num_lanes` (host arrays)."""
        extra = num_lanes - self.num_lanes
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_lanes} lanes down to {num_lanes}")
        pad = dataclasses.replace(SamplingArrays.padding(extra), filter_paths=self.filter_paths)
        return jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), b]), self, pad)


# ----------------------------------------------------------------------------------------------
# The processed distribution
# ----------------------------------------------------------------------------------------------


def _lane_param(param, ndim: int):
    """[B] (or [B, ...]) -> [B, ..., 1, ...] broadcastable against [B, ..., V] of rank ndim."""
    param = jnp.asarray(param)
    return param.reshape(param.shape + (1,) * (ndim - param.ndim))


def _ordered_uint32(x_f32):
    """Order-preserving map float32 -> uint32 (a < b  <=>  key(a) < key(b); -0 == +0).

    Every float, -inf included, maps above 0, so the key 0 means "keep everything".
    """
    x_f32 = jnp.where(x_f32 == 0.0, 0.0, x_f32)  # -0.0 -> +0.0 so the two tie
    bits = lax.bitcast_convert_type(x_f32, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _bit_search(threshold_shape, holds, bits_per_pass):
    """Largest uint32 t with holds(t), for a predicate that holds at 0 and is monotone (true up
    to some t*, false above). Fixes `bits_per_pass` bits per vocab pass, from the top: each pass
    tests the 2**b - 1 candidates that extend the prefix found so far, and since the predicate is
    monotone the number that hold is the value of the next b bits. 32 / b passes.

    holds: candidates [..., C] uint32 -> bool [..., C].
    """
    steps = jnp.arange(1, 2**bits_per_pass, dtype=jnp.uint32)  # [C]

    def refine(i, threshold):  # threshold [..., 1]
        shift = (32 - bits_per_pass * (i + 1)).astype(jnp.uint32)
        candidates = threshold | (steps << shift)  # [..., C]
        num_holding = jnp.sum(holds(candidates), axis=-1, keepdims=True, dtype=jnp.uint32)
        return threshold | (num_holding << shift)

    # Unrolled: a while loop on the GPU syncs with the host on every trip.
    return lax.fori_loop(0, 32 // bits_per_pass, refine,
                         jnp.zeros(threshold_shape, jnp.uint32), unroll=True)


def _search_top_k(x_f32, top_k, bits_per_pass=None):
    """Key [..., 1] of the k-th largest x (with multiplicity), by bit search."""
    bits_per_pass = _bits_per_pass(bits_per_pass)

    def at_least_k_above(candidates):
        above = _ordered_uint32(x_f32)[..., None, :] >= candidates[..., :, None]  # [..., C, V]
        return jnp.sum(above, axis=-1, dtype=jnp.int32) >= top_k

    return _bit_search(x_f32.shape[:-1] + (1,), at_least_k_above, bits_per_pass)


def _search_top_p(x_f32, x_max, top_p, k_cut, bits_per_pass=None):
    """Key [..., 1] of the nucleus cut of softmax(x restricted to key(x) >= k_cut): the largest
    t with mass(key(x) >= t) >= top_p, by bit search."""
    bits_per_pass = _bits_per_pass(bits_per_pass)
    survives = _ordered_uint32(x_f32) >= k_cut
    z = jnp.sum(jnp.where(survives, jnp.exp(x_f32 - x_max), 0.0), axis=-1, keepdims=True)

    def mass_reaches_top_p(candidates):
        # probs are recomputed from x in every pass: an exp is cheaper than reading a 2nd array
        key = _ordered_uint32(x_f32)
        probs = jnp.where(key >= k_cut, jnp.exp(x_f32 - x_max), 0.0) / z
        above = key[..., None, :] >= candidates[..., :, None]  # [..., C, V]
        mass = jnp.sum(jnp.where(above, probs[..., None, :], 0.0), axis=-1)
        return mass >= top_p

    threshold = _bit_search(x_f32.shape[:-1] + (1,), mass_reaches_top_p, bits_per_pass)
    return jnp.minimum(threshold, _ordered_uint32(x_max))  # always keep the argmax


def _candidate_top_k_top_p(x_f32, top_k, top_p, use_top_p):
    """Key [..., 1] of the top-k (then top-p) cut for 1 <= top_k <= CANDIDATE_TOP_K, exactly,
    from a few vocab passes instead of 64.

    Split the vocabulary into chunks of _CHUNK. The cap chunks with the largest maxima hold
    every value above the cap-th largest chunk max, and at least cap values >= it, so their
    union has the same top-cap values (with multiplicity) as the whole row: the k-th largest
    is exact. Survivors outside the union can only equal the k-th value (ties), which the
    final `x >= threshold` mask keeps, and which `z` counts in the nucleus mass.
    """
    cap = CANDIDATE_TOP_K
    vocab = x_f32.shape[-1]
    num_chunks = -(-vocab // _CHUNK)
    if num_chunks <= cap:  # small vocabulary: every chunk would be picked
        candidates = x_f32
    else:
        pad = [(0, 0)] * (x_f32.ndim - 1) + [(0, num_chunks * _CHUNK - vocab)]
        chunks = jnp.pad(x_f32, pad, constant_values=-jnp.inf)
        chunks = chunks.reshape(x_f32.shape[:-1] + (num_chunks, _CHUNK))
        _, best_chunks = lax.top_k(jnp.max(chunks, axis=-1), cap)
        candidates = jnp.take_along_axis(chunks, best_chunks[..., None], axis=-2)
        candidates = candidates.reshape(x_f32.shape[:-1] + (cap * _CHUNK,))
    top_values, _ = lax.top_k(candidates, min(cap, candidates.shape[-1]))  # descending
    # top_k >= the row's length (a tiny vocabulary) cuts at its smallest value: keeps all.
    k_threshold = jnp.take_along_axis(top_values, jnp.clip(top_k, 1, top_values.shape[-1]) - 1,
                                      axis=-1)

    # Nucleus of the top-k survivors, in the sorted order of top_values.
    x_max = top_values[..., :1]
    z = jnp.sum(jnp.where(x_f32 >= k_threshold, jnp.exp(x_f32 - x_max), 0.0), axis=-1,
                keepdims=True)
    probs = jnp.where(top_values >= k_threshold, jnp.exp(top_values - x_max), 0.0) / z
    reached = jnp.cumsum(probs, axis=-1) >= top_p
    first = jnp.argmax(reached, axis=-1, keepdims=True)
    p_threshold = jnp.where(jnp.any(reached, axis=-1, keepdims=True),
                            jnp.take_along_axis(top_values, first, axis=-1), k_threshold)
    return _ordered_uint32(jnp.where(use_top_p, p_threshold, k_threshold))


@functools.partial(jax.jit, static_argnames=("filter_paths",))
def processed_logprobs(logits, temperature, top_k, top_p, greedy, filter_paths: str = FILTER_ALL):
    """Log-probs [..., V] f32 of the distribution actually sampled (see module docstring).

    filter_paths (static): the filtering paths compiled in; it must serve every lane
    (`filter_paths_for` of the same parameters, as `SamplingArrays` holds it). FILTER_ALL, the
    default, serves any parameters.

    logits: [B, ..., V] (any float dtype; processed in fp32). temperature / top_k / top_p /
    greedy: [B] per-lane parameters (or any shape that is a prefix of logits.shape[:-1]); they
    broadcast over the axes between lane and vocab, e.g. logits [B, K, V] with params [B].
    Use the same function, with the same parameters, for the target's p and the drafter's q.
    """
    if filter_paths not in FILTER_PATHS:
        raise ValueError(f"filter_paths must be one of {FILTER_PATHS}, got {filter_paths!r}")
    logits_f32 = logits.astype(jnp.float32)
    ndim = logits_f32.ndim
    temperature, top_k, top_p, greedy = (
        _lane_param(a, ndim) for a in (temperature, top_k, top_p, greedy)
    )
    greedy = greedy.astype(bool)
    top_k = top_k.astype(jnp.int32)
    top_p = top_p.astype(jnp.float32)
    temperature = jnp.where(greedy, 1.0, temperature.astype(jnp.float32))
    x_f32 = logits_f32 / temperature

    # argmax(logits) serves greedy lanes and gives max(x): dividing by T > 0 keeps the order.
    argmax = jnp.argmax(logits_f32, axis=-1, keepdims=True)
    x_max = jnp.take_along_axis(x_f32, argmax, axis=-1)

    # Which lane takes which path depends on its own parameters only (the same rule as
    # filter_paths_for), so a request's law never depends on its batch. Every compiled path runs
    # for all lanes and each lane keeps its own cut (jnp.where): no lax.cond. The cuts are
    # uint32 keys of x ([..., 1]), 0 meaning "keep everything". A top_k >= vocab keeps every
    # token on either path, as top-k off does.
    sampled = ~greedy
    small_k = (top_k > 0) & (top_k <= CANDIDATE_TOP_K) & sampled  # top-k and its top-p
    large_k = (top_k > CANDIDATE_TOP_K) & sampled  # top-k by bit search
    searched_p = (top_p < 1.0) & ~small_k & sampled  # top-p by bit search (after a large top-k)
    no_cut = jnp.zeros(x_f32.shape[:-1] + (1,), jnp.uint32)
    cut = no_cut
    if filter_paths in (FILTER_CANDIDATE, FILTER_ALL) and CANDIDATE_TOP_K > 0:
        cut = jnp.where(small_k, _candidate_top_k_top_p(x_f32, top_k, top_p, top_p < 1.0), no_cut)
    if filter_paths == FILTER_ALL:
        k_cut = jnp.where(large_k, _search_top_k(x_f32, top_k), no_cut)
        p_cut = jnp.where(searched_p, _search_top_p(x_f32, x_max, top_p, k_cut), no_cut)
        cut = jnp.maximum(jnp.maximum(cut, k_cut), p_cut)
    keep = _ordered_uint32(x_f32) >= cut
    shifted = x_f32 - x_max
    log_z = jnp.log(jnp.sum(jnp.where(keep, jnp.exp(shifted), 0.0), axis=-1, keepdims=True))
    sampled_logprobs = jnp.where(keep, shifted - log_z, -jnp.inf)

    vocab_ids = lax.broadcasted_iota(jnp.int32, logits_f32.shape, ndim - 1)
    greedy_logprobs = jnp.where(vocab_ids == argmax, 0.0, -jnp.inf)
    return jnp.where(greedy, greedy_logprobs, sampled_logprobs)


def process(logits, arrays: SamplingArrays):
    """`processed_logprobs` with the parameters taken from a `SamplingArrays`."""
    return processed_logprobs(logits, arrays.temperature, arrays.top_k, arrays.top_p, arrays.greedy,
                              filter_paths=arrays.filter_paths)


# ----------------------------------------------------------------------------------------------
# Keys and draws
# ----------------------------------------------------------------------------------------------


def token_key(seed_or_base_key, position, purpose):
    """The key of one draw: fold(fold(key(seed), purpose), position). Scalars in, scalar out.

    seed_or_base_key: a uint32 seed, or an already-made typed key (e.g. a per-request base key).
    position: absolute token position the draw concerns. purpose: one of the PURPOSE_* tags.
    """
    dtype = getattr(seed_or_base_key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        key = seed_or_base_key
    else:
        key = jax.random.key(jnp.asarray(seed_or_base_key, jnp.uint32))
    key = jax.random.fold_in(key, jnp.asarray(purpose, jnp.uint32))
    return jax.random.fold_in(key, jnp.asarray(position, jnp.uint32))


def token_keys(seeds, positions, purpose):
    """Elementwise `token_key` over broadcast seeds / positions: [B] x [B, K] -> keys [B, K]."""
    positions = jnp.asarray(positions)
    seeds = jnp.asarray(seeds)
    seeds = seeds.reshape(seeds.shape + (1,) * (positions.ndim - seeds.ndim))
    seeds, positions = jnp.broadcast_arrays(seeds, positions)
    flat = jax.vmap(lambda s, p: token_key(s, p, purpose))(seeds.reshape(-1), positions.reshape(-1))
    return flat.reshape(positions.shape)


def round_token_keys(seeds, positions, purpose, round_starts):
    """`token_keys` made fresh per speculative round: round_starts [B] (the round's first
    position, unique per round of a request) is folded in too. Block verification needs this:
    its accept length depends on every draft and uniform of the round, also those past the
    tokens it emits, and the next round drafts those positions again."""
    keys = token_keys(seeds, positions, purpose)
    starts = jnp.asarray(round_starts)
    starts = starts.reshape(starts.shape + (1,) * (keys.ndim - starts.ndim))
    starts = jnp.broadcast_to(starts, keys.shape).astype(jnp.uint32)
    flat = jax.vmap(jax.random.fold_in)(keys.reshape(-1), starts.reshape(-1))
    return flat.reshape(keys.shape)


def gumbel_noise(keys, vocab: int):
    """Standard Gumbel noise [*keys.shape, vocab] in fp32, one independent row per key."""
    flat = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys.reshape(-1))
    return flat.reshape(keys.shape + (vocab,))


def sample_from_logprobs(logprobs, keys):
    """Gumbel-max draw: argmax(logprobs + G) ~ softmax(logprobs). logprobs [..., V], keys [...].

    logprobs may be unnormalised log-weights; -inf entries are never drawn.
    """
    noise = gumbel_noise(keys, logprobs.shape[-1])
    return jnp.argmax(logprobs + noise, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="purpose")
def sample(logits, arrays: SamplingArrays, positions, purpose=PURPOSE_SAMPLE):
    """One token per lane from the processed law. logits [B, V]; positions [B] (absolute
    position of the token being sampled). Returns (tokens [B] int32, logprobs [B] f32: the
    processed log-prob of each sampled token; 0.0 for greedy lanes).
    """
    logprobs = process(logits, arrays)
    tokens = sample_from_logprobs(logprobs, token_keys(arrays.seed, positions, purpose))
    tokens = jnp.where(arrays.greedy, jnp.argmax(logprobs, axis=-1).astype(jnp.int32), tokens)
    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_logprobs


@jax.jit
def draft_sample(logits, arrays: SamplingArrays, positions, round_start=None):
    """The drafter's step: (tokens [B] int32, q_logprobs [B, V] f32).

    logits [B, V] are the drafter's corrected logits (for DSpark: base + Markov bias of the
    *sampled* previous token, before temperature). positions [B] is the absolute position of
    the token being drafted. Stack the returned q rows into rejection_sample's draft_logprobs:
    they are exactly the law each draft was drawn from. round_start [B] (the round's first
    position) makes the keys fresh per round, as block verification needs (round_token_keys).
    """
    q_logprobs = process(logits, arrays)
    if round_start is None:
        keys = token_keys(arrays.seed, positions, PURPOSE_DRAFT)
    else:
        keys = round_token_keys(arrays.seed, positions, PURPOSE_DRAFT, round_start)
    tokens = sample_from_logprobs(q_logprobs, keys)
    tokens = jnp.where(arrays.greedy, jnp.argmax(q_logprobs, axis=-1).astype(jnp.int32), tokens)
    return tokens, q_logprobs
