"""Drafter training against a frozen target: DeepSpec's objective (reference/dspark.md 6.2-6.3).

Per training sequence (prompt ++ the target's own reply, loss_mask on the reply):
  target    one frozen causal forward: taps at target_layer_ids -> fused context features,
            and the final-normed hidden, whose logits (lm_head) give p_t;
  anchors   A positions p with loss_mask[p] and loss_mask[p+1], uniform without replacement,
            sorted; missing ones are dummy blocks of weight 0;
  blocks    [x_p, mask x (block-1)] at positions p..p+block-1; every block query attends to the
            context keys t < p and to its own block, and nothing else: exactly the inference
            draft (context strictly before the anchor, bidirectional block);
  logits    row k = 1..block: U_k + B(prev_k), prev = [x_p, y_1..y_{block-1}] (teacher forced),
            y_k = x_{p+k}; the target's row is its logits at position p+k-1;
  weights   w_k = exp(-(k-1)/gamma) x eval_mask (p+k inside the reply, cumulative product);
  loss      ce * CE + l1 * L1 + conf * BCE, each sum(w * term) / sum(w) over the batch, where
            L1 = sum_v |p_d - p_t| (T = 1) and BCE-with-logits of z_k against the detached
            c*_k = clamp(1 - L1_k / 2, 0, 1).
Packed rows (several prompt + reply sequences each, jspec.train.data.pack_reply_arrays) carry
segment ids and each sequence's own positions: the target attends within a sequence, and an
anchor's context keys and labels stay in its own, so each trains exactly as it would alone.
The DFlash ablation is the same code: markov_rank 0, no confidence head, CE only.
The drafter's embedding and lm_head are the target's (frozen, never copied).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jspec.config import Qwen3Config
from jspec.dspark import DSparkConfig, DSparkDrafter
from jspec.qwen3 import Qwen3, causal_attention
from jspec.train import (ModuleBinder, OptimConfig, TrainState, cast_floats, commit, global_norm,
                         make_optimizer, run_layers, sum_over_row_chunks)
from jspec.train.target import target_forward

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DrafterLossConfig:
    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0    # ignored when the drafter has no confidence head
    gamma: float = 4.0   # position decay exp(-(k-1)/gamma); DeepSpec's code uses 4, not the block


DSPARK_LOSS = DrafterLossConfig()
DFLASH_LOSS = DrafterLossConfig(ce=1.0, l1=0.0, conf=0.0)
# The ablation between the two: DSpark's drafter (Markov and confidence heads) on DFlash's CE
# alone (plus the confidence BCE, which trains only its own head): isolates the L1 term's effect.
DSPARK_CE_LOSS = DrafterLossConfig(ce=1.0, l1=0.0, conf=1.0)


BLOCK_ATTN_IMPLS = ("split", "cudnn", "xla", "cudnn_chunks", "xla_chunks")  # block_attention's
CHUNK_ANCHORS = 128  # "*_chunks": anchors whose blocks share one attention call's block keys


def anchors_per_attention(impl: str, anchors: int) -> int:
    """How many anchors' blocks one block attention call holds on route `impl`: a row's chunk of
    up to CHUNK_ANCHORS (a divisor of `anchors`) on "*_chunks", else the whole row's."""
    return math.gcd(anchors, CHUNK_ANCHORS) if impl.endswith("_chunks") else anchors


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    num_anchors: int = 512
    loss: DrafterLossConfig = DSPARK_LOSS
    compute_dtype: str = "float32"
    target_attn_impl: str = "dense"   # the frozen target's forward ("cudnn" on GPU)
    remat: bool = False               # recompute each draft layer in the backward pass
    row_chunk: int = 1024             # block rows per vocabulary-sized chunk
    # Recompute each chunk's vocabulary-sized terms in the backward pass (memory-lean); False
    # keeps them (a chunk of R rows holds a few [R, V] fp32 tensors until the backward).
    loss_remat: bool = True
    # The drafter's block attention in training (block_attention): "split" scores each block
    # against the context and its own block as two einsums (the [.., A, block, S] scores live in
    # HBM); "cudnn" runs one fused attention over [context; every block] under a mask (GPU; more
    # FLOPs, no materialised scores); "xla" is that same masked formulation on XLA (its twin).
    # "cudnn_chunks" / "xla_chunks": the same, with the blocks cut into chunks of CHUNK_ANCHORS
    # anchors that each see the context and only their own chunk's block keys (fewer masked
    # scores: see block_attention).
    block_attn_impl: str = "split"

    def __post_init__(self):
        if self.block_attn_impl not in BLOCK_ATTN_IMPLS:
            raise ValueError(f"block_attn_impl {self.block_attn_impl!r}: expected one of "
                             f"{BLOCK_ATTN_IMPLS}")


