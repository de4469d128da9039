"""Lossless speculative verification (reference/dspark.md section 4), pure JAX, padded [B, K].

One round per lane: the anchor sits at absolute position s, drafts x_1..x_n (n = num_draft <= K)
at positions s+1..s+n were sampled from q_1..q_n, and the target was run over
[anchor, x_1..x_K], giving p_0..p_K (p_i is the law of the token at s+i+1). `positions` below is
s+1, the position of the first token this round can emit.

  accept x_k  iff  log u_k + log q_k(x_k) < log p_{k-1}(x_k)     (k <= n; same as u*q < p,
                                                                  without division or underflow)
  a = length of the all-accept prefix
  a < n : emit x_1..x_a, then r ~ max(p_a - q_{a+1}, 0) normalised (p_a if its mass <= 1e-8)
  a = n : emit x_1..x_n, then the bonus ~ p_n
So a + 1 tokens (1..K+1) are emitted. p and q must come from the same `processed_logprobs`
(temperature, top-k, top-p), q being exactly the law each draft was drawn from; a draft that
the target filtered out (p = 0) is never accepted.

Block verification (rule="block"; Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025) decides the accept length from the whole block at once. With weights
  w_0 = 1,  w_i = min(w_{i-1} p_{i-1}(x_i) / q_i(x_i), 1)
  m_i = sum_x max(w_i p_i(x) - q_{i+1}(x), 0)                 (the residual mass after x_1..x_i)
  h_i = m_i / (m_i + 1 - w_i) for i < n  (0 when both are 0),  h_n = w_n
and uniforms eta_1..eta_n, a = the largest i with eta_i < h_i (0 if none); then
  a < n : emit x_1..x_a, then r ~ max(w_a p_a - q_{a+1}, 0) normalised
  a = n : emit x_1..x_n, then the bonus ~ p_n.
The law of the output is still the target's, and the expected accept length is never below the
token rule's (for n = 1 the two are the same rule). tests/test_rejection.py checks the law
exactly by enumerating every draft block and outcome of a small vocabulary, n a stopping time
of the drafts included (the confidence gate's case).

Greedy lanes: accept x_k iff x_k == argmax p_{k-1}; the replacement / bonus is argmax p_a. The
emitted tokens are exactly the target's greedy chain, whatever q is (either rule).

Keys (per request, per absolute position, never per lane; see sampling.token_key):
  draft x_k     token_key(seed, s+k, PURPOSE_DRAFT)     -- the drafter's job (draft_sample)
  uniform u_k   token_key(seed, s+k, PURPOSE_ACCEPT)
  residual/bonus token_key(seed, s+a+1, PURPOSE_RESIDUAL)
Every draw that decides the tokens up to position t uses keys of positions <= t, so a later
round's draws are independent of everything already emitted, even though positions that were
drafted but rejected get drafted again (with the same draft key) in the next round.
The block rule's accept length depends on every draft and uniform of the round, also those past
the tokens it emits, so there the drafts' and uniforms' keys also fold in the round's first
position (sampling.round_token_keys; uniforms under PURPOSE_BLOCK_ACCEPT): no round reuses a
draw another round's outcome depended on.

Not here: EOS / stop handling (the engine truncates the emitted tokens after the first stop
token and ends the request; that is a decision about the output, not about the law), writing
the KV cache, and choosing num_draft (which must not look at the drafts it admits).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec import sampling

RESIDUAL_MASS_EPS = 1e-8  # below this residual mass, sample p_a itself (DeepSpec's rule)
PAD_TOKEN = -1  # out_tokens past num_emitted
VERIFY_RULES = ("token", "block")


class RejectionResult(NamedTuple):
    tokens: jax.Array  # [B, K+1] int32; PAD_TOKEN past num_emitted
    num_emitted: jax.Array  # [B] int32 in 1..K+1 (= accepted drafts + 1)
    logprobs: jax.Array  # [B, K+1] f32: processed-target log-prob of each emitted token; 0 past


def _take_rows(x_bkv, rows_b):
    """x [B, K, V], rows [B] -> x[b, rows[b]] : [B, V]."""
    return jnp.take_along_axis(x_bkv, rows_b[:, None, None], axis=1)[:, 0]


def _logprobs_at(logprobs_bkv, tokens_bk):
    """logprobs[b, k, tokens[b, k]] : [B, K] (K = tokens' width; rows past it are not read).
    Padding ids (< 0) read token 0: callers mask positions past num_draft."""
    ids_bk1 = jnp.clip(tokens_bk, 0, logprobs_bkv.shape[-1] - 1)[..., None]
    return jnp.take_along_axis(logprobs_bkv[:, :tokens_bk.shape[1]], ids_bk1, axis=-1)[..., 0]


def _within_drafts(tests_bk, num_draft):
    """The tests with those past each lane's num_draft set False."""
    return tests_bk & (jnp.arange(tests_bk.shape[1])[None, :] < num_draft[:, None])


def _prefix_length(accept_bk):
    """[B] int32: how many leading tests pass."""
    return jnp.sum(jnp.cumprod(accept_bk.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _greedy_tests(target_logprobs, draft_tokens):
    """[B, K] bool: x_k == argmax p_{k-1}, the test of greedy lanes under either rule."""
    return draft_tokens == jnp.argmax(target_logprobs[:, :draft_tokens.shape[1]], axis=-1)


def accept_drafts(target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy, uniforms):
    """The token rule's accept test. Returns (accept [B, K] bool, num_accepted [B] int32 in
    0..num_draft).

    target_logprobs [B, K+1, V] (processed p_0..p_K), draft_logprobs [B, K, V] (q_1..q_K),
    draft_tokens [B, K], num_draft [B], greedy [B] bool, uniforms [B, K] in [0, 1).
    accept[:, k-1] is the test of draft x_k alone; num_accepted is its all-accept prefix length.
    """
    logp_x = _logprobs_at(target_logprobs, draft_tokens)  # p_{k-1}(x_k)
    logq_x = _logprobs_at(draft_logprobs, draft_tokens)  # q_k(x_k)
    # log u + log q < log p  <=>  u * q < p; -inf never yields NaN here (no +inf terms), p = 0
    # always rejects, and u = 0 accepts iff p > 0.
    accept = jnp.log(uniforms.astype(jnp.float32)) + logq_x < logp_x
    accept = jnp.where(greedy[:, None], _greedy_tests(target_logprobs, draft_tokens), accept)
    accept = _within_drafts(accept, num_draft)
    return accept, _prefix_length(accept)


def _log_positive_gap(lp, lq):
    """log max(exp(lp) - exp(lq), 0) elementwise, as lp + log1p(-exp(lq - lp)), so tokens with
    tiny p are not flushed to zero before the difference is taken."""
    positive = lp > lq
    gap = jnp.where(positive, lq - lp, -1.0)  # keep the unused branch finite
    return jnp.where(positive, lp + jnp.log1p(-jnp.exp(gap)), -jnp.inf)


def residual_logprobs(target_logprobs_bv, draft_logprobs_bv, log_weight_b=None):
    """Normalised log of max(w p - q, 0) [B, V] (w = 1 unless log_weight_b [B] is given: the
    block rule's weight); falls back to p where that mass <= 1e-8."""
    lp, lq = jnp.asarray(target_logprobs_bv), jnp.asarray(draft_logprobs_bv)
    weighted = lp if log_weight_b is None else lp + log_weight_b[:, None]
    log_residual = _log_positive_gap(weighted, lq)
    log_mass = jax.nn.logsumexp(log_residual, axis=-1, keepdims=True)
    use_target = log_mass <= jnp.log(RESIDUAL_MASS_EPS)
    normalised = log_residual - jnp.where(use_target, 0.0, log_mass)
    return jnp.where(use_target, lp, normalised)


def block_acceptance(target_logprobs, draft_logprobs, draft_tokens, num_draft):
    """Block verification's numbers (module docstring). Returns (stop [B, K] f32: h_1..h_K, 0
    past num_draft; log_weight [B, K+1] f32: log w_0..log w_K). Shapes as in accept_drafts."""
    batch, num_drafts_max = draft_tokens.shape
    logp_x = _logprobs_at(target_logprobs, draft_tokens)
    logq_x = _logprobs_at(draft_logprobs, draft_tokens)
    # p / q in log space; a draft q could not have drawn (q = 0, e.g. padding) counts as p / 0.
    log_ratio = jnp.where(logq_x > -jnp.inf, logp_x - logq_x,
                          jnp.where(logp_x > -jnp.inf, jnp.inf, -jnp.inf))
    log_w = [jnp.zeros((batch,), jnp.float32)]
    for k in range(num_drafts_max):  # K <= 8: unrolled
        prev = log_w[-1]
        log_w.append(jnp.where(prev > -jnp.inf, jnp.minimum(prev + log_ratio[:, k], 0.0), -jnp.inf))
    log_w_bk1 = jnp.stack(log_w, axis=1)  # [B, K+1]

    # h_i for i < K: the residual mass after x_1..x_i against the mass 1 - w_i not yet spent.
    lw_inner = log_w_bk1[:, 1:num_drafts_max, None]  # w_1..w_{K-1}
    log_mass = jax.nn.logsumexp(
        _log_positive_gap(target_logprobs[:, 1:num_drafts_max] + lw_inner,
                          draft_logprobs[:, 1:num_drafts_max]), axis=-1)  # [B, K-1]
    log_unspent = jnp.log(-jnp.expm1(log_w_bk1[:, 1:num_drafts_max]))  # log(1 - w_i)
    log_total = jnp.logaddexp(log_mass, log_unspent)
    inner = jnp.where(log_total > -jnp.inf, jnp.exp(log_mass - log_total), 0.0)
    inner = jnp.concatenate([inner, jnp.zeros((batch, 1), jnp.float32)], axis=1)  # [B, K]
    i_k = jnp.arange(1, num_drafts_max + 1)[None, :]
    stop = jnp.where(i_k < num_draft[:, None], inner,
                     jnp.where(i_k == num_draft[:, None], jnp.exp(log_w_bk1[:, 1:]), 0.0))
    return stop.astype(jnp.float32), log_w_bk1


def block_accept(target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy, uniforms):
    """The block rule's accept length. Returns (num_accepted [B] int32 in 0..num_draft: the
    largest i with uniforms[:, i-1] < h_i, else 0; log_weight [B]: log w at that length, 0 on
    greedy lanes, which follow the token rule's argmax chain)."""
    stop, log_w_bk1 = block_acceptance(target_logprobs, draft_logprobs, draft_tokens, num_draft)
    i_k = jnp.arange(1, draft_tokens.shape[1] + 1, dtype=jnp.int32)[None, :]
    num_accepted = jnp.max(jnp.where(uniforms < stop, i_k, 0), axis=1, initial=0)
    log_weight = jnp.take_along_axis(log_w_bk1, num_accepted[:, None], axis=1)[:, 0]
    greedy_accepted = _prefix_length(_within_drafts(_greedy_tests(target_logprobs, draft_tokens),
                                                    num_draft))
    num_accepted = jnp.where(greedy, greedy_accepted, num_accepted).astype(jnp.int32)
    return num_accepted, jnp.where(greedy, 0.0, log_weight)


def _emit(target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy, num_accepted,
          residual_gumbel, log_weight=None):
    """Tokens and log-probs for a known accept length; residual_gumbel [B, V] is the noise of
    the single residual / bonus draw (Gumbel-max); log_weight [B]: the block rule's w_a."""
    batch, num_rows, _ = target_logprobs.shape
    num_drafts_max = num_rows - 1
    target_row = _take_rows(target_logprobs, num_accepted)  # p_a [B, V]
    if num_drafts_max > 0:
        draft_row = _take_rows(draft_logprobs, jnp.minimum(num_accepted, num_drafts_max - 1))
        is_bonus = num_accepted >= num_draft  # all proposed drafts accepted (or none proposed)
        law = jnp.where(is_bonus[:, None], target_row,
                        residual_logprobs(target_row, draft_row, log_weight))
    else:
        law = target_row
    new_token = jnp.argmax(law + residual_gumbel, axis=-1).astype(jnp.int32)
    new_token = jnp.where(greedy, jnp.argmax(target_row, axis=-1).astype(jnp.int32), new_token)
    new_logprob = jnp.take_along_axis(target_row, new_token[:, None], axis=-1)[:, 0]

    rows = jnp.arange(num_rows)[None, :]  # output slot i is position s+1+i
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    draft_lp = _logprobs_at(target_logprobs, draft_tokens)
    draft_lp = jnp.concatenate([draft_lp, jnp.zeros((batch, 1), jnp.float32)], axis=1)
    accepted = rows < num_accepted[:, None]
    is_new = rows == num_accepted[:, None]
    tokens = jnp.where(accepted, drafts, jnp.where(is_new, new_token[:, None], PAD_TOKEN))
    logprobs = jnp.where(accepted, draft_lp, jnp.where(is_new, new_logprob[:, None], 0.0))
    return RejectionResult(tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32),
                           logprobs)


def check_rule(rule: str, what: str = "verify rule") -> None:
    """Raise a ValueError naming `what` unless `rule` is one of VERIFY_RULES."""
    if rule not in VERIFY_RULES:
        raise ValueError(f"{what} must be one of {VERIFY_RULES}, got {rule!r}")


def _accept(rule, target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy, uniforms):
    """(num_accepted [B], log_weight [B] or None) under `rule`."""
    if rule == "block":
        return block_accept(target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy,
                            uniforms)
    _, num_accepted = accept_drafts(target_logprobs, draft_logprobs, draft_tokens, num_draft,
                                    greedy, uniforms)
    return num_accepted, None


@functools.partial(jax.jit, static_argnames="rule")
def rejection_sample_core(target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy,
                          uniforms, residual_gumbel, rule: str = "token") -> RejectionResult:
    """The rule with explicit randomness (for exact tests and custom key schemes).

    target_logprobs [B, K+1, V] processed p_0..p_K; draft_logprobs [B, K, V] q_1..q_K;
    draft_tokens [B, K] int32; num_draft [B] int32 (clipped to 0..K); greedy [B] bool;
    uniforms [B, K] in [0, 1); residual_gumbel [B, V] standard Gumbel noise for the one
    residual / bonus draw; rule "token" or "block" (module docstring).
    """
    check_rule(rule)
    num_draft = jnp.clip(num_draft, 0, draft_tokens.shape[1]).astype(jnp.int32)
    num_accepted, log_weight = _accept(rule, target_logprobs, draft_logprobs, draft_tokens,
                                       num_draft, greedy, uniforms)
    return _emit(target_logprobs, draft_logprobs, draft_tokens, num_draft, greedy, num_accepted,
                 residual_gumbel, log_weight)


@functools.partial(jax.jit, static_argnames="rule")
def rejection_sample(target_logits, draft_logprobs, draft_tokens, num_draft,
                     arrays: sampling.SamplingArrays, positions,
                     rule: str = "token") -> RejectionResult:
    """One verification round per lane with per-request keys.

    target_logits [B, K+1, V] raw target logits over [anchor, x_1..x_K] (any float dtype);
    draft_logprobs [B, K, V] f32: q exactly as the drafter sampled from it (processed_logprobs of
    the drafter's corrected logits with the same `arrays`, e.g. the rows of draft_sample);
    draft_tokens [B, K] int32; num_draft [B] int32 (lanes may propose fewer than K; entries past
    it are ignored); positions [B] int32: absolute position of the first token to be emitted
    (anchor position + 1). Under rule="block" the drafts must have been drawn with keys fresh
    to this round (draft_sample's round_start = positions). Returns RejectionResult(tokens
    [B, K+1], num_emitted [B], logprobs).
    """
    check_rule(rule)
    num_drafts_max = draft_tokens.shape[1]
    vocab = target_logits.shape[-1]
    num_draft = jnp.clip(num_draft, 0, num_drafts_max).astype(jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    target_logprobs = sampling.process(target_logits, arrays)

    draft_positions = positions[:, None] + jnp.arange(num_drafts_max, dtype=jnp.int32)[None, :]
    if rule == "block":
        accept_keys = sampling.round_token_keys(arrays.seed, draft_positions,
                                                sampling.PURPOSE_BLOCK_ACCEPT, positions)
    else:
        accept_keys = sampling.token_keys(arrays.seed, draft_positions, sampling.PURPOSE_ACCEPT)
    uniforms = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(
        accept_keys.reshape(-1)).reshape(accept_keys.shape)
    num_accepted, log_weight = _accept(rule, target_logprobs, draft_logprobs, draft_tokens,
                                       num_draft, arrays.greedy, uniforms)

    # The residual / bonus lands at position s+1+a: its key is known only after the accept test.
    residual_keys = sampling.token_keys(arrays.seed, positions + num_accepted,
                                        sampling.PURPOSE_RESIDUAL)
    residual_gumbel = sampling.gumbel_noise(residual_keys, vocab)
    return _emit(target_logprobs, draft_logprobs, draft_tokens, num_draft, arrays.greedy,
                 num_accepted, residual_gumbel, log_weight)
