"""The drafter's big weights stored as int8 with a scale per output channel (weight-only).

A speculative iteration reads every drafter weight at least once: at DSpark-8B size the five
layers and fc are 2.1 GB, and the Markov head's W2 [V, r] (78 MB) is read once per draft. int8
halves those reads. The drafter's numbers only decide what it proposes; the verifier and the
rejection sampler see the law the drafts were actually drawn from, so the output distribution is
the target's whatever the drafter's precision (acceptance may move; the engine measures it).

The engine keeps the int8 weights (`Int8Weight`, a pytree of the int8 values and the scales) in
its parameters, and the drafter's modules hold them as they are: `qwen3.project` (and the fc and
Markov W2 matmuls) see an Int8Weight and run `int8_linear`: the GEMM reads the values converted
to the model dtype and the scale multiplies its fp32 output, so that XLA may fuse the convert
into the GEMM's operand load and read one byte a weight (on the "triton" matmul route,
EngineConfig.draft_linear, jspec's linear kernel widens the int8 tiles itself). (`dequantize`
widens a whole state, for tests and tools.)

Quantized: each decoder layer's q/k/v/o and MLP projections, the stacked context K/V weight,
fc, and markov_w2 (the embedding-like markov_w1 is gathered a row at a time, never read whole). Norms, the gated Markov head's
small matrices and the confidence head stay in the model dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.kernels.linear import linear

Array = jax.Array

DRAFT_WEIGHT_DTYPES = (None, "int8")

# Weights read whole every iteration, by the name of their attribute; the value is the axes a
# matmul reduces over (the rest index output channels, each of which gets its own scale).
_REDUCED_AXES = {
    "q_proj": (2,), "k_proj": (2,), "v_proj": (2,),   # [H, hd, D]
    "qkv_proj": (2,),                                 # fused [Hq + 2 Hkv, hd, D]
    "o_proj": (1, 2),                                 # [D, Hq, hd]
    "gate_proj": (1,), "up_proj": (1,), "gate_up_proj": (1,), "down_proj": (1,),
    "context_kv_proj": (2,),                          # [L x 2 Hkv, hd, D] (DSparkDrafter)
    "fc": (1,),                                       # [D, taps x D]
    "markov_w2": (1,),                                # [V, r]
}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """w ~= values * scale: values int8 [...] and scale fp32 broadcastable to it (size 1 on the
    reduced axes); `dtype` is the dtype the weight is widened to."""
    values: Array
    scale: Array
    dtype: str

    def tree_flatten(self):
        return (self.values, self.scale), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(*children, dtype)

    @property
    def nbytes(self) -> int:
        return int(self.values.size) + 4 * int(self.scale.size)

    # What the model code does with a weight it reads (`param[...]`, `.shape`, `.reshape`), so
    # that an Int8Weight can sit in an nnx.Param and reach `qwen3.project` whole.
    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("an Int8Weight is read whole (param[...]), not indexed")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def reshape(self, *shape) -> "Int8Weight":
        """To an output-major matrix [N, K] only (what project needs): the scale becomes [N, 1].
        The reduced axes must be the trailing ones (true of every weight quantized here)."""
        values = self.values.reshape(*shape)
        if values.ndim != 2 or self.scale.size != values.shape[0]:
            raise ValueError(f"an Int8Weight {self.shape} with scale {self.scale.shape} reshapes "
                             f"to [N, K] with a scale per row only, not {values.shape}")
        return Int8Weight(values, self.scale.reshape(values.shape[0], 1), self.dtype)


def quantize_int8(w: Array, reduced_axes: tuple[int, ...]) -> Int8Weight:
    """Symmetric int8 with one scale per output channel: scale = max |w| / 127 over the reduced
    axes (1 where the channel is all zeros), values = round(w / scale). A weight already on such
    a grid with a +-127 in each channel comes back exactly (the shipped stand-in's scales are
    not amax / 127, so its weights move by up to half a step)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=reduced_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(values, scale, jnp.dtype(w.dtype).name)


def int8_linear(x: Array, w: Int8Weight, impl: str = "xla") -> Array:
    """x [..., K] through w [N, K] -> fp32 [..., N] on the matmul route `impl`
    (kernels/linear.py): the GEMM reads the int8 values as x's dtype (exact: |v| <= 127 fits
    bf16's 8 significant bits) and the scale multiplies the fp32 output. "xla": the only op
    between the int8 array and the GEMM is a convert, which XLA can fuse into the GEMM's
    operand load (scaling the weight first, as `widen` does, made XLA write a bf16 copy of every
    weight each iteration: 1.5 ms slower on the H100, 2026-12-06). "triton": the values go to
    jspec's linear kernel as they are, which widens each tile as it loads it."""
    values = w.values if impl == "triton" else w.values.astype(x.dtype)
    return linear(x, values, impl) * w.scale.reshape(-1).astype(jnp.float32)


def widen(w: Int8Weight) -> Array:
    """The weight in its model dtype: int8 -> dtype, times the scale (in that dtype)."""
    dt = jnp.dtype(w.dtype)
    return w.values.astype(dt) * w.scale.astype(dt)


def _name(path) -> str:
    """The attribute name that holds a leaf: the last key of its path that is a string and not
    nnx's own 'value' / 'raw_value'."""
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str) and name not in ("value", "raw_value"):
            return name
    return ""


def quantize_drafter_state(state, dtype: str | None):
    """An nnx.State of a drafter with its big weights as Int8Weight (dtype "int8"), or the state
    itself (None)."""
    if dtype is None:
        return state
    if dtype not in DRAFT_WEIGHT_DTYPES:
        raise ValueError(f"draft_weight_dtype must be one of {DRAFT_WEIGHT_DTYPES} (None: the "
                         f"model dtype), got {dtype!r}")

    def one(path, leaf):
        axes = _REDUCED_AXES.get(_name(path))
        if axes is None or not hasattr(leaf, "ndim") or leaf.ndim <= max(axes):
            return leaf
        return quantize_int8(leaf, axes)

    return jax.tree_util.tree_map_with_path(one, state)


def dequantize(state):
    """The state with every Int8Weight widened (tests and tools; the engine never widens)."""
    return jax.tree.map(lambda x: widen(x) if isinstance(x, Int8Weight) else x, state,
                        is_leaf=lambda x: isinstance(x, Int8Weight))


def quantized_count(state) -> int:
    """How many Int8Weight leaves `state` holds."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Int8Weight))
    return sum(isinstance(x, Int8Weight) for x in leaves)