def default_tap_layers(num_target_layers: int, n: int = 5) -> tuple[int, ...]:
    """n layers evenly spaced in [1, L-3] (DFlash's rule; [1, 9, 17, 25, 33] for L = 36)."""
    hi = max(1, num_target_layers - 3)
    return tuple(sorted({int(round(x)) for x in np.linspace(1, hi, n)}))


def drafter_config(target: Qwen3Config, *, draft_layers: int, mask_token_id: int,
                   block_size: int = 7, tap_layers: Sequence[int] | None = None,
                   markov_rank: int = 256, dflash: bool = False) -> DSparkConfig:
    """A DSpark drafter (or, with dflash, its ablation) at the target's width, in fp32."""
    return DSparkConfig(
        layers=target.replace(num_layers=draft_layers, dtype="float32"), block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(tap_layers or default_tap_layers(target.num_layers)),
        markov_rank=0 if dflash else markov_rank, confidence_head=not dflash)


# ---- anchors and block layout ---------------------------------------------------------------------

def sample_anchors(key: Array, loss_mask_bs: Array, num_anchors: int,
                   segment_ids_bs: Array | None = None) -> tuple[Array, Array]:
    """anchors [B, A] (sorted positions; dummies 0 at the end) and keep [B, A]."""
    B, S = loss_mask_bs.shape
    if num_anchors > S - 1:
        raise ValueError(f"num_anchors {num_anchors} exceeds the {S - 1} candidate positions")
    cand_bp = loss_mask_bs[:, :-1] & loss_mask_bs[:, 1:]  # anchor and its first label in the reply
    if segment_ids_bs is not None:  # ... of the same packed sequence
        cand_bp &= segment_ids_bs[:, :-1] == segment_ids_bs[:, 1:]
    score_bp = jnp.where(cand_bp, jax.random.uniform(key, cand_bp.shape), -1.0)
    top_score, top_pos = jax.lax.top_k(score_bp, num_anchors)  # uniform without replacement
    keep = top_score >= 0
    order = jnp.argsort(jnp.where(keep, top_pos, S + top_pos), axis=-1)
    anchors = jnp.take_along_axis(top_pos, order, -1)
    keep = jnp.take_along_axis(keep, order, -1)
    return jnp.where(keep, anchors, 0).astype(jnp.int32), keep


