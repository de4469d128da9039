"""Qwen3 dense decoder in Flax NNX.

Weights keep Hugging Face's layouts up to free reshapes (no host transposes at load):
  embed_tokens [V, D]            lm_head [V, D] (absent when tied: embed_tokens is reused)
  q_proj [Hq, hd, D]             k_proj / v_proj [Hkv, hd, D]       o_proj [D, Hq, hd]
  gate_proj / up_proj [F, D]     down_proj [D, F]                   norms [D] / q_norm, k_norm [hd]
Parameter paths mirror the checkpoint keys ("model.layers.3.self_attn.q_proj.weight" is
layers[3].self_attn.q_proj), so the key map is a rename, and every layer owns its own buffers
(measured on the H200: slicing layers out of stacked weights inside a scan halved decode speed).

Attention is injected: the model computes q/k/v (with q/k RMSNorm and RoPE) and hands them to an
`attention(layer_idx, q, k, v, cache) -> (out, cache)` callable. The dense causal version below
serves tests and simple use; the paged engine passes its own. Tokens are [B, T] throughout; the
paged engine flattens ragged batches to B = 1.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import Qwen3Config
from jspec.draft_weights import Int8Weight, int8_linear
from jspec.kernels.linear import linear, linear_partials, sum_in_order
from jspec.kernels.reductions import (add_rms_norm, qk_norm_rope, rms_norm, rope_cos_sin,
                                      rope_rotate)

Array = jax.Array
# attention(layer_idx, q [B,T,Hq,hd], k [B,T,Hkv,hd], v [B,T,Hkv,hd], layer_cache) -> (out [B,T,Hq,hd], layer_cache)
AttentionFn = Callable[[int, Array, Array, Array, Any], tuple[Array, Any]]


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """Qwen3's RMSNorm: normalise in fp32, cast to the weight's dtype, then scale (the order
    transformers uses). The output is in the weight's dtype whatever the input's: the residual
    stream is fp32 (see DecoderLayer), the matmuls that follow read the model dtype. `impl`
    (kernels/reductions.py) follows the model's matmul route: _set_linear_impl sets it."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.impl = "xla"

    def __call__(self, x: Array, out_dtype=None) -> Array:
        """out_dtype float32: skip the rounding (for values that stay fp32 until a matmul)."""
        return rms_norm(x, self.weight[...], self.eps, out_dtype, self.impl)

    def add_norm(self, x: Array, partials: Array | None) -> tuple[Array, Array]:
        """The residual add and this norm: (x + sum_in_order(partials) in fp32, its norm). The
        partials are the projection writing into the stream, uncombined (project_partials): on
        the "triton" route one kernel adds and normalises (kernels/reductions.add_rms_norm).
        None: nothing to add (the first layer's input)."""
        if partials is None:
            x = x.astype(jnp.float32)
            return x, self(x)
        return add_rms_norm(x, partials, self.weight[...], self.eps, self.impl)


def apply_rope(x_bthk: Array, positions_bt: Array, theta: float) -> Array:
    """Rotate-half RoPE (Hugging Face convention), computed in fp32."""
    cos_btf, sin_btf = rope_cos_sin(positions_bt, x_bthk.shape[-1], theta)
    cos_bt1f, sin_bt1f = cos_btf[:, :, None, :], sin_btf[:, :, None, :]
    rotated = rope_rotate(x_bthk.astype(jnp.float32), cos_bt1f, sin_bt1f)
    return rotated.astype(x_bthk.dtype)


def project(x: Array, w: Array, impl: str = "xla") -> Array:
    """x [..., K] through a weight stored output-major ([N..., K], e.g. q_proj [Hq, hd, D]) ->
    fp32 [..., N...]. Every projection of the model goes through here (kernels/linear.py). An
    int8 drafter weight (jspec/draft_weights.py) is scaled after the GEMM."""
    if isinstance(w, Int8Weight):
        y = int8_linear(x, w.reshape(-1, w.shape[-1]), impl)
        return y.reshape(x.shape[:-1] + w.shape[:-1])
    y = linear(x, w.reshape(-1, w.shape[-1]), impl)
    return y.reshape(x.shape[:-1] + w.shape[:-1])


