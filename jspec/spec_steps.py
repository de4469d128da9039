"""The jitted programs of speculative decoding: prefill (target + drafter context) and a
device-resident loop of speculative iterations (draft, verify, accept, commit).

Both pools share one page table: the drafter's pool has the same pages and slots as the
target's (5 layers instead of 36), so one host allocator serves both.

One iteration for a lane whose committed context is positions 0..s-1 (in both caches) and whose
anchor token (committed, not yet seen by the target) sits at s:
  draft   block [anchor, mask x (K-1)] at s..s+K-1; its K/V are written past the committed
          length (s..s+K-1) and attended with no causal mask; U = lm_head(h); the Markov head
          samples x_1..x_K left to right, q_k recorded exactly as sampled.
  verify  the target over [anchor, x_1..x_K] at s..s+K (q_len K+1), with the taps.
  accept  lossless rejection sampling: a accepted drafts + 1 replacement/bonus token, the accept
          length decided by block verification or draft by draft (verify_rule, rejection.py).
  commit  the drafter's context K/V for s..s+K from the taps (rows past s+a are rewritten next
          round before anything reads them); the new length is s+a+1 (rejection only rewinds
          the length; nothing is copied); EOS / max-tokens truncation on device.

Confidence-gated verify (verify_threshold > 0, DSpark's prefix rule): the drafter's confidence
head estimates c_k, the chance that x_k survives given x_1..x_{k-1} did; a lane proposes the
drafts whose cumulative a_k = c_1 ... c_k is at least the threshold (a prefix, as a_k never
rises). c_k reads the block's hidden state and x_{k-1}, never x_k, so whether x_k is verified
does not depend on x_k: the number of drafts is a stopping time of the lane's own draws and the
rejection sampler stays exact. Nothing in the rule looks at another lane, so a request's tokens
still depend only on its own seed. The lanes' rows [anchor, x_1..x_{n_b}] are packed one after
another and the target runs over the smallest of a few static row counts that holds them all
(`verify_buckets`; lax.switch picks the compiled branch), so rows nobody proposes cost nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.draft_vocab import DraftVocab
from jspec.draft_weights import Int8Weight
from jspec.dspark import DSparkConfig, DSparkDrafter
from jspec.kernels.kv_cache_write import write_kv
from jspec.paged_cache import NULL_PAGE
from jspec.qwen3 import Qwen3, project
from jspec.rejection import check_rule, rejection_sample
from jspec.sampling import SamplingArrays, draft_sample
from jspec.steps import (DecodeState, Programs, paged_attention, prefill_layout,
                         sample_after_chunk, slots_for, token_logprobs)

Array = jax.Array


# Rows per lane of the static verify sizes a confidence-gated iteration picks from (times the
# lanes; the last is always the whole block, K + 1). Each is one more compiled branch.
VERIFY_BUCKET_WIDTHS = (2, 3, 4, 6)


def check_confidence_head(threshold: float, dcfg: DSparkConfig) -> None:
    """A threshold > 0 needs a drafter with a confidence head (EngineConfig checks its range)."""
    if threshold > 0 and not dcfg.confidence_head:
        raise ValueError("verify_threshold needs a drafter with a confidence head (DSpark); "
                         "this drafter has none (DFlash)")


def verify_buckets(num_lanes: int, width: int) -> tuple[int, ...]:
    """Static row counts of the confidence-gated verify, ascending; the last is every lane's
    whole block (num_lanes * width), which holds any choice of drafts."""
    sizes = {num_lanes * w for w in VERIFY_BUCKET_WIDTHS if w < width}
    return tuple(sorted(sizes | {num_lanes * width}))


def proposed_drafts(confidence_logits_bk: Array, threshold: float, num_draft: int) -> Array:
    """Drafts each lane proposes [B]: the longest prefix of x_1..x_K (K = num_draft) whose
    cumulative confidence c_1 ... c_k stays >= threshold. c_k must not depend on x_k."""
    c_bk = jax.nn.sigmoid(confidence_logits_bk[:, :num_draft].astype(jnp.float32))
    survival_bk = jnp.cumprod(c_bk, axis=1)  # non-increasing: the kept set is a prefix
    return jnp.sum(survival_bk >= threshold, axis=1).astype(jnp.int32)


def confidence_prev_tokens(anchor_b: Array, draft_bk: Array) -> Array:
    """The token before each draft [B, K]: the anchor, then x_1..x_{K-1}. c_k reads x_{k-1}
    from here, never x_k: that is what keeps the confidence-gated verify lossless."""
    return jnp.concatenate([anchor_b[:, None], draft_bk[:, :-1]], 1)


def _lane_grid(num_lanes: int, width: int):
    """lanes [B*W] and offsets [B*W] of a flattened [B, W] block."""
    lanes = jnp.repeat(jnp.arange(num_lanes, dtype=jnp.int32), width)
    offsets = jnp.tile(jnp.arange(width, dtype=jnp.int32), num_lanes)
    return lanes, offsets


class SpecPrograms(Programs):
    def __init__(self, target_graphdef, draft_graphdef, dcfg: DSparkConfig, page_size: int,
                 eos_ids: tuple[int, ...], attn_impl: str = "auto", num_draft: int | None = None,
                 device_loop: bool = False, verify_threshold: float = 0.0,
                 prefill_graphdef=None, verify_rule: str = "block"):
        self.tg, self.dg, self.dcfg = target_graphdef, draft_graphdef, dcfg
        # The target as prefill runs it (StockPrograms says why it may differ).
        self.prefill_tg = prefill_graphdef or target_graphdef
        # The drafter always runs its whole block (that is what it was trained on); only the
        # first `num_draft` tokens are proposed and verified.
        self.k = num_draft or dcfg.block_size
        if not 1 <= self.k <= dcfg.block_size:
            raise ValueError(f"num_draft_tokens must be in 1..{dcfg.block_size} (the drafter's "
                             f"block size), got {self.k}")
        check_confidence_head(verify_threshold, dcfg)
        self.verify_threshold = float(verify_threshold)
        check_rule(verify_rule, "verify_rule")
        self.verify_rule = verify_rule
        super().__init__(page_size, eos_ids, attn_impl, device_loop)

    def models(self, params) -> tuple[Qwen3, DSparkDrafter]:
        return nnx.merge(self.tg, params[0]), nnx.merge(self.dg, params[1])

    @staticmethod
    def draft_vocab(params) -> DraftVocab | None:
        """The engine's draft vocabulary (params[2]), or None: the whole vocabulary."""
        return params[2] if len(params) > 2 else None

    @staticmethod
    def draft_head(params) -> Int8Weight | None:
        """An int8 copy of the target's lm_head for the drafter's base logits (params[3], with
        draft_weight_dtype "int8" and no draft vocabulary), or None: the target's own."""
        return params[3] if len(params) > 3 else None

    def _write_context(self, drafter: DSparkDrafter, dcaches, taps, positions_1t, slots_t):
        """Drafter context K/V of target-tapped rows, into the draft pool at `slots_t`."""
        kv = drafter.context_kv(drafter.fuse(taps), positions_1t)
        return [write_kv(dk, dv, k[0], v[0], slots_t) for (dk, dv), (k, v) in zip(dcaches, kv)]

    # ---- prefill --------------------------------------------------------------------------------

    def _prefill(self, params, caches, tokens_c, start, q_len, page_row_p, sampling: SamplingArrays):
        """As the stock prefill, plus the drafter's context K/V for the chunk."""
        target = nnx.merge(self.prefill_tg, params[0])
        drafter = nnx.merge(self.dg, params[1])
        tcaches, dcaches = caches
        positions_c, slots_c, attend = prefill_layout(tokens_c, start, q_len, page_row_p,
                                                      self.page_size, self.attn_impl)
        hidden_1cd, taps, tcaches = target(tokens_c[None], positions_c[None], attention=attend,
                                           caches=tcaches, tap_layers=self.dcfg.target_layer_ids)
        dcaches = self._write_context(drafter, dcaches, taps, positions_c[None], slots_c)
        return ((tcaches, dcaches), *sample_after_chunk(target, hidden_1cd, start, q_len, sampling))

    # ---- one speculative iteration ------------------------------------------------------------

    def draft(self, target: Qwen3, drafter: DSparkDrafter, dcaches, state: DecodeState,
              vocab: DraftVocab | None = None, head: Int8Weight | None = None):
        """Returns (dcaches, draft tokens [B,K], q log-probs [B,K,V] f32, confidence logits
        [B,K] f32: z_k from the block's hidden state and x_{k-1}). With a draft `vocab`, the
        drafter's law lives on its ids (q is -inf elsewhere). `head`: the drafter's int8 copy of
        the lm_head (SpecPrograms.draft_head); a vocabulary's head may be int8 itself."""
        K, B = self.dcfg.block_size, state.tokens.shape[0]
        lanes_t, offs_t = _lane_grid(B, K)
        s_b = state.lengths
        block_bk = jnp.concatenate(
            [state.tokens[:, None], jnp.full((B, K - 1), self.dcfg.mask_token_id, jnp.int32)], 1)
        positions_t = s_b[lanes_t] + offs_t
        slots_t = slots_for(state.page_table, lanes_t, positions_t, self.page_size)
        slots_t = jnp.where(state.active[lanes_t], slots_t, NULL_PAGE * self.page_size + offs_t % self.page_size)
        kv_lens = jnp.where(state.active, s_b + K, K)
        attend = paged_attention(slots_t, kv_lens, state.page_table,
                                 jnp.arange(B + 1, dtype=jnp.int32) * K, max_q_len=K,
                                 impl=self.attn_impl, causal=False)
        emb_1td = target.embed(block_bk.reshape(1, B * K))
        hidden_1td, dcaches = drafter.block_hidden(emb_1td, positions_t[None], attend, dcaches)
        hidden_bkd = hidden_1td[0].reshape(B, K, -1)
        # Only the first self.k block positions are drafted: the head (the widest GEMM of the
        # draft; a custom call on the invariant route, which XLA cannot slice through) reads
        # B x k rows, not B x K (busy at 3 drafts: 96 rows instead of 224).
        hidden_bkd_used = hidden_bkd[:, :self.k]
        if vocab is not None:  # U on the draft ids only: the drafter's numbers never touch the law
            head = vocab.head
        # U, fp32: the target's own head, or the drafter's rows (bf16 or int8) on XLA's GEMM.
        base_bkv = (target.logits(hidden_bkd_used) if head is None
                    else project(hidden_bkd_used, head, drafter.linear_impl))
        w2_rows = None if vocab is None else vocab.markov_w2
        prev = state.tokens
        # Block verification's outcome reads every draft, so its drafts' keys are fresh per round.
        round_start = s_b + 1 if self.verify_rule == "block" else None
        tokens, q_logprobs = [], []
        for k in range(self.k):  # the Markov chain: each step conditions on the sampled previous token
            logits_bv = base_bkv[:, k]
            if not drafter.cfg.is_dflash:  # DFlash has no Markov head (and no bias to add)
                logits_bv = logits_bv + drafter.markov_bias(prev, hidden_bkd[:, k], w2_rows)
            x_b, q_bv = draft_sample(logits_bv, state.sampling, s_b + k + 1, round_start)
            if vocab is not None:
                x_b, q_bv = vocab.ids[x_b], vocab.scatter(q_bv, target.cfg.vocab_size)
            tokens.append(x_b)
            q_logprobs.append(q_bv)
            prev = x_b
        draft_bk = jnp.stack(tokens, 1)
        confidence_bk = drafter.confidence_logits(hidden_bkd[:, :self.k],
                                                  confidence_prev_tokens(state.tokens, draft_bk))
        return dcaches, draft_bk, jnp.stack(q_logprobs, 1), confidence_bk

    def verify(self, target: Qwen3, tcaches, state: DecodeState, draft_bk):
        """Target over [anchor, drafts] at s..s+K. Returns (tcaches, logits [B,K+1,V], taps)."""
        W, B = self.k + 1, state.tokens.shape[0]
        lanes_t, offs_t = _lane_grid(B, W)
        tokens_bw = jnp.concatenate([state.tokens[:, None], draft_bk], 1)
        positions_t = state.lengths[lanes_t] + offs_t
        slots_t = slots_for(state.page_table, lanes_t, positions_t, self.page_size)
        slots_t = jnp.where(state.active[lanes_t], slots_t, NULL_PAGE * self.page_size + offs_t % self.page_size)
        kv_lens = jnp.where(state.active, state.lengths + W, W)
        attend = paged_attention(slots_t, kv_lens, state.page_table,
                                 jnp.arange(B + 1, dtype=jnp.int32) * W, max_q_len=W,
                                 impl=self.attn_impl)
        hidden_1td, taps, tcaches = target(tokens_bw.reshape(1, B * W), positions_t[None],
                                           attention=attend, caches=tcaches,
                                           tap_layers=self.dcfg.target_layer_ids)
        logits = target.logits(hidden_1td[0]).reshape(B, W, -1)
        return tcaches, logits, taps, positions_t, slots_t

    def packed_verify(self, target: Qwen3, drafter: DSparkDrafter, tcaches, dcaches,
                      state: DecodeState, draft_bk, num_draft_b, rows: int):
        """The target over each lane's [anchor, x_1..x_{n_b}] (n_b = num_draft_b), the lanes'
        rows packed one after another into `rows` (>= their total; the rest are padding that
        writes the null page and attends nothing), and the drafter's context K/V of those rows.
        Returns (tcaches, dcaches, logits [B, K+1, V]): row j of lane b is its packed row
        min(j, n_b), so rows past n_b repeat the last verified one (the sampler reads none)."""
        W, B = self.k + 1, state.tokens.shape[0]
        rows_b = num_draft_b + 1
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(rows_b)]).astype(jnp.int32)
        i_t = jnp.arange(rows, dtype=jnp.int32)
        lanes_t = jnp.clip(jnp.searchsorted(cu, i_t, side="right") - 1, 0, B - 1).astype(jnp.int32)
        valid_t = i_t < cu[B]
        offs_t = jnp.where(valid_t, i_t - cu[lanes_t], 0)
        tokens_bw = jnp.concatenate([state.tokens[:, None], draft_bk], 1)
        tokens_t = tokens_bw[lanes_t, offs_t]
        positions_t = state.lengths[lanes_t] + offs_t
        slots_t = slots_for(state.page_table, lanes_t, positions_t, self.page_size)
        live_t = valid_t & state.active[lanes_t]
        slots_t = jnp.where(live_t, slots_t, NULL_PAGE * self.page_size + i_t % self.page_size)
        kv_lens = jnp.where(state.active, state.lengths + rows_b, rows_b)
        attend = paged_attention(slots_t, kv_lens, state.page_table, cu, max_q_len=W,
                                 impl=self.attn_impl)
        hidden_1td, taps, tcaches = target(tokens_t[None], positions_t[None], attention=attend,
                                           caches=tcaches, tap_layers=self.dcfg.target_layer_ids)
        logits_tv = target.logits(hidden_1td[0])
        rows_bw = cu[:B, None] + jnp.minimum(jnp.arange(W, dtype=jnp.int32)[None], num_draft_b[:, None])
        dcaches = self._write_context(drafter, dcaches, taps, positions_t[None], slots_t)
        return tcaches, dcaches, logits_tv[rows_bw]

    def _verify_gated(self, target, drafter, tcaches, dcaches, state, draft_bk, num_draft_b):
        """packed_verify at the smallest static row count that holds every lane's rows."""
        B = state.tokens.shape[0]
        buckets = verify_buckets(B, self.k + 1)
        total = jnp.sum(num_draft_b + 1)
        index = jnp.sum(jnp.asarray(buckets[:-1], jnp.int32) < total)
        branches = [lambda ops, m=m: self.packed_verify(target, drafter, *ops, rows=m)
                    for m in buckets]
        return jax.lax.switch(index, branches, (tcaches, dcaches, state, draft_bk, num_draft_b))

    def _iteration(self, params, caches, state: DecodeState):
        target, drafter = self.models(params)
        tcaches, dcaches = caches
        K, B = self.k, state.tokens.shape[0]
        dcaches, draft_bk, q_bkv, confidence_bk = self.draft(target, drafter, dcaches, state,
                                                             self.draft_vocab(params),
                                                             self.draft_head(params))
        if self.verify_threshold > 0:
            num_draft_b = jnp.where(state.active, proposed_drafts(
                confidence_bk, self.verify_threshold, K), 0)
            tcaches, dcaches, logits_bwv = self._verify_gated(target, drafter, tcaches, dcaches,
                                                              state, draft_bk, num_draft_b)
        else:
            num_draft_b = jnp.full((B,), K, jnp.int32)
            tcaches, logits_bwv, taps, positions_t, slots_t = self.verify(target, tcaches, state,
                                                                          draft_bk)
            dcaches = self._write_context(drafter, dcaches, taps, positions_t[None], slots_t)
        result = rejection_sample(logits_bwv, q_bkv, draft_bk, num_draft_b, state.sampling,
                                  state.lengths + 1, rule=self.verify_rule)

        # Commit: truncate after the first EOS and at the lane's remaining budget.
        W = K + 1
        j = jnp.arange(W, dtype=jnp.int32)[None]
        emitted = j < result.num_emitted[:, None]
        is_eos = (jnp.any(result.tokens[..., None] == self.eos_ids, -1) & emitted
                  & state.stop_on_eos[:, None])
        first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1), W)
        n_keep = jnp.minimum(jnp.minimum(result.num_emitted, first_eos + 1), state.remaining)
        n_keep = jnp.where(state.active, n_keep, 0)
        kept = j < n_keep[:, None]
        out_tokens = jnp.where(kept, result.tokens, -1)
        out_logprobs = token_logprobs(logits_bwv, jnp.maximum(result.tokens, 0), target.linear_impl)
        last = jnp.take_along_axis(result.tokens, jnp.maximum(n_keep - 1, 0)[:, None], 1)[:, 0]
        remaining = state.remaining - n_keep
        state = dataclasses.replace(
            state,
            tokens=jnp.where(n_keep > 0, last, state.tokens),
            lengths=state.lengths + n_keep,
            remaining=remaining,
            active=state.active & (first_eos >= n_keep) & (remaining > 0),
        )
        # Tokens committed by this verify step (0: the lane was idle), and the drafts it verified.
        return ((tcaches, dcaches), state, out_tokens, jnp.where(kept, out_logprobs, 0.0), n_keep,
                jnp.where(n_keep > 0, num_draft_b, 0))

    def _decode(self, params, caches, state: DecodeState, *, num_steps: int):
        """num_steps speculative iterations. Returns (caches, state, tokens [B, n*(K+1)] with -1
        gaps, logprobs [B, n*(K+1)], emitted-per-iteration [B, n] (0 = idle), drafts verified
        per iteration [B, n] (K unless the confidence gate verified fewer; 0 = idle))."""
        B, W = state.tokens.shape[0], self.k + 1

        def body(i, carry):
            caches, state, toks, lps, steps, drafts = carry
            caches, state, t_bw, lp_bw, n_b, d_b = self._iteration(params, caches, state)
            toks = jax.lax.dynamic_update_slice(toks, t_bw, (0, i * W))
            lps = jax.lax.dynamic_update_slice(lps, lp_bw, (0, i * W))
            return caches, state, toks, lps, steps.at[:, i].set(n_b), drafts.at[:, i].set(d_b)

        init = (caches, state, jnp.full((B, num_steps * W), -1, jnp.int32),
                jnp.zeros((B, num_steps * W), jnp.float32), jnp.zeros((B, num_steps), jnp.int32),
                jnp.zeros((B, num_steps), jnp.int32))
        return self._step_loop(num_steps, body, init, state_index=1)

    def _teacher_forced(self, params, caches, state: DecodeState, forced_bn: Array):
        """Score forced tokens through the verify path, K+1 per block: block j feeds
        forced[:, jW] as the anchor and forced[:, jW+1 : jW+W] as the drafts. Returns (caches,
        log p(forced[:, i+1]) [B, n-1]); n - 1 must be a multiple of W = K+1."""
        target, _ = self.models(params)
        tcaches, dcaches = caches
        W = self.k + 1
        blocks = (forced_bn.shape[1] - 1) // W

        def body(j, carry):
            tcaches, state, out = carry
            chunk = jax.lax.dynamic_slice_in_dim(forced_bn, j * W, W + 1, axis=1)
            state = dataclasses.replace(state, tokens=chunk[:, 0])
            tcaches, logits_bwv, _, _, _ = self.verify(target, tcaches, state, chunk[:, 1:W])
            lp = token_logprobs(logits_bwv, chunk[:, 1:], target.linear_impl)
            state = dataclasses.replace(state, lengths=state.lengths + W)
            return tcaches, state, jax.lax.dynamic_update_slice(out, lp, (0, j * W))

        out = jnp.zeros((forced_bn.shape[0], blocks * W), jnp.float32)
        tcaches, _, out = jax.lax.fori_loop(0, blocks, body, (tcaches, state, out))
        return (tcaches, dcaches), out