def block_layout(tokens_bs: Array, loss_mask_bs: Array, anchors_ba: Array, keep_ba: Array,
                 dcfg: DSparkConfig, gamma: float, segment_ids_bs: Array | None = None,
                 positions_bs: Array | None = None) -> dict[str, Array]:
    """Per block row [B, A, block]: input token and (RoPE) position, teacher-forced prev token,
    label, the target row that predicts the label, eval mask and loss weight; and per block
    [B, A, S] which context keys its queries see (t < p, in the anchor's packed sequence)."""
    S = tokens_bs.shape[1]
    k = jnp.arange(dcfg.block_size)
    pos_bak = anchors_ba[..., None] + k                   # row indices p..p+block-1
    take = lambda x, idx: jnp.take_along_axis(x, jnp.minimum(idx, S - 1).reshape(x.shape[0], -1),
                                              axis=1).reshape(idx.shape)
    anchor_tok = take(tokens_bs, pos_bak[..., :1])
    block_tokens = jnp.where((k == 0) & keep_ba[..., None], anchor_tok, dcfg.mask_token_id)
    label_ok = (pos_bak + 1 < S) & take(loss_mask_bs, pos_bak + 1)
    sees_ctx_bas = jnp.arange(S) < anchors_ba[..., None]
    rope_bak = pos_bak
    if segment_ids_bs is not None:
        anchor_seg_ba = take(segment_ids_bs, anchors_ba)
        label_ok &= take(segment_ids_bs, pos_bak + 1) == anchor_seg_ba[..., None]
        sees_ctx_bas &= segment_ids_bs[:, None, :] == anchor_seg_ba[..., None]
    if positions_bs is not None:
        rope_bak = take(positions_bs, anchors_ba)[..., None] + k
    eval_mask = (jnp.cumprod(label_ok, axis=-1) > 0) & keep_ba[..., None]
    weights = jnp.exp(-k / gamma).astype(jnp.float32) * eval_mask
    return {"block_tokens": block_tokens.astype(jnp.int32), "positions": rope_bak.astype(jnp.int32),
            "prev": take(tokens_bs, pos_bak), "labels": take(tokens_bs, pos_bak + 1),
            "target_index": jnp.minimum(pos_bak, S - 1), "eval_mask": eval_mask, "weights": weights,
            "sees_ctx": sees_ctx_bas}