def project_partials(x: Array, w: Array, impl: str = "xla") -> Array:
    """project's output as fp32 [P, ..., N...] split partials (kernels/linear.linear_partials):
    project(x, w, impl) == sum_in_order of them. The kernel that reads the result next sums them
    itself (RMSNorm.add_norm, reductions.qk_norm_rope). An int8 weight gives one partial."""
    if isinstance(w, Int8Weight):
        return project(x, w, impl)[None]
    p = linear_partials(x, w.reshape(-1, w.shape[-1]), impl)
    return p.reshape(p.shape[:1] + x.shape[:-1] + w.shape[:-1])


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        D, Hq, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nnx.Param(_normal(rngs, (Hq, hd, D), dtype))
        self.k_proj = nnx.Param(_normal(rngs, (Hkv, hd, D), dtype))
        self.v_proj = nnx.Param(_normal(rngs, (Hkv, hd, D), dtype))
        self.o_proj = nnx.Param(_normal(rngs, (D, Hq, hd), dtype))
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.rope_theta = cfg.rope_theta
        self.num_heads, self.num_kv_heads = Hq, Hkv
        self.linear_impl = "xla"  # kernels/linear.py; fuse_projections sets the serving choice

    @property
    def fused(self) -> bool:
        return hasattr(self, "qkv_proj")

    def fuse(self) -> None:
        """Replace q/k/v_proj by one qkv_proj [Hq+2Hkv, hd, D] (one GEMM reads all three; on the
        H200 three small GEMMs ran at 3.2 TB/s). The same math; only the GEMM's tiling may change
        its fp32 accumulation order. Idempotent."""
        if not self.fused:
            self.qkv_proj = nnx.Param(jnp.concatenate(
                [self.q_proj[...], self.k_proj[...], self.v_proj[...]], axis=0))
            del self.q_proj, self.k_proj, self.v_proj

    def unfuse(self) -> None:
        """Back to the checkpoint layout (q_proj, k_proj, v_proj); the exact inverse of fuse."""
        if self.fused:
            q, k, v = jnp.split(self.qkv_proj[...], [self.num_heads, self.num_heads + self.num_kv_heads])
            self.q_proj, self.k_proj, self.v_proj = nnx.Param(q), nnx.Param(k), nnx.Param(v)
            del self.qkv_proj

    def qkv(self, x_btd: Array, positions_bt: Array) -> tuple[Array, Array, Array]:
        """q and k stay fp32 through their norms and rope and are rounded once; so is v. On the
        invariant route a fused projection's heads go through one kernel
        (reductions.qk_norm_rope)."""
        f32, dt, impl = jnp.float32, x_btd.dtype, self.linear_impl
        Hq, Hkv = self.num_heads, self.num_kv_heads
        if self.fused and impl == "triton":
            qkv = project_partials(x_btd, self.qkv_proj[...], impl)  # fp32 [P, B, T, H, hd]
            cos, sin = rope_cos_sin(positions_bt, qkv.shape[-1], self.rope_theta)
            out = qk_norm_rope(qkv, self.q_norm.weight[...], self.k_norm.weight[...], cos, sin,
                               self.q_norm.eps, Hq, Hkv, dt, impl)
            q, k, v = jnp.split(out, [Hq, Hq + Hkv], axis=2)
            return q, k, v
        if self.fused:
            q, k, v = jnp.split(project(x_btd, self.qkv_proj[...], impl),
                                [self.num_heads, self.num_heads + self.num_kv_heads], axis=2)
        else:
            q, k, v = (project(x_btd, w[...], impl) for w in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q, f32), self.k_norm(k, f32)
        return (apply_rope(q, positions_bt, self.rope_theta).astype(dt),
                apply_rope(k, positions_bt, self.rope_theta).astype(dt), v.astype(dt))

    def out_partials(self, attn_bthk: Array) -> Array:
        """o_proj as fp32 [P, B, T, D] split partials (project_partials), for the add + norm that
        reads them: fp32, added to the fp32 residual stream without a rounding of its own."""
        w = self.o_proj[...]  # [D, Hq, hd]
        return project_partials(attn_bthk.reshape(attn_bthk.shape[:2] + (-1,)),
                                w.reshape(w.shape[0], -1), self.linear_impl)


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Param(_normal(rngs, (F, D), dtype))
        self.up_proj = nnx.Param(_normal(rngs, (F, D), dtype))
        self.down_proj = nnx.Param(_normal(rngs, (D, F), dtype))
        self.linear_impl = "xla"

    @property
    def fused(self) -> bool:
        return hasattr(self, "gate_up_proj")

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj [2F, D]: one GEMM instead of two
        (3.69 TB/s as two on the H200), the same math. Idempotent."""
        if not self.fused:
            self.gate_up_proj = nnx.Param(jnp.concatenate([self.gate_proj[...], self.up_proj[...]]))
            del self.gate_proj, self.up_proj

    def unfuse(self) -> None:
        """Back to gate_proj and up_proj; the exact inverse of fuse."""
        if self.fused:
            gate, up = jnp.split(self.gate_up_proj[...], 2)
            self.gate_proj, self.up_proj = nnx.Param(gate), nnx.Param(up)
            del self.gate_up_proj

    def partials(self, x_btd: Array) -> Array:
        """The MLP's output as down_proj's fp32 [P, B, T, D] split partials (project_partials)."""
        impl = self.linear_impl
        if self.fused:
            gate_btf, up_btf = jnp.split(project(x_btd, self.gate_up_proj[...], impl), 2, axis=-1)
        else:
            gate_btf, up_btf = (project(x_btd, w[...], impl) for w in (self.gate_proj, self.up_proj))
        act = (jax.nn.silu(gate_btf) * up_btf).astype(x_btd.dtype)
        return project_partials(act, self.down_proj[...], impl)


def fuse_projections(model, *, qkv: bool = True, linear_impl: str = "xla",
                     norm_impl: str | None = None) -> None:
    """Serving layout, in place, for a target or a drafter: gate+up (and q+k+v when `qkv`) of
    every decoder layer become one weight each, one layer at a time (peak memory grows by one
    layer's projections), and its matmuls run on `linear_impl` ("xla" | "triton", see
    kernels/linear.py), its RMSNorms on `norm_impl` (kernels/reductions.py; None: the matmuls'
    route, which batch invariance needs). Checkpoint keys map to the unfused layout; training
    and conversion use it. The drafter keeps q/k/v apart: its context path reads k_proj and
    v_proj alone."""
    for layer in model.layers:
        layer.mlp.fuse()
        if qkv:
            layer.self_attn.fuse()
    _set_linear_impl(model, linear_impl, norm_impl)


def unfuse_projections(model) -> None:
    """The checkpoint layout again, in place, for every decoder layer of a target or a drafter
    (an engine put them in the serving layout; checkpoint writers call this first). Engines
    built before keep their own parameters: they took them when they split the model."""
    for layer in model.layers:
        layer.mlp.unfuse()
        layer.self_attn.unfuse()
    if hasattr(model, "unfuse_context_kv"):  # a drafter's stacked context K/V weight
        model.unfuse_context_kv()
    _set_linear_impl(model, "xla")


def _set_linear_impl(model, impl: str, norm_impl: str | None = None) -> None:
    """The matmuls of every decoder layer (and the target's lm_head, a drafter's fc, context
    K/V and Markov W2) on `impl`, the layers' RMSNorms (and the target's final norm) on
    `norm_impl` (None: `impl`): batch invariance needs both on "triton" (kernels/reductions.py
    says why). A drafter's own hidden_norm and norm stay on XLA: its draws need no invariance."""
    norm_impl = impl if norm_impl is None else norm_impl
    for layer in model.layers:
        attn = layer.self_attn
        layer.mlp.linear_impl = attn.linear_impl = impl
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm,
                     attn.k_norm):
            norm.impl = norm_impl
    model.linear_impl = impl
    if isinstance(model, Qwen3):
        model.norm.impl = norm_impl


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, layer_idx: int, x_btd: Array, positions_bt: Array, attention: AttentionFn,
                 cache: Any) -> tuple[Array, Any]:
        """x_btd: the residual stream, kept in fp32 whatever the model dtype. Rounding it to bf16
        after every add (as transformers does) makes a q_len-8 verify and a q_len-1 decode drift
        apart by ~1e-2 nats through a deep model (their GEMMs round differently); in fp32 only
        the matmul inputs are rounded, and the two paths agree."""
        _, x_btd, mlp_partials, cache = self.step(layer_idx, x_btd, None, positions_bt,
                                                  attention, cache)
        return x_btd + sum_in_order(mlp_partials), cache

    def step(self, layer_idx: int, x_btd: Array, pending: Array | None, positions_bt: Array,
             attention: AttentionFn, cache: Any) -> tuple[Array, Array, Array, Any]:
        """The layer with its residual adds folded into the norms that follow them (the model's
        loop, Qwen3.__call__): the stream arrives as x_btd + sum_in_order(pending), the previous
        layer's MLP partials still unadded (None: nothing pending), and leaves the same way.
        Returns (the stream as it arrived, fp32; the stream after attention; this MLP's
        partials; cache). The same adds in the same order as __call__, so the same bits; on
        the "triton" route each add runs inside the next norm's kernel (RMSNorm.add_norm)."""
        x_in, h = self.input_layernorm.add_norm(x_btd, pending)
        q, k, v = self.self_attn.qkv(h, positions_bt)
        attn_bthk, cache = attention(layer_idx, q, k, v, cache)
        x_mid, h = self.post_attention_layernorm.add_norm(
            x_in, self.self_attn.out_partials(attn_bthk.astype(q.dtype)))
        return x_in, x_mid, self.mlp.partials(h), cache


