"""Training for jspec (optax): target pre-training and DSpark / DFlash drafter distillation.

  data           corpus -> manifest, tokens, packed rows, held-out split; reply sequences;
                 deterministic, resumable batch order
  target         next-token pre-training of a Qwen3 target
  drafter        DeepSpec's objective against a frozen target (and the DFlash ablation)
  checkpointing  resumable checkpoints, the loss log, the training loop, HF / DeepSpec export

Shared here: the optimizer, the binding between trainable arrays and NNX modules, the layer
loop with optional rematerialisation, and vocabulary-sized losses computed in row chunks.

Precision: master params and optimizer state are fp32 pure dicts (`nnx.to_pure_dict` layout).
With `compute_dtype="bfloat16"` the forward casts the masters to bf16 inside the differentiated
function (bf16 compute, fp32 masters and grads, as DeepSpec's BF16Optimizer); softmaxes, norms
and losses stay fp32. The module graph is split once per trainer and the step is jitted once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Array = jax.Array
Params = Any  # a pure dict of arrays, as nnx.to_pure_dict gives


# ---- optimizer --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    total_steps: int
    lr: float = 6e-4
    warmup_frac: float = 0.04  # linear warm-up over this fraction of the steps, then cosine to end
    end_lr_frac: float = 0.0
    weight_decay: float = 0.0  # on matrices only (ndim >= 2), never on norms or biases
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0
    # Time-boxed: the same warm-up + cosine, over the fraction of a deadline's time gone instead
    # of steps (fit passes the factor to every step), so the schedule ends at the time box
    # whatever the step rate turns out to be on the machine; total_steps is then only a cap.
    time_boxed: bool = False


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    if cfg.time_boxed:  # the optimizer runs at the peak; time_boxed_factor scales its updates
        return optax.constant_schedule(cfg.lr)
    warmup = max(1, int(round(cfg.warmup_frac * cfg.total_steps)))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.lr * cfg.end_lr_frac)


def time_boxed_factor(cfg: OptimConfig, fraction: float) -> float:
    """The learning-rate factor (0..1) of a time-boxed run after `fraction` of its time: linear
    warm-up over warmup_frac, then cosine down to end_lr_frac at 1."""
    f = min(max(fraction, 0.0), 1.0)
    if f < cfg.warmup_frac:
        return f / cfg.warmup_frac
    t = (f - cfg.warmup_frac) / max(1.0 - cfg.warmup_frac, 1e-9)
    return cfg.end_lr_frac + (1.0 - cfg.end_lr_frac) * 0.5 * (1.0 + np.cos(np.pi * t))


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=decay_mask))


def commit(tree, mesh: Mesh | None = None) -> Any:
    """Arrays placed explicitly on the default device (or replicated over `mesh`'s devices).
    Step outputs are committed; inputs must be too, or the second step compiles a second
    program."""
    if mesh is None:
        return jax.device_put(tree, jax.devices()[0])
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def data_mesh(num_devices: int | None = None) -> Mesh | None:
    """A 1-D "data" mesh over the first `num_devices` devices (all by default) for data-parallel
    steps; None for one device (the plain single-device step)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"{n} devices asked for, {len(devices)} present")
    return Mesh(np.array(devices[:n]), ("data",)) if n > 1 else None


def global_norm(tree) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# ---- arrays <-> modules -------------------------------------------------------------------------

def cast_floats(tree, dtype) -> Any:
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


class ModuleBinder:
    """Split a module once; rebuild it around any pure dict of same-shaped arrays (inside jit
    too). Training keeps pure dicts: their layout does not depend on the flax version.
    Binders compare by module structure, so they are jit static arguments and trainers of the
    same shapes share compiled steps."""

    def __init__(self, module: nnx.Module):
        self.graphdef, state = nnx.split(module)
        self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

    def __hash__(self):
        return hash(self.graphdef)

    def __eq__(self, other):
        return isinstance(other, ModuleBinder) and self.graphdef == other.graphdef

    @staticmethod
    def params(module: nnx.Module) -> Params:
        return nnx.to_pure_dict(nnx.state(module))

    def bind(self, params: Params) -> nnx.Module:
        state = jax.tree.map(lambda x: x, self._template)  # a fresh State to fill
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


@dataclasses.dataclass
class TrainState:
    params: Params          # fp32 masters
    opt_state: Any
    step: int               # optimizer steps done
    data_position: int      # batches consumed from the data order
    rng: Array              # base key (uint32 key data); step keys are fold_in(rng, step)


# ---- the layer loop ---------------------------------------------------------------------------

def run_layers(layers: Sequence[nnx.Module], x_btd: Array, positions_bt: Array,
               attention: Callable, remat: bool, outputs: dict | None = None) -> Array:
    """x through decoder layers (no caches), as Qwen3.__call__ / DSparkDrafter.block_hidden
    loop them; layer i's output goes to outputs[i] when given (taps). With `remat`, each layer's
    activations are recomputed in the backward pass: only layer inputs stay live."""
    for i, layer in enumerate(layers):
        if remat:
            graphdef, state = nnx.split(layer)

            @jax.checkpoint
            def apply(state, x, i=i, graphdef=graphdef):
                return nnx.merge(graphdef, state)(i, x, positions_bt, attention, None)[0]

            x_btd = apply(state, x_btd)
        else:
            x_btd, _ = layer(i, x_btd, positions_bt, attention, None)
        if outputs is not None:
            outputs[i] = x_btd
    return x_btd


# ---- vocabulary-sized terms in row chunks -----------------------------------------------------

def sum_over_row_chunks(fn: Callable[[dict], tuple[dict, dict]], rows: dict[str, Array],
                        chunk: int, remat: bool = True) -> tuple[dict, dict]:
    """fn(rows of one chunk) -> (sums, per_row). Rows are cut into chunks of `chunk` (the last
    padded with zeros: fn must weight its sums so zero rows add nothing); each chunk's [chunk, V]
    logits live only inside a rematerialised scan step, so V-sized tensors never exist for all
    rows at once. `remat=False` keeps each step's residuals for the backward instead of
    recomputing the step (more memory, less compute; the values and gradients are the same).
    Returns (sums added over chunks, per_row values for the real rows)."""
    n_rows = jax.tree.leaves(rows)[0].shape[0]
    chunk = max(1, min(chunk, n_rows))
    n_chunks = -(-n_rows // chunk)
    pad = n_chunks * chunk - n_rows

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((n_chunks, chunk) + x.shape[1:])

    chunks = jax.tree.map(split, rows)
    body = jax.checkpoint(fn) if remat else fn
    first = jax.tree.map(lambda x: x[0], chunks)
    sums_shape = jax.eval_shape(body, first)[0]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)

    def step(acc, chunk_rows):
        sums, per_row = body(chunk_rows)
        return jax.tree.map(jnp.add, acc, sums), per_row

    sums, per_row = jax.lax.scan(step, zeros, chunks)
    per_row = jax.tree.map(lambda x: x.reshape((n_chunks * chunk,) + x.shape[2:])[:n_rows], per_row)
    return sums, per_row
