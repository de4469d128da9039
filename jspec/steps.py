"""The jitted programs of stock decoding over the paged cache: chunked prefill and a device-resident
multi-step decode loop.

Split once, jit once: the model is `nnx.split` at load; every program here is a pure function of
(params, caches, metadata arrays) with the caches donated, so XLA updates the pools in place.
Shapes are static (lanes, pages per lane, chunk size, steps per dispatch); lengths, positions,
page tables and sampling parameters travel as arrays, so nothing recompiles after warm-up except
once for the first batch that needs a top-k / top-p path (`SamplingArrays.filter_paths`: at most
two more variants).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.kernels import reductions
from jspec.kernels.kv_cache_write import write_kv
from jspec.kernels.ragged_paged_attention import ragged_paged_attention
from jspec.paged_cache import NULL_PAGE
from jspec.qwen3 import Qwen3
from jspec.sampling import SamplingArrays, sample

Array = jax.Array


def slots_for(page_table_bp: Array, lanes_t: Array, positions_t: Array, page_size: int) -> Array:
    """Cache slot of each token: page_table[lane, pos // S] * S + pos % S."""
    pages_t = page_table_bp[lanes_t, positions_t // page_size]
    return pages_t * page_size + positions_t % page_size


def paged_attention(slot_mapping_t, kv_lens_b, page_table_bp, cu_q_lens, *, max_q_len, impl,
                    causal=True):
    """The model's attention callback over the paged cache (tokens flattened as B=1)."""

    def attend(layer_idx, q_1thk, k_1thk, v_1thk, cache):
        k_pages, v_pages = write_kv(cache[0], cache[1], k_1thk[0], v_1thk[0], slot_mapping_t)
        out_thk = ragged_paged_attention(
            q_1thk[0], k_pages, v_pages, kv_lens_b, page_table_bp, cu_q_lens,
            sm_scale=q_1thk.shape[-1] ** -0.5, causal=causal, max_q_len=max_q_len, impl=impl)
        return out_thk[None], (k_pages, v_pages)

    return attend


def prefill_layout(tokens_c: Array, start: Array, q_len: Array, page_row_p: Array, page_size: int,
                   attn_impl: str):
    """Positions, cache slots and the attention callback of one lane's prefill chunk: tokens
    [:q_len] at positions start.., padding rows written into the null page."""
    chunk = tokens_c.shape[0]
    idx_c = jnp.arange(chunk, dtype=jnp.int32)
    positions_c = start + jnp.minimum(idx_c, q_len - 1)
    page_table_1p = page_row_p[None]
    slots_c = slots_for(page_table_1p, jnp.zeros_like(idx_c), positions_c, page_size)
    slots_c = jnp.where(idx_c < q_len, slots_c, NULL_PAGE * page_size + idx_c % page_size)
    attend = paged_attention(slots_c, (start + q_len)[None], page_table_1p,
                             jnp.stack([0, q_len]).astype(jnp.int32), max_q_len=chunk,
                             impl=attn_impl)
    return positions_c, slots_c, attend


def sample_after_chunk(model: Qwen3, hidden_1cd: Array, start: Array, q_len: Array,
                       sampling: SamplingArrays):
    """The token after a prefill chunk's last row, and its model log-prob."""
    last_1d = jax.lax.dynamic_index_in_dim(hidden_1cd[0], q_len - 1, axis=0, keepdims=True)
    logits_1v = model.logits(last_1d)
    token_1, _ = sample(logits_1v, sampling, (start + q_len)[None])
    return token_1, token_logprobs(logits_1v, token_1, model.linear_impl)


def token_logprobs(logits_tv: Array, tokens_t: Array, impl: str = "xla") -> Array:
    """log p_model(token) under the raw (temperature 1, unfiltered) distribution; logits [..., V],
    tokens [...]. `impl` is the target's linear_impl: "triton" reduces each vocabulary row in a
    fixed order (kernels/reductions.py), so verify and decode score a token with the same bits."""
    return reductions.token_logprobs(logits_tv, tokens_t, impl)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "lengths", "page_table", "active", "remaining",
                                "stop_on_eos", "sampling"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-lane decode state, all [B] arrays except page_table [B, pages_per_lane].

    tokens: the last sampled token, not yet in the cache; lengths: tokens in the cache (so the
    next token sits at position `lengths`); remaining: tokens the lane may still emit."""
    tokens: Array
    lengths: Array
    page_table: Array
    active: Array
    remaining: Array
    stop_on_eos: Array
    sampling: SamplingArrays


# The command types XLA:GPU records into CUDA graphs by default (jax 0.10-0.11), plus WHILE and
# CONDITIONAL, with which XLA can record a dispatch's whole step loop as one graph whose loop test
# runs on the device (CUDA conditional nodes). Without them XLA runs a loop from the host, which
# launches each step's graphs and, for a data-dependent test, reads every step's predicate back.
_GRAPH_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION")


@functools.lru_cache(maxsize=1)
def device_loop_options() -> dict:
    """compiler_options that put while loops into command buffers, in the form this jaxlib
    accepts (newer ones add DYNAMIC_SLICE_COPY_FUSION to the defaults; older ones reject the
    name). {} when no form compiles: the loop then runs from the host, still correct."""
    for extra in (("DYNAMIC_SLICE_COPY_FUSION",), ()):
        opts = {"xla_gpu_enable_command_buffer": ",".join(_GRAPH_COMMANDS + extra
                                                          + ("WHILE", "CONDITIONAL"))}
        try:
            jax.jit(lambda x: x + 1, compiler_options=opts).lower(jnp.zeros(1)).compile()
        except Exception:  # noqa: BLE001 - jaxlib reports an unknown enum name as a runtime error
            continue
        return opts
    return {}


def loop_while_active(num_steps: int, body, carry, state_of):
    """`fori_loop(0, num_steps, body, carry)` that stops early once no lane is active
    (`state_of(carry).active`): the steps after every lane has ended would emit nothing."""

    def cond(c):
        i, inner = c
        return (i < num_steps) & jnp.any(state_of(inner).active)

    def step(c):
        i, inner = c
        return i + 1, body(i, inner)

    return jax.lax.while_loop(cond, step, (jnp.int32(0), carry))[1]


class Programs:
    """The three jitted entry points every engine kind provides, caches (argument 1) donated:
    prefill (one lane's chunk), decode (steps per dispatch), teacher_forced (scoring).

    device_loop: decode's step loop stops once every lane has ended, compiled with the options
    that let XLA run it as one CUDA graph with its test on the device (`device_loop_options`).
    Off: a fixed-count loop the host drives. (On the H200 the two ran at the same speed and the
    call returned as early; whether the loop became one graph is not established yet.)"""

    def __init__(self, page_size: int, eos_ids: tuple[int, ...], attn_impl: str,
                 device_loop: bool = False):
        self.page_size = page_size
        self.eos_ids = jnp.asarray(list(eos_ids) or [-1], jnp.int32)
        self.attn_impl = attn_impl
        self.device_loop = device_loop
        self.prefill = jax.jit(self._prefill, donate_argnums=(1,))
        self.decode = jax.jit(self._decode, donate_argnums=(1,), static_argnames=("num_steps",),
                              **({"compiler_options": device_loop_options()} if device_loop
                                 else {}))
        self.teacher_forced = jax.jit(self._teacher_forced, donate_argnums=(1,))

    def _step_loop(self, num_steps: int, body, carry, state_index: int):
        """The dispatch's loop over steps: `body(i, carry) -> carry`, carry[state_index] the
        DecodeState. With device_loop it ends once no lane is active."""
        if self.device_loop:
            return loop_while_active(num_steps, body, carry, lambda c: c[state_index])
        return jax.lax.fori_loop(0, num_steps, body, carry)


class StockPrograms(Programs):
    """Compiled-once prefill and decode programs for one model and one cache geometry."""

    def __init__(self, graphdef, page_size: int, eos_ids: tuple[int, ...], attn_impl: str = "auto",
                 device_loop: bool = False, prefill_graphdef=None):
        self.graphdef = graphdef
        # The model as prefill runs it (another matmul route, EngineConfig.invariant_prefill);
        # None: as decode runs it.
        self.prefill_graphdef = prefill_graphdef or graphdef
        super().__init__(page_size, eos_ids, attn_impl, device_loop)

    def model(self, params) -> Qwen3:
        return nnx.merge(self.graphdef, params)

    def _logprob_impl(self, params) -> str:
        """The target's reduction route for log-probs (its matmul route; a trace-time lookup)."""
        return self.model(params).linear_impl

    # ---- chunked prefill of one lane -------------------------------------------------------

    def _prefill(self, params, caches, tokens_c: Array, start: Array, q_len: Array,
                 page_row_p: Array, sampling: SamplingArrays):
        """Writes tokens[:q_len] at positions start.. into the lane's pages and samples the token
        after the last one (the host keeps it only for the final chunk).

        tokens_c [C] (padded), start / q_len scalars, page_row_p [pages_per_lane], sampling of 1 lane.
        Returns (caches, token [1], logprob [1])."""
        positions_c, _, attend = prefill_layout(tokens_c, start, q_len, page_row_p,
                                                self.page_size, self.attn_impl)
        model = nnx.merge(self.prefill_graphdef, params)
        hidden_1cd, _, caches = model(tokens_c[None], positions_c[None], attention=attend,
                                      caches=caches)
        return (caches, *sample_after_chunk(model, hidden_1cd, start, q_len, sampling))

    # ---- the device-resident decode loop ------------------------------------------------------

    def _step_logits(self, params, caches, state: DecodeState):
        """One q_len-1 target step for every lane: (caches, logits [B, V] f32)."""
        num_lanes = state.tokens.shape[0]
        lanes_b = jnp.arange(num_lanes, dtype=jnp.int32)
        positions_b = state.lengths
        slots_b = slots_for(state.page_table, lanes_b, positions_b, self.page_size)
        # Idle lanes write into the null page and attend to one null slot: harmless, finite.
        slots_b = jnp.where(state.active, slots_b, NULL_PAGE * self.page_size)
        kv_lens_b = jnp.where(state.active, state.lengths + 1, 1)
        attend = paged_attention(slots_b, kv_lens_b, state.page_table,
                                 jnp.arange(num_lanes + 1, dtype=jnp.int32), max_q_len=1,
                                 impl=self.attn_impl)
        model = self.model(params)
        hidden_1bd, _, caches = model(state.tokens[None], positions_b[None], attention=attend,
                                      caches=caches)
        return caches, model.logits(hidden_1bd[0])

    def _decode_step(self, params, caches, state: DecodeState):
        positions_b = state.lengths
        caches, logits_bv = self._step_logits(params, caches, state)
        new_b, _ = sample(logits_bv, state.sampling, positions_b + 1)
        logprob_b = token_logprobs(logits_bv, new_b, self._logprob_impl(params))
        is_eos = jnp.any(new_b[:, None] == self.eos_ids[None], axis=-1) & state.stop_on_eos
        emitted_b = state.active
        remaining = jnp.where(emitted_b, state.remaining - 1, state.remaining)
        state = dataclasses.replace(
            state,
            tokens=jnp.where(emitted_b, new_b, state.tokens),
            lengths=jnp.where(emitted_b, state.lengths + 1, state.lengths),
            remaining=remaining,
            active=emitted_b & ~is_eos & (remaining > 0),
        )
        return caches, state, jnp.where(emitted_b, new_b, -1), logprob_b

    def _decode(self, params, caches, state: DecodeState, *, num_steps: int):
        """num_steps decode steps in one dispatch. Returns (caches, state, tokens [B, n] with -1
        where a lane emitted nothing, logprobs [B, n])."""
        num_lanes = state.tokens.shape[0]

        def body(i, carry):
            caches, state, out_tokens, out_logprobs = carry
            caches, state, tok_b, lp_b = self._decode_step(params, caches, state)
            return (caches, state, out_tokens.at[:, i].set(tok_b), out_logprobs.at[:, i].set(lp_b))

        out_tokens = jnp.full((num_lanes, num_steps), -1, jnp.int32)
        out_logprobs = jnp.zeros((num_lanes, num_steps), jnp.float32)
        caches, state, out_tokens, out_logprobs = self._step_loop(
            num_steps, body, (caches, state, out_tokens, out_logprobs), state_index=1)
        return caches, state, out_tokens, out_logprobs


    def _teacher_forced(self, params, caches, state: DecodeState, forced_bn: Array):
        """Feed forced[:, i] at position lengths+i through the decode step; returns (caches,
        log p(forced[:, i+1]) [B, n-1]). The scoring twin of the decode loop."""
        n = forced_bn.shape[1]

        def body(i, carry):
            caches, state, out = carry
            state = dataclasses.replace(state, tokens=forced_bn[:, i])
            caches, logits_bv = self._step_logits(params, caches, state)
            lp = token_logprobs(logits_bv, forced_bn[:, i + 1], self._logprob_impl(params))
            state = dataclasses.replace(state, lengths=state.lengths + 1)
            return caches, state, out.at[:, i].set(lp)

        out = jnp.zeros((forced_bn.shape[0], n - 1), jnp.float32)
        caches, _, out = jax.lax.fori_loop(0, n - 1, body, (caches, state, out))
        return caches, out


def compile_count(fn: Any) -> int:
    """Compiled variants held by a jitted function (for the no-recompilation test)."""
    return fn._cache_size()