def block_attention(ctx_kv: list[tuple[Array, Array]], sees_ctx_bas: Array, block: int,
                    impl: str = "split"):
    """Attention of the flattened blocks [B, A*block]: a query of a block sees the context keys
    its block may (sees_ctx [B, A, S]) and its own block's keys, nothing else.

    "split": the two parts, context [.., S] and own block [.., block], under one softmax, so the
    keys of the other blocks (which every query would mask) cost nothing, but the context scores
    are materialised. "cudnn" / "xla": one attention over the keys [context; all blocks] with a
    mask [B, 1, A*block, S + A*block] built once per forward (fused on cuDNN). Every query masks
    all the other blocks' keys, so at 1,024 anchors of 7 and S = 4,096 most of the scores it
    computes are masked ones. "*_chunks": the blocks go in chunks of CHUNK_ANCHORS anchors, a
    chunk per batch entry with keys [context; its own blocks]: S + 896 keys instead of S + 7,168,
    about 2.3x fewer scores at those sizes; the same attention, term for term."""
    if impl not in BLOCK_ATTN_IMPLS:
        raise ValueError(f"block attention impl {impl!r}: expected one of {BLOCK_ATTN_IMPLS}")
    if impl != "split":
        return _masked_block_attention(ctx_kv, sees_ctx_bas, block, impl.removesuffix("_chunks"),
                                       anchors_per_attention(impl, sees_ctx_bas.shape[1]))

    def attend(layer_idx, q, k, v, cache):
        B, Q, Hq, hd = q.shape
        A, Hkv = Q // block, k.shape[2]
        f32 = jnp.float32
        k_ctx, v_ctx = (x.astype(k.dtype) for x in ctx_kv[layer_idx])
        q_balkgh = q.reshape(B, A, block, Hkv, Hq // Hkv, hd)
        k_balkh, v_balkh = (x.reshape(B, A, block, Hkv, hd) for x in (k, v))
        s_ctx = jnp.einsum("balkgh,bskh->bkgals", q_balkgh, k_ctx, preferred_element_type=f32)
        s_ctx = jnp.where(sees_ctx_bas[:, None, None, :, None, :], s_ctx * hd ** -0.5, -jnp.inf)
        s_blk = jnp.einsum("balkgh,bamkh->bkgalm", q_balkgh, k_balkh,
                           preferred_element_type=f32) * hd ** -0.5
        top = jax.lax.stop_gradient(jnp.maximum(s_ctx.max(-1, keepdims=True),
                                                s_blk.max(-1, keepdims=True)))
        e_ctx, e_blk = jnp.exp(s_ctx - top), jnp.exp(s_blk - top)
        denom = e_ctx.sum(-1, keepdims=True) + e_blk.sum(-1, keepdims=True)
        p_ctx, p_blk = (e_ctx / denom).astype(v.dtype), (e_blk / denom).astype(v.dtype)
        out = (jnp.einsum("bkgals,bskh->balkgh", p_ctx, v_ctx, preferred_element_type=f32)
               + jnp.einsum("bkgalm,bamkh->balkgh", p_blk, v_balkh, preferred_element_type=f32))
        return out.reshape(B, Q, Hq, hd).astype(q.dtype), cache

    return attend


def _masked_block_attention(ctx_kv: list[tuple[Array, Array]], sees_ctx_bas: Array, block: int,
                            implementation: str, chunk_anchors: int):
    """One masked attention per chunk of `chunk_anchors` anchors (A of them: the whole row), the
    chunks of a row side by side in the batch: a chunk's queries see the context keys their
    block may and the keys of their own block, and its other blocks' keys are masked."""
    B, A, S = sees_ctx_bas.shape
    C, Qc = A // chunk_anchors, chunk_anchors * block
    block_of_q = jnp.arange(Qc) // block
    mask_nqk = jnp.concatenate(  # a query sees its block's context keys, then its own block
        [jnp.repeat(sees_ctx_bas, block, axis=1).reshape(B * C, Qc, S),
         jnp.broadcast_to(block_of_q[:, None] == block_of_q[None, :], (B * C, Qc, Qc))], axis=-1)

    def attend(layer_idx, q, k, v, cache):
        _, Q, Hq, hd = q.shape
        Hkv = k.shape[2]

        def keys(ctx, own):  # [B * C, S + Qc, Hkv, hd]: the context, then the chunk's blocks
            ctx = jnp.broadcast_to(ctx.astype(own.dtype)[:, None], (B, C, S, Hkv, hd))
            return jnp.concatenate([ctx.reshape(B * C, S, Hkv, hd),
                                    own.reshape(B * C, Qc, Hkv, hd)], 1)

        k_ctx, v_ctx = ctx_kv[layer_idx]
        out = jax.nn.dot_product_attention(q.reshape(B * C, Qc, Hq, hd), keys(k_ctx, k),
                                           keys(v_ctx, v), mask=mask_nqk[:, None],
                                           implementation=implementation)
        return out.reshape(B, Q, Hq, hd).astype(q.dtype), cache

    return attend


def block_attention_gap(impl: str = "cudnn", seq: int = 256, anchors: int = 16, block: int = 7,
                        dtype=jnp.bfloat16) -> float:
    """Largest difference between `impl`'s block attention and the split one on random inputs
    shaped like a packed training row (two sequences; anchors in both, one with no context; GQA
    group 2, head dim 128): the check train_standin runs before it trains on "cudnn". A chunked
    route gets enough anchors for two chunks."""
    if impl.endswith("_chunks"):
        anchors = max(anchors, 2 * CHUNK_ANCHORS)
    B, Hkv, group, hd, Q = 2, 2, 2, 128, anchors * block
    kq, kk, kv, kc, kw, ka = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(kq, (B, Q, Hkv * group, hd), dtype)
    k, v = (jax.random.normal(kx, (B, Q, Hkv, hd), dtype) for kx in (kk, kv))
    ctx_kv = [tuple(jax.random.normal(kx, (B, seq, Hkv, hd), dtype) for kx in (kc, kw))]
    anchors_ba = jnp.sort(jax.random.randint(ka, (B, anchors), 0, seq), axis=-1).at[:, 0].set(0)
    seg_bs = (jnp.arange(seq) >= seq // 3).astype(jnp.int32)[None].repeat(B, 0)
    seg_ba = jnp.take_along_axis(seg_bs, anchors_ba, 1)
    sees_bas = (jnp.arange(seq) < anchors_ba[..., None]) & (seg_bs[:, None, :] == seg_ba[..., None])
    run = lambda name: jax.jit(lambda q, k, v: block_attention(ctx_kv, sees_bas, block, name)(
        0, q, k, v, None)[0])(q, k, v).astype(jnp.float32)
    return float(jnp.abs(run(impl) - run("split")).max())


# ---- the training forward -------------------------------------------------------------------------

def draft_hidden(target: Qwen3, drafter: DSparkDrafter, tokens_bs: Array, anchors_ba: Array,
                 layout: dict[str, Array], *, target_attn_impl: str = "dense",
                 remat: bool = False, segment_ids_bs: Array | None = None,
                 positions_bs: Array | None = None, block_attn_impl: str = "split"
                 ) -> tuple[Array, Array]:
    """(draft final-normed hidden, target final-normed hidden at each row's target_index), both
    [B, A, block, D]. The target is frozen: no gradient reaches it. Packed rows pass their
    segment ids and positions (the target then attends within each sequence)."""
    B, S = tokens_bs.shape
    A, blk = anchors_ba.shape[1], drafter.cfg.block_size
    if positions_bs is None:
        positions_bs = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    hidden_bsd, taps = target_forward(target, tokens_bs, attn_impl=target_attn_impl,
                                      tap_layers=drafter.cfg.target_layer_ids,
                                      positions_bt=positions_bs, segment_ids_bt=segment_ids_bs)
    hidden_bsd, taps = jax.lax.stop_gradient((hidden_bsd, taps))
    ctx_kv = drafter.context_kv(drafter.fuse(taps), positions_bs)
    attention = block_attention(ctx_kv, layout["sees_ctx"], blk, block_attn_impl)
    block_emb = jax.lax.stop_gradient(target.embed(layout["block_tokens"].reshape(B, A * blk)))
    positions = layout["positions"].reshape(B, A * blk)
    if remat:
        h = drafter.norm(run_layers(drafter.layers, block_emb, positions, attention, remat=True))
    else:  # the inference function itself
        h, _ = drafter.block_hidden(block_emb, positions, attention, None)
    idx = layout["target_index"].reshape(B, A * blk)
    target_rows = jnp.take_along_axis(hidden_bsd, idx[..., None], axis=1)
    return h.reshape(B, A, blk, -1), target_rows.reshape(B, A, blk, -1)


def draft_logits(drafter: DSparkDrafter, head_vd: Array, hidden: Array, prev: Array) -> Array:
    """U + B(prev) in fp32, T = 1."""
    U = jnp.einsum("...d,vd->...v", hidden, head_vd, preferred_element_type=jnp.float32)
    return U + drafter.markov_bias(prev, hidden)


def training_block_logits(target: Qwen3, drafter: DSparkDrafter, tokens_bs: Array,
                          loss_mask_bs: Array, anchors_ba: Array, keep_ba: Array,
                          segment_ids_bs: Array | None = None, positions_bs: Array | None = None,
                          block_attn_impl: str = "split") -> tuple[Array, Array, dict]:
    """The training forward's teacher-forced draft logits [B, A, block, V] and confidence logits
    [B, A, block] for given anchors (whole-vocabulary tensors: for tests and small diagnostics)."""
    layout = block_layout(tokens_bs, loss_mask_bs, anchors_ba, keep_ba, drafter.cfg, 4.0,
                          segment_ids_bs, positions_bs)
    h, _ = draft_hidden(target, drafter, tokens_bs, anchors_ba, layout,
                        segment_ids_bs=segment_ids_bs, positions_bs=positions_bs,
                        block_attn_impl=block_attn_impl)
    return (draft_logits(drafter, target.head_weight(), h, layout["prev"]),
            drafter.confidence_logits(h, layout["prev"]), layout)


def drafter_loss(target: Qwen3, drafter: DSparkDrafter, tokens_bs: Array, loss_mask_bs: Array,
                 key: Array, cfg: DrafterTrainConfig, logit_bias_v: Array | None = None,
                 segment_ids_bs: Array | None = None, positions_bs: Array | None = None
                 ) -> tuple[Array, dict]:
    """`logit_bias_v` (a compact vocabulary's log multiplicities) is added to the target's and
    the drafter's logits alike: both laws are then the full-vocabulary ones. Packed rows
    (pack_reply_arrays) give `segment_ids_bs` and `positions_bs`: every sequence of a row then
    trains exactly as it would alone."""
    bias_v = 0.0 if logit_bias_v is None else logit_bias_v
    anchors_ba, keep_ba = sample_anchors(key, loss_mask_bs, cfg.num_anchors, segment_ids_bs)
    layout = block_layout(tokens_bs, loss_mask_bs, anchors_ba, keep_ba, drafter.cfg, cfg.loss.gamma,
                          segment_ids_bs, positions_bs)
    h_bakd, th_bakd = draft_hidden(target, drafter, tokens_bs, anchors_ba, layout,
                                   target_attn_impl=cfg.target_attn_impl, remat=cfg.remat,
                                   segment_ids_bs=segment_ids_bs, positions_bs=positions_bs,
                                   block_attn_impl=cfg.block_attn_impl)
    head_vd = jax.lax.stop_gradient(target.head_weight())
    D = h_bakd.shape[-1]

    def row_terms(r):
        logits_cv = draft_logits(drafter, head_vd, r["h"], r["prev"]) + bias_v
        logp_cv = jax.nn.log_softmax(logits_cv, axis=-1)
        nll_c = -jnp.take_along_axis(logp_cv, r["y"][:, None], axis=-1)[:, 0]
        p_t_cv = jax.nn.softmax(jnp.einsum("cd,vd->cv", r["th"], head_vd,
                                           preferred_element_type=jnp.float32) + bias_v, axis=-1)
        l1_c = jnp.sum(jnp.abs(jnp.exp(logp_cv) - p_t_cv), axis=-1)
        c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1_c, 0.0, 1.0))
        bce_c = optax.sigmoid_binary_cross_entropy(drafter.confidence_logits(r["h"], r["prev"]), c_star)
        w = r["w"]
        sums = {"ce": jnp.sum(w * nll_c), "l1": jnp.sum(w * l1_c), "conf": jnp.sum(w * bce_c),
                "w": jnp.sum(w)}
        return sums, {"c_star": c_star, "hit": jnp.argmax(logits_cv, -1) == r["y"]}

    rows = {"h": h_bakd.reshape(-1, D), "th": th_bakd.reshape(-1, D),
            "prev": layout["prev"].reshape(-1), "y": layout["labels"].reshape(-1),
            "w": layout["weights"].reshape(-1)}
    sums, per_row = sum_over_row_chunks(row_terms, rows, cfg.row_chunk, remat=cfg.loss_remat)
    denom = jnp.maximum(sums["w"], 1e-9)
    ce, l1, conf = sums["ce"] / denom, sums["l1"] / denom, sums["conf"] / denom
    conf_alpha = cfg.loss.conf if drafter.cfg.confidence_head else 0.0
    loss = cfg.loss.ce * ce + cfg.loss.l1 * l1 + conf_alpha * conf
    metrics = {"loss": loss, "ce": ce, "l1": l1, "conf": conf,
               "anchor_fill": jnp.mean(keep_ba.astype(jnp.float32)),  # real blocks / anchor slots
               **acceptance_metrics(per_row["c_star"].reshape(layout["eval_mask"].shape),
                                    per_row["hit"].reshape(layout["eval_mask"].shape),
                                    layout["eval_mask"], keep_ba)}
    return loss, metrics


