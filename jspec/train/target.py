"""Target pre-training: next-token cross-entropy on packed rows.

Each row is causal over its whole length (documents in a row are separated by the separator
token, which the model learns to treat as a boundary). The CE is computed in row chunks, so the
[B, T, V] logits never exist at once (151936-wide vocabularies at 4k context).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.qwen3 import Qwen3, causal_attention, dense_attention
from jspec.train import (ModuleBinder, OptimConfig, TrainState, cast_floats, commit, global_norm,
                         make_optimizer, run_layers, sum_over_row_chunks)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TargetTrainConfig:
    compute_dtype: str = "float32"  # "bfloat16": bf16 forward over the fp32 masters
    attn_impl: str = "dense"        # "dense": jspec's masked softmax; "cudnn": fused (GPU, bf16)
    remat: bool = False             # recompute each layer in the backward pass
    loss_chunk: int = 4096          # rows (tokens) per CE chunk


def training_attention(impl: str, segment_ids_bt: Array | None = None):
    """Causal attention over whole rows, or with `segment_ids_bt` within each packed sequence
    only (a query sees the earlier keys of its own segment)."""
    if impl not in ("dense", "cudnn"):
        raise ValueError(f"attn_impl {impl!r}: expected 'dense' or 'cudnn'")
    if segment_ids_bt is None:
        if impl == "dense":
            return causal_attention()

        def attend(layer_idx, q, k, v, cache):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), cache
        return attend
    T = segment_ids_bt.shape[1]
    same_bts = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]  # once per forward
    causal_same_bts = same_bts & jnp.tril(jnp.ones((T, T), bool))[None]

    def attend(layer_idx, q, k, v, cache):
        if impl == "cudnn":  # the mask becomes cuDNN's additive bias
            return jax.nn.dot_product_attention(q, k, v, mask=same_bts[:, None], is_causal=True,
                                                implementation="cudnn"), cache
        return dense_attention(q, k, v, causal_same_bts), cache
    return attend


def segment_attention_gap(impl: str = "cudnn", seq: int = 512) -> float:
    """Largest difference between `impl`'s packed-row (segment) attention and the dense masked
    softmax on random bf16 q/k/v over two rows of several segments: the check that cuDNN's bias
    route computes the training mask (train_standin runs it before using it; a GPU test too)."""
    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 2, seq, 2, 128), jnp.bfloat16)
    a, b = seq // 3, seq // 5
    seg = jnp.asarray([[1] * a + [2] * (seq - a - 8) + [0] * 8, [1] * b + [2] * (seq - b)], jnp.int32)
    run = lambda name: jax.jit(lambda q, k, v: training_attention(name, seg)(0, q, k, v, None)[0])(
        q, k, v).astype(jnp.float32)
    return float(jnp.abs(run(impl) - run("dense")).max())


def target_forward(model: Qwen3, tokens_bt: Array, *, attn_impl: str = "dense", remat: bool = False,
                   tap_layers: Sequence[int] = (), positions_bt: Array | None = None,
                   segment_ids_bt: Array | None = None) -> tuple[Array, list[Array]]:
    """(final-normed hidden [B,T,D], taps) of a causal forward: model(...) itself when not
    rematerialising, else the same layer loop with per-layer checkpoints. Packed rows give
    their sequences' own positions and segment ids (jspec.train.data.pack_reply_arrays)."""
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
    attention = training_attention(attn_impl, segment_ids_bt)
    if not remat and not tap_layers:
        hidden, _, _ = model(tokens_bt, positions_bt, attention=attention)
        return hidden, []
    if not remat:
        hidden, taps, _ = model(tokens_bt, positions_bt, attention=attention, tap_layers=tap_layers)
        return hidden, taps
    outputs: dict[int, Array] = {}
    x_btd = run_layers(model.layers, model.embed(tokens_bt), positions_bt, attention, remat, outputs)
    dtype = model.embed_tokens[...].dtype
    return model.norm(x_btd), [outputs[i].astype(dtype) for i in tap_layers]


def lm_loss(model: Qwen3, tokens_bt: Array, cfg: TargetTrainConfig,
            logit_bias_v: Array | None = None) -> tuple[Array, dict]:
    """Mean next-token CE over positions 0..T-2 of every row. `logit_bias_v` (a compact
    vocabulary's log multiplicities, jspec.train.vocab) is added to every row's logits."""
    hidden_btd, _ = target_forward(model, tokens_bt, attn_impl=cfg.attn_impl, remat=cfg.remat)
    B, T, D = hidden_btd.shape
    head_vd = model.head_weight()
    labels_bt = jnp.roll(tokens_bt, -1, axis=1)
    weights_bt = jnp.broadcast_to(jnp.arange(T) < T - 1, (B, T)).astype(jnp.float32)

    def chunk_terms(r):
        logits_cv = jnp.einsum("cd,vd->cv", r["h"], head_vd, preferred_element_type=jnp.float32)
        if logit_bias_v is not None:
            logits_cv = logits_cv + logit_bias_v
        logp_cv = jax.nn.log_softmax(logits_cv, axis=-1)
        nll_c = -jnp.take_along_axis(logp_cv, r["y"][:, None], axis=-1)[:, 0]
        hit_c = (jnp.argmax(logits_cv, -1) == r["y"]).astype(jnp.float32)
        return {"nll": jnp.sum(r["w"] * nll_c), "hits": jnp.sum(r["w"] * hit_c),
                "w": jnp.sum(r["w"])}, {}

    rows = {"h": hidden_btd.reshape(B * T, D), "y": labels_bt.reshape(-1), "w": weights_bt.reshape(-1)}
    sums, _ = sum_over_row_chunks(chunk_terms, rows, cfg.loss_chunk)
    loss = sums["nll"] / sums["w"]
    return loss, {"loss": loss, "accuracy": sums["hits"] / sums["w"]}