class Qwen3(nnx.Module):
    """The Qwen3 causal LM. `__call__` returns final-normed hidden states, the requested taps and
    the updated caches; `logits` projects hidden states on the vocabulary (done separately so a
    prefill can project only the positions it samples from)."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.linear_impl = "xla"

    def embed(self, tokens_bt: Array) -> Array:
        return jnp.take(self.embed_tokens[...], tokens_bt, axis=0)

    def head_weight(self) -> Array:
        """[V, D]: lm_head, or the embedding when tied (shared, never copied)."""
        return self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits(self, hidden_btd: Array) -> Array:
        return project(hidden_btd, self.head_weight(), self.linear_impl)

    def __call__(self, tokens_bt: Array, positions_bt: Array, *, attention: AttentionFn,
                 caches: Sequence[Any] | None = None, tap_layers: Sequence[int] = ()
                 ) -> tuple[Array, list[Array], list[Any]]:
        """Returns (final-normed hidden [B,T,D], taps: raw outputs of `tap_layers` in the given
        order (layer i's output == transformers' hidden_states[i+1]), new caches)."""
        for i in tap_layers:
            if not 0 <= i < self.cfg.num_layers:
                raise ValueError(f"tap layer {i} is outside the target's {self.cfg.num_layers} layers")
        x_btd, pending = self.embed(tokens_bt), None
        outputs: dict[int, Array] = {}
        new_caches = []
        for i, layer in enumerate(self.layers):
            # Layer i - 1's output is completed (its MLP added) inside layer i's first norm.
            x_in, x_btd, pending, cache = layer.step(i, x_btd, pending, positions_bt, attention,
                                                     caches[i] if caches else None)
            new_caches.append(cache)
            if i:
                outputs[i - 1] = x_in
        outputs[len(self.layers) - 1], hidden = self.norm.add_norm(x_btd, pending)
        dtype = self.embed_tokens[...].dtype
        taps = [outputs[i].astype(dtype) for i in tap_layers]  # as transformers' hidden_states
        return hidden, taps, new_caches


# ---- Dense causal attention (no cache): the simple path and the test oracle's twin ---------

def dense_attention(q_bthk: Array, k_bshk: Array, v_bshk: Array, mask_bts: Array) -> Array:
    """GQA attention over dense keys; mask_bts True where query t may see key s. fp32 softmax."""
    B, T, Hq, hd = q_bthk.shape
    Hkv = k_bshk.shape[2]
    q_btkgh = q_bthk.reshape(B, T, Hkv, Hq // Hkv, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bshk,
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask_bts[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_bshk.dtype), v_bshk,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, hd).astype(q_bthk.dtype)


def causal_attention(valid_bt: Array | None = None) -> AttentionFn:
    """Causal attention within the given tokens; `valid_bt` masks right padding keys."""

    def attend(layer_idx, q, k, v, cache):
        T = q.shape[1]
        mask = jnp.tril(jnp.ones((T, T), bool))[None]
        if valid_bt is not None:
            mask = mask & valid_bt[:, None, :]
        return dense_attention(q, k, v, mask), cache

    return attend


def forward_logits(model: Qwen3, tokens_bt: Array, tap_layers: Sequence[int] = ()):
    """Full causal forward without a cache: logits [B,T,V] (fp32) and taps."""
    T = tokens_bt.shape[1]
    positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_bt.shape)
    hidden, taps, _ = model(tokens_bt, positions_bt, attention=causal_attention(),
                            tap_layers=tap_layers)
    return model.logits(hidden), taps


def init_random(cfg: Qwen3Config, seed: int = 0) -> Qwen3:
    return Qwen3(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: Qwen3Config) -> Qwen3:
    """The module tree with ShapeDtypeStructs instead of arrays: no memory is allocated."""
    return nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))


def checkpoint_shapes(cfg: Qwen3Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every Hugging Face checkpoint key -> (its shape in the checkpoint, the jspec param path).

    jspec's layouts are free reshapes of these shapes, so loading is rename + reshape."""
    D, V = cfg.hidden_size, cfg.vocab_size
    keys = {"model.embed_tokens.weight": ((V, D), ("embed_tokens",)),
            "model.norm.weight": ((D,), ("norm", "weight"))}
    if not cfg.tie_word_embeddings:
        keys["lm_head.weight"] = ((V, D), ("lm_head",))
    for i in range(cfg.num_layers):
        keys.update(layer_checkpoint_shapes(cfg, f"model.layers.{i}.", ("layers", i)))
    return keys


