"""The DSpark drafter (and DFlash, the same code without the Markov and confidence heads).

Shapes follow DeepSpec's `Qwen3DSparkModel` checkpoints (keys without a "model." prefix):
  fc [D, n_taps*D], hidden_norm [D]         feature fusion of the target's tapped layers
  layers.{i}.*                              Qwen3 decoder layers at the target's width
  norm [D]                                  final norm of the draft stack
  markov_head.markov_w1 [V, r]              token -> rank-r Markov embedding
  markov_head.markov_w2 [V, r]              rank-r -> vocabulary bias
  confidence_head.proj [1, D (+ r)], bias [1]
The drafter holds no embedding or lm_head: it is always called with the target's arrays.

One draft for a lane whose committed context ends at position s-1 and whose anchor (the last
committed token, not yet seen by the target) sits at s:
  context K/V  every committed position p < s holds K/V computed from the fused target features
               of token p (k_proj/k_norm/RoPE, v_proj of each layer; no queries, no MLP);
  block        [anchor, mask x (block-1)] at positions s..s+block-1, through the layers with
               bidirectional attention over the context and the whole block;
  base logits  U = lm_head(norm(h)), block x V;
  Markov       logits_k = U_k + W2 . W1[x_{k-1}], x_0 = anchor, sampled left to right.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ConfigError, Qwen3Config
from jspec.qwen3 import (AttentionFn, DecoderLayer, RMSNorm, _normal, apply_rope,
                         layer_checkpoint_shapes, project)

Array = jax.Array
MARKOV_HEAD_TYPES = ("vanilla", "gated")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    layers: Qwen3Config  # width / heads / rope of the draft layers (the target's); num_layers = draft depth
    block_size: int = 7
    mask_token_id: int = 151669
    target_layer_ids: tuple[int, ...] = (1, 9, 17, 25, 33)
    markov_rank: int = 256  # 0: no Markov head (DFlash)
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True

    def __post_init__(self):
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty: the drafter needs tapped target layers")
        ids = list(self.target_layer_ids)
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0:
            raise ConfigError(f"target_layer_ids must be strictly increasing and >= 0, got {ids}")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type {self.markov_head_type!r} is not supported "
                              f"(supported: {', '.join(MARKOV_HEAD_TYPES)})")
        if self.confidence_with_markov and self.confidence_head and not self.markov_rank:
            object.__setattr__(self, "confidence_with_markov", False)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def is_dflash(self) -> bool:
        return self.markov_rank == 0

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str | None = None) -> "DSparkConfig":
        for key in ("target_layer_ids", "block_size", "mask_token_id"):
            if key not in hf:
                raise ConfigError(f"drafter config.json lacks {key!r}: not a DSpark/DFlash drafter")
        base = {k: v for k, v in hf.items() if k not in ("model_type", "layer_types")}
        base["model_type"] = "qwen3"
        layers = Qwen3Config.from_hf_dict(base, dtype=dtype)
        rank = int(hf.get("markov_rank", 0) or 0)
        return cls(
            layers=layers,
            block_size=int(hf["block_size"]),
            mask_token_id=int(hf["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in hf["target_layer_ids"]),
            markov_rank=rank,
            markov_head_type=hf.get("markov_head_type", "vanilla") if rank else "vanilla",
            confidence_head=bool(hf.get("enable_confidence_head", False)),
            confidence_with_markov=bool(hf.get("confidence_head_with_markov", True)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> "DSparkConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no config.json: not a drafter directory")
        return cls.from_hf_dict(json.loads(path.read_text()), dtype=dtype)

    def to_hf_dict(self) -> dict[str, Any]:
        d = self.layers.to_hf_dict()
        d.update(architectures=["Qwen3DSparkModel"], block_size=self.block_size,
                 mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids),
                 markov_rank=self.markov_rank, markov_head_type=self.markov_head_type,
                 enable_confidence_head=self.confidence_head,
                 confidence_head_with_markov=self.confidence_with_markov,
                 tie_word_embeddings=False)
        return d

    def check_fits(self, target: Qwen3Config) -> None:
        """Refuse a drafter that does not fit its target, naming the mismatch."""
        mine = self.layers
        for field in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(mine, field) != getattr(target, field):
                raise ConfigError(f"drafter {field} = {getattr(mine, field)} does not match the "
                                  f"target's {getattr(target, field)}")
        bad = [i for i in self.target_layer_ids if i >= target.num_layers - 1]
        if bad:
            raise ConfigError(f"drafter target_layer_ids {list(self.target_layer_ids)} reach layer "
                              f"{bad[0]}, but the target has {target.num_layers} layers (the last "
                              "one cannot be tapped)")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"drafter mask_token_id {self.mask_token_id} is outside the target's "
                              f"vocabulary of {target.vocab_size}")


class DSparkDrafter(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # the matmul route of fc, the context K/V and the Markov W2 (the layers have their own;
        # qwen3.fuse_projections sets all of them): kernels/linear.py
        self.linear_impl = "xla"
        lc = cfg.layers
        dtype = jnp.dtype(lc.dtype)
        D, V, r = lc.hidden_size, lc.vocab_size, cfg.markov_rank
        self.fc = nnx.Param(_normal(rngs, (D, cfg.num_taps * D), dtype))
        self.hidden_norm = RMSNorm(D, lc.rms_norm_eps, dtype)
        self.layers = nnx.List([DecoderLayer(lc, dtype, rngs) for _ in range(lc.num_layers)])
        self.norm = RMSNorm(D, lc.rms_norm_eps, dtype)
        if r:
            self.markov_w1 = nnx.Param(_normal(rngs, (V, r), dtype))
            self.markov_w2 = nnx.Param(_normal(rngs, (V, r), dtype))
            if cfg.markov_head_type == "gated":
                self.markov_gate = nnx.Param(_normal(rngs, (r, D + r), dtype))
                self.markov_gate_bias = nnx.Param(jnp.zeros((r,), dtype))
        if cfg.confidence_head:
            width = D + (r if cfg.confidence_with_markov else 0)
            self.confidence_proj = nnx.Param(_normal(rngs, (1, width), dtype))
            self.confidence_bias = nnx.Param(jnp.zeros((1,), dtype))

    # ---- context ------------------------------------------------------------------------------

    def fuse(self, taps: Sequence[Array]) -> Array:
        """Target taps (each [..., D], in target_layer_ids order) -> fused context [..., D]."""
        features = jnp.concatenate(taps, axis=-1)
        # project: fp32 out, rounded once; an int8 fc (draft_weight_dtype) is scaled after the GEMM
        return self.hidden_norm(project(features, self.fc[...], self.linear_impl).astype(features.dtype))

    def fuse_context_kv(self) -> None:
        """Serving layout (the engine's): every layer's k_proj and v_proj stacked once into
        context_kv_proj [L x 2 x Hkv, hd, D], so that the context path is one GEMM. Left to
        itself XLA merged those GEMMs by concatenating the weights inside every iteration (a
        67 MB copy, 44 us on the H100, docs/benchmarks.md). The layers keep their own k_proj
        and v_proj for the block. Idempotent; `unfuse_context_kv` (qwen3.unfuse_projections)
        drops it."""
        if not hasattr(self, "context_kv_proj"):
            self.context_kv_proj = nnx.Param(jnp.concatenate(
                [w[...] for layer in self.layers
                 for w in (layer.self_attn.k_proj, layer.self_attn.v_proj)], axis=0))

    def unfuse_context_kv(self) -> None:
        if hasattr(self, "context_kv_proj"):
            del self.context_kv_proj

    def context_kv(self, context_btd: Array, positions_bt: Array) -> list[tuple[Array, Array]]:
        """Per draft layer, the K/V [B,T,Hkv,hd] of fused context rows at their positions."""
        if hasattr(self, "context_kv_proj"):  # one GEMM: [..., L x 2 x Hkv, hd] fp32
            parts = jnp.split(project(context_btd, self.context_kv_proj[...], self.linear_impl),
                              2 * len(self.layers), axis=-2)
            raw = [(parts[2 * i], parts[2 * i + 1]) for i in range(len(self.layers))]
        else:
            raw = [(project(context_btd, layer.self_attn.k_proj[...], self.linear_impl),
                    project(context_btd, layer.self_attn.v_proj[...], self.linear_impl))
                   for layer in self.layers]
        out = []
        for layer, (k, v) in zip(self.layers, raw):
            attn = layer.self_attn
            # As Attention.qkv: k stays fp32 through its norm and rope, rounded once.
            k = attn.k_norm(k, jnp.float32)
            v = v.astype(context_btd.dtype)
            out.append((apply_rope(k, positions_bt, attn.rope_theta).astype(v.dtype), v))
        return out

    # ---- block --------------------------------------------------------------------------------

    def block_hidden(self, block_emb_btd: Array, positions_bt: Array, attention: AttentionFn,
                     caches: Sequence[Any]) -> tuple[Array, list[Any]]:
        """The block through the draft layers; `attention` sees the block's q/k/v and must let
        every block query attend to the whole context and the whole block (no causal mask).
        Returns (final-normed hidden [B,T,D], caches)."""
        h = block_emb_btd
        new_caches = []
        for i, layer in enumerate(self.layers):
            h, cache = layer(i, h, positions_bt, attention, caches[i] if caches else None)
            new_caches.append(cache)
        return self.norm(h), new_caches

    # ---- heads --------------------------------------------------------------------------------

    def markov_bias(self, prev_tokens: Array, hidden: Array | None = None,
                    w2_rows: Array | None = None) -> Array:
        """B(prev, .) [..., V] in fp32; zeros for DFlash. `w2_rows` [N, r]: the bias of those
        W2 rows only [..., N] (a draft vocabulary, jspec/draft_vocab.py)."""
        if self.cfg.is_dflash:
            n = self.cfg.layers.vocab_size if w2_rows is None else w2_rows.shape[0]
            return jnp.zeros(prev_tokens.shape + (n,), jnp.float32)
        e = jnp.take(self.markov_w1[...], prev_tokens, axis=0)
        if self.cfg.markov_head_type == "gated":
            gate_in = jnp.concatenate([hidden, e], axis=-1)
            gate = jax.nn.sigmoid(jnp.einsum("...i,ri->...r", gate_in, self.markov_gate[...],
                                             preferred_element_type=jnp.float32)
                                  + self.markov_gate_bias[...].astype(jnp.float32))
            e = (gate * e.astype(jnp.float32)).astype(e.dtype)
        return project(e, self.markov_w2[...] if w2_rows is None else w2_rows, self.linear_impl)  # fp32

    def confidence_logits(self, hidden: Array, prev_tokens: Array) -> Array:
        """z_k = w . [h_k ; W1[x_{k-1}]] + b (a logit; sigmoid gives the acceptance estimate)."""
        if not self.cfg.confidence_head:
            return jnp.zeros(prev_tokens.shape, jnp.float32)
        x = hidden
        if self.cfg.confidence_with_markov:
            x = jnp.concatenate([hidden, jnp.take(self.markov_w1[...], prev_tokens, axis=0)], -1)
        z = jnp.einsum("...i,oi->...o", x, self.confidence_proj[...],
                       preferred_element_type=jnp.float32)[..., 0]
        return z + self.confidence_bias[...].astype(jnp.float32)[0]


def abstract_drafter(cfg: DSparkConfig) -> DSparkDrafter:
    return nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0)))


def init_random_drafter(cfg: DSparkConfig, seed: int = 0) -> DSparkDrafter:
    return DSparkDrafter(cfg, rngs=nnx.Rngs(seed))


def dspark_8b_like_config(target: Qwen3Config, num_layers: int = 5,
                          taps: tuple[int, ...] = (1, 9, 17, 25, 33)) -> DSparkConfig:
    """DSpark-8B's drafter shape for any target, as the cost scripts time it with random weights:
    block 7, Markov rank 256 (16 below width 256), the mask id 151669 where the vocabulary holds
    it (else its last id), and the taps that exist in the target (small presets on a CPU)."""
    return DSparkConfig(
        layers=target.replace(num_layers=num_layers), block_size=7,
        mask_token_id=151669 if target.vocab_size > 151669 else target.vocab_size - 1,
        target_layer_ids=tuple(t for t in taps if t < target.num_layers),
        markov_rank=256 if target.hidden_size >= 256 else 16)


def drafter_checkpoint_shapes(cfg: DSparkConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """DeepSpec checkpoint key -> (shape, jspec param path). embed_tokens / lm_head copies are
    not listed: they are checked against the target's instead of loaded."""
    lc = cfg.layers
    D, V, r = lc.hidden_size, lc.vocab_size, cfg.markov_rank
    keys = {"fc.weight": ((D, cfg.num_taps * D), ("fc",)),
            "hidden_norm.weight": ((D,), ("hidden_norm", "weight")),
            "norm.weight": ((D,), ("norm", "weight"))}
    for i in range(lc.num_layers):
        keys.update(layer_checkpoint_shapes(lc, f"layers.{i}.", ("layers", i)))
    if r:
        keys["markov_head.markov_w1.weight"] = ((V, r), ("markov_w1",))
        keys["markov_head.markov_w2.weight"] = ((V, r), ("markov_w2",))
        if cfg.markov_head_type == "gated":
            keys["markov_head.gate_proj.weight"] = ((r, D + r), ("markov_gate",))
            keys["markov_head.gate_proj.bias"] = ((r,), ("markov_gate_bias",))
    if cfg.confidence_head:
        width = D + (r if cfg.confidence_with_markov else 0)
        keys["confidence_head.proj.weight"] = ((1, width), ("confidence_proj",))
        keys["confidence_head.proj.bias"] = ((1,), ("confidence_bias",))
    return keys


SHARED_WITH_TARGET = {"embed_tokens.weight": "embed", "lm_head.weight": "head"}


def dense_draft(target, drafter: DSparkDrafter, context_bs, anchor_b, prev_bk):
    """Reference twin of the paged draft, for tests and training checks: B blocks whose
    contexts all have length s, with dense attention over [context K/V ; block K/V] and no mask.
    context_bs [B, s] tokens, anchor_b [B], prev_bk [B, block] (the previous token of each
    block position). Returns (U + Markov bias [B, block, V] f32, final-normed hidden
    [B, block, D], confidence logits [B, block])."""
    from jspec.qwen3 import dense_attention, forward_logits
    cfg = drafter.cfg
    context_bs, anchor_b, prev_bk = map(jnp.asarray, (context_bs, anchor_b, prev_bk))
    B, s = context_bs.shape
    _, taps = forward_logits(target, context_bs, tap_layers=cfg.target_layer_ids)
    ctx_kv = drafter.context_kv(drafter.fuse(taps), jnp.broadcast_to(jnp.arange(s), (B, s)))
    block = jnp.concatenate(
        [anchor_b[:, None], jnp.full((B, cfg.block_size - 1), cfg.mask_token_id)], 1)

    def attend(i, q, k, v, cache):
        k_all = jnp.concatenate([ctx_kv[i][0], k], 1)
        v_all = jnp.concatenate([ctx_kv[i][1], v], 1)
        return dense_attention(q, k_all, v_all, jnp.ones((B, q.shape[1], k_all.shape[1]), bool)), cache

    positions = jnp.broadcast_to(s + jnp.arange(cfg.block_size), (B, cfg.block_size))
    hidden, _ = drafter.block_hidden(target.embed(block), positions, attend, None)
    logits = target.logits(hidden) + drafter.markov_bias(prev_bk, hidden)
    return logits, hidden, drafter.confidence_logits(hidden, prev_bk)