def _loss(binder, cfg, params, tokens_bt, bias_v):
    return lm_loss(binder.bind(cast_floats(params, cfg.compute_dtype)), tokens_bt, cfg, bias_v)


def _apply(optim_cfg, params, opt_state, grads, metrics):
    updates, opt_state = make_optimizer(optim_cfg).update(grads, opt_state, params)
    metrics["grad_norm"] = global_norm(grads)
    return jax.tree.map(jnp.add, params, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def _train_step(binder, optim_cfg, cfg, params, opt_state, tokens_bt, bias_v):
    grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(binder, cfg, params, tokens_bt, bias_v)
    return _apply(optim_cfg, params, opt_state, grads, metrics)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
def _train_step_dp(binder, optim_cfg, cfg, mesh, params, opt_state, tokens_bt, bias_v):
    """The same step, data-parallel: each device takes its slice of the rows, the gradients and
    metrics are averaged over the mesh (every row has the same number of scored tokens, so the
    mean of the slices' means is the batch mean), and the replicated update runs on every
    device."""
    def local(params, tokens_bt, bias_v):
        grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(binder, cfg, params, tokens_bt, bias_v)
        return jax.lax.pmean((grads, metrics), "data")

    # check_vma off: the gradient is averaged explicitly above, not by an implied psum.
    grads, metrics = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P(),
                                   check_vma=False)(params, tokens_bt, bias_v)
    return _apply(optim_cfg, params, opt_state, grads, metrics)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _eval_step(binder, cfg, params, tokens_bt, bias_v):
    return _loss(binder, cfg, params, tokens_bt, bias_v)[1]


class TargetTrainer:
    """Pre-trains `model` (its arrays, in fp32, become the masters). `train_step(batch)` with
    batch {"tokens": [B, T] int32}; `eval_loss(rows)` for held-out rows. Steps are jitted once
    per (shapes, configs) and shared by trainers of the same shapes. `logit_bias` [V]: added to
    the logits (a compact vocabulary's log multiplicities); zeros by default. `mesh` (a 1-D
    "data" mesh, jspec.train.data_mesh): data-parallel steps over its devices, the masters
    replicated; every batch's rows must divide evenly over them."""

    def __init__(self, model: Qwen3, optim: OptimConfig, cfg: TargetTrainConfig = TargetTrainConfig(),
                 seed: int = 0, logit_bias: np.ndarray | None = None, mesh: Mesh | None = None):
        self.cfg, self.optim_cfg, self.mesh = cfg, optim, mesh
        V = model.cfg.vocab_size
        self.logit_bias = commit(jnp.zeros((V,), jnp.float32) if logit_bias is None
                                 else jnp.asarray(logit_bias, jnp.float32).reshape(V), mesh)
        self.binder = ModuleBinder(model)
        params = commit(cast_floats(self.binder.params(model), jnp.float32), mesh)
        self.state = TrainState(params=params, opt_state=commit(make_optimizer(optim).init(params), mesh),
                                step=0, data_position=0, rng=commit(jax.random.PRNGKey(seed), mesh))

    def place_state(self, state: TrainState) -> TrainState:
        """A restored state placed as this trainer's steps expect it (replicated over the mesh)."""
        if self.mesh is None:
            return state
        return dataclasses.replace(state, params=commit(state.params, self.mesh),
                                   opt_state=commit(state.opt_state, self.mesh), rng=commit(state.rng, self.mesh))

    def train_step(self, batch: dict) -> dict:
        s = self.state
        if self.mesh is None:
            s.params, s.opt_state, metrics = _train_step(self.binder, self.optim_cfg, self.cfg, s.params,
                                                         s.opt_state, jnp.asarray(batch["tokens"]),
                                                         self.logit_bias)
        else:
            rows = len(batch["tokens"])
            if rows % self.mesh.size:
                raise ValueError(f"a batch of {rows} rows does not divide over {self.mesh.size} devices")
            tokens_bt = jax.device_put(np.asarray(batch["tokens"]), NamedSharding(self.mesh, P("data")))
            s.params, s.opt_state, metrics = _train_step_dp(self.binder, self.optim_cfg, self.cfg, self.mesh,
                                                            s.params, s.opt_state, tokens_bt, self.logit_bias)
        s.step += 1
        s.data_position += 1
        return metrics

    def eval_loss(self, rows: np.ndarray, batch_size: int) -> dict[str, float]:
        """Token-weighted mean CE / accuracy over the full batches of `rows` (a tail that does
        not fill a batch is skipped: one compiled shape)."""
        n = (len(rows) // batch_size) * batch_size
        if n == 0:
            raise ValueError(f"{len(rows)} held-out rows cannot fill a batch of {batch_size}")
        totals = [jax.device_get(_eval_step(self.binder, self.cfg, self.state.params,
                                            jnp.asarray(rows[i:i + batch_size]), self.logit_bias))
                  for i in range(0, n, batch_size)]
        return {k: float(np.mean([t[k] for t in totals])) for k in ("loss", "accuracy")}

    def model(self, dtype: str | None = None) -> Qwen3:
        """The trained model (fp32 masters, or cast to `dtype`), as a fresh module."""
        params = self.state.params if dtype is None else cast_floats(self.state.params, dtype)
        return self.binder.bind(jax.tree.map(jnp.array, params))  # a copy: steps donate the masters