def acceptance_metrics(c_star_bak: Array, hit_bak: Array, eval_mask_bak: Array, keep_ba: Array) -> dict:
    """accept_rate: mean c* over valid rows; tau_prob = 1 + sum_k prod_{i<=k} c*_i (expected τ
    under teacher forcing at T = 1); tau_greedy = 1 + the leading run of rows whose draft argmax
    is the label (the greedy accepted length when the replies are the target's greedy ones);
    c_star_k (k = 1..block): mean c* at block position k, so the first position, where a
    parallel drafter should be best, stays visible (an engine anchors after rejections, where
    c*_1 is lower than over uniform anchors: docs/benchmarks.md)."""
    m = eval_mask_bak.astype(jnp.float32)
    n_blocks = jnp.maximum(jnp.sum(keep_ba), 1)
    survive = jnp.cumprod(c_star_bak * m, axis=-1)
    run = jnp.cumprod(hit_bak * m, axis=-1)
    per_k = jnp.sum(c_star_bak * m, axis=(0, 1)) / jnp.maximum(jnp.sum(m, axis=(0, 1)), 1)
    return {"accept_rate": jnp.sum(c_star_bak * m) / jnp.maximum(jnp.sum(m), 1),
            "tau_prob": 1.0 + jnp.sum(survive) / n_blocks,
            "tau_greedy": 1.0 + jnp.sum(run) / n_blocks,
            **{f"c_star_{k + 1}": per_k[k] for k in range(c_star_bak.shape[-1])}}