def layer_checkpoint_shapes(cfg: Qwen3Config, prefix: str, layer: tuple) -> dict:
    """One decoder layer's checkpoint keys (under `prefix`) -> (shape, param path under `layer`).
    Shared by the target and the drafter, whose layers are the same module."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {
        "input_layernorm.weight": ((D,), ("input_layernorm", "weight")),
        "post_attention_layernorm.weight": ((D,), ("post_attention_layernorm", "weight")),
        "self_attn.q_proj.weight": ((Hq * hd, D), ("self_attn", "q_proj")),
        "self_attn.k_proj.weight": ((Hkv * hd, D), ("self_attn", "k_proj")),
        "self_attn.v_proj.weight": ((Hkv * hd, D), ("self_attn", "v_proj")),
        "self_attn.o_proj.weight": ((D, Hq * hd), ("self_attn", "o_proj")),
        "self_attn.q_norm.weight": ((hd,), ("self_attn", "q_norm", "weight")),
        "self_attn.k_norm.weight": ((hd,), ("self_attn", "k_norm", "weight")),
        "mlp.gate_proj.weight": ((F, D), ("mlp", "gate_proj")),
        "mlp.up_proj.weight": ((F, D), ("mlp", "up_proj")),
        "mlp.down_proj.weight": ((D, F), ("mlp", "down_proj")),
    }
    return {prefix + key: (shape, layer + path) for key, (shape, path) in shapes.items()}