# ---- the trainer ---------------------------------------------------------------------------------

def _loss(binders, cfg, params, target_params, batch, key, bias_v):
    target_binder, binder = binders
    target = target_binder.bind(target_params)
    drafter = binder.bind(cast_floats(params, cfg.compute_dtype))
    return drafter_loss(target, drafter, batch["tokens"], batch["loss_mask"], key, cfg, bias_v,
                        batch.get("segment_ids"), batch.get("positions"))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def _train_step(binders, optim_cfg, cfg, params, opt_state, target_params, batch, key, bias_v,
                lr_factor):
    grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(binders, cfg, params, target_params,
                                                             batch, key, bias_v)
    updates, opt_state = make_optimizer(optim_cfg).update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: u * lr_factor, updates)  # 1 unless time-boxed
    metrics["grad_norm"] = global_norm(grads)
    return jax.tree.map(jnp.add, params, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnums=(0, 1))
def _eval_step(binders, cfg, params, target_params, batch, key, bias_v):
    return _loss(binders, cfg, params, target_params, batch, key, bias_v)[1]


# the arrays of a batch the step reads (packed rows add the last two)
BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")


def _device_batch(arrays: dict, rows: slice | None = None) -> dict[str, Array]:
    return {k: jnp.asarray(arrays[k] if rows is None else arrays[k][rows])
            for k in BATCH_KEYS if k in arrays}


class DrafterTrainer:
    """Trains `drafter` (its arrays, in fp32, become the masters) against the frozen `target`.
    `train_step(batch)` with batch {"tokens": [B, S] int32, "loss_mask": [B, S] bool}, and for
    packed rows "segment_ids" and "positions" [B, S] int32 (pack_reply_arrays). Steps
    are jitted once per (shapes, configs) and shared by trainers of the same shapes."""

    def __init__(self, target: Qwen3, drafter: DSparkDrafter, optim: OptimConfig,
                 cfg: DrafterTrainConfig = DrafterTrainConfig(), seed: int = 0,
                 logit_bias: np.ndarray | None = None):
        drafter.cfg.check_fits(target.cfg)
        V = target.cfg.vocab_size
        self.logit_bias = commit(jnp.zeros((V,), jnp.float32) if logit_bias is None
                                 else jnp.asarray(logit_bias, jnp.float32).reshape(V))
        self.cfg, self.optim_cfg, self.draft_cfg = cfg, optim, drafter.cfg
        self.binders = (ModuleBinder(target), ModuleBinder(drafter))
        self.target_params = commit(cast_floats(ModuleBinder.params(target), cfg.compute_dtype))  # frozen
        params = commit(cast_floats(ModuleBinder.params(drafter), jnp.float32))
        self.state = TrainState(params=params, opt_state=commit(make_optimizer(optim).init(params)), step=0,
                                data_position=0, rng=commit(jax.random.PRNGKey(seed)))

    def train_step(self, batch: dict, lr_factor: float = 1.0) -> dict:
        """One step; `lr_factor` scales the update (a time-boxed schedule, OptimConfig)."""
        s = self.state
        key = jax.random.fold_in(s.rng, s.step)
        s.params, s.opt_state, metrics = _train_step(
            self.binders, self.optim_cfg, self.cfg, s.params, s.opt_state, self.target_params,
            _device_batch(batch), key, self.logit_bias, np.float32(lr_factor))
        s.step += 1
        s.data_position += 1
        return metrics

    def evaluate(self, arrays: dict[str, np.ndarray], batch_size: int, seed: int = 1234) -> dict:
        """Mean metrics over the full batches of held-out reply sequences, anchors drawn from
        fixed keys (the same anchors for every evaluation of the same data)."""
        n = (len(arrays["tokens"]) // batch_size) * batch_size
        if n == 0:
            raise ValueError(f"{len(arrays['tokens'])} sequences cannot fill a batch of {batch_size}")
        out = []
        for b, i in enumerate(range(0, n, batch_size)):
            key = jax.random.fold_in(jax.random.PRNGKey(seed), b)
            out.append(jax.device_get(_eval_step(
                self.binders, self.cfg, self.state.params, self.target_params,
                _device_batch(arrays, slice(i, i + batch_size)), key, self.logit_bias)))
        return {k: float(np.mean([o[k] for o in out])) for k in out[0]}

    def drafter(self, dtype: str | None = None) -> DSparkDrafter:
        params = self.state.params if dtype is None else cast_floats(self.state.params, dtype)
        return self.binders[1].bind(jax.tree.map(jnp.array, params))  # a copy: steps donate the masters


# ---- data: the target's own replies ---------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 1))
def _next_tokens(graphdef, temperature, state, tokens_bt, index_b, key):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
    hidden, _, _ = model(tokens_bt, positions, attention=causal_attention())
    logits_bv = model.logits(jnp.take_along_axis(hidden, index_b[:, None, None], axis=1)[:, 0])
    if temperature <= 0:
        return jnp.argmax(logits_bv, -1).astype(jnp.int32)
    return jax.random.categorical(key, logits_bv / temperature, axis=-1).astype(jnp.int32)


def sample_replies(model: Qwen3, prompts: Sequence[list[int]], max_new_tokens: int, *,
                   temperature: float = 1.0, seed: int = 0, eos_ids: Sequence[int] = (),
                   batch_size: int = 8, progress: bool = False) -> list[list[int]]:
    """Replies of `model` (EOS included when reached) by a plain loop without a KV cache: one
    causal forward over a fixed-length buffer per token (causality hides the right padding, so
    one compiled program serves every step). temperature 0 is greedy."""
    graphdef, state = nnx.split(model)
    length = -(-(max(map(len, prompts)) + max_new_tokens) // 64) * 64
    eos = set(int(e) for e in eos_ids)
    starts = range(0, len(prompts), batch_size)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc="replies", unit="batch")
    replies: list[list[int]] = []
    for start in starts:
        group = list(prompts[start:start + batch_size])
        n_real = len(group)
        group += [group[0]] * (batch_size - n_real)  # one compiled shape
        lens = np.array([len(p) for p in group])
        tokens = np.zeros((batch_size, length), np.int32)
        for b, p in enumerate(group):
            tokens[b, :len(p)] = p
        out = [[] for _ in range(batch_size)]
        done = np.zeros(batch_size, bool)
        base = jax.random.fold_in(jax.random.PRNGKey(seed), start)
        for t in range(max_new_tokens):
            new = np.asarray(_next_tokens(graphdef, float(temperature), state, jnp.asarray(tokens),
                                          jnp.asarray(lens + t - 1), jax.random.fold_in(base, t)))
            for b in np.flatnonzero(~done):
                tokens[b, lens[b] + t] = new[b]
                out[b].append(int(new[b]))
                done[b] = int(new[b]) in eos
            if done[:n_real].all():
                break
        replies.extend(out[:n_real])
    return replies
