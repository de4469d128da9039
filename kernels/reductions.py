"""The target's row reductions behind one interface: RMSNorm over the last dim, the vocabulary
logsumexp behind log-probs, and the q/k head norms with RoPE after the fused qkv projection.

    rms_norm(x[..., D], w[D], eps, out_dtype=None, impl) -> [..., D] (w's dtype, or fp32)
    add_rms_norm(x[..., D], partials[P, ..., D], w[D], eps, impl)
                                    -> (x + the partials in split order: fp32 [..., D],
                                        its rms_norm: w's dtype [..., D])
    logsumexp(x[..., V], impl)                           -> fp32 [...]
    token_logprobs(logits[..., V], tokens[...], impl)    -> fp32 [...]
    qk_norm_rope(qkv[P, ..., H, hd], wq[hd], wk[hd], cos, sin, eps, Hq, Hkv, out_dtype, impl)
                                                         -> out_dtype [..., H, hd]
The partials are kernels.linear.linear_partials' output: a matmul's split-K partials, which the
"triton" kernels sum in split order themselves (no combine launched between them).

  "xla"     today's math, op for op (the default; the CPU path and the test oracle). XLA picks a
            reduction's algorithm by shape, so a row's bits depend on how many rows it shares
            the reduction with.
  "triton"  rowwise_triton.py: one program per row and a fixed order, so speculative verify
            (8 rows per lane) and stock decode (1 row) reduce a row identically. GPU only,
            through jax-triton; chosen with the matmuls' impl (kernels/linear.py) by
            qwen3._set_linear_impl, so EngineConfig.batch_invariant turns both on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kernels.linear import require_triton_gpu, sum_in_order

REDUCTION_IMPLS = ("xla", "triton")


def _bad_impl(impl: str) -> ValueError:
    return ValueError(f"reduction impl must be one of {REDUCTION_IMPLS}, got {impl!r}")


def check_impl(impl: str) -> None:
    """Refuse an impl this machine cannot run, naming why (as kernels.linear.check_impl)."""
    if impl not in REDUCTION_IMPLS:
        raise _bad_impl(impl)
    if impl == "triton":
        require_triton_gpu("batch-invariant reductions")


# ---- RMSNorm -----------------------------------------------------------------------------------

def rms_norm_xla(x, w, eps: float, out_dtype=None):
    """Qwen3's RMSNorm as transformers orders it: normalise in fp32, cast to the weight's dtype,
    then scale; with out_dtype float32 the scale is applied in fp32 and nothing is rounded."""
    x_f32 = x.astype(jnp.float32)
    x_f32 = x_f32 * jax.lax.rsqrt(jnp.mean(x_f32 * x_f32, axis=-1, keepdims=True) + eps)
    if out_dtype == jnp.float32:
        return w.astype(jnp.float32) * x_f32
    return w * x_f32.astype(w.dtype)


def rms_norm(x, w, eps: float, out_dtype=None, impl: str = "xla"):
    """x [..., D] (any float dtype), w [D] -> [..., D] in w's dtype, or fp32 when out_dtype is
    float32 (values that stay fp32 until a matmul: q/k before RoPE)."""
    if impl == "xla":
        return rms_norm_xla(x, w, eps, out_dtype)
    if impl == "triton":
        check_impl(impl)
        from jspec.kernels.rowwise_triton import rms_norm_triton
        with jax.named_scope("rms_norm_bi"):
            y = rms_norm_triton(x.reshape(-1, x.shape[-1]), w, eps,
                                f32_out=out_dtype == jnp.float32)
        return y.reshape(x.shape)
    raise _bad_impl(impl)


def add_rms_norm_xla(x, partials, w, eps: float):
    """The residual add, then RMSNorm: the model's two ops as it always ran them."""
    total = x.astype(jnp.float32) + sum_in_order(partials)
    return total, rms_norm_xla(total, w, eps)


def add_rms_norm(x, partials, w, eps: float, impl: str = "xla"):
    """x fp32 [..., D] (the residual stream), partials fp32 [P, ..., D] (linear_partials of the
    matmul that writes into it), w [D] -> (x + sum_in_order(partials), fp32; its RMSNorm in w's
    dtype). "triton": one kernel (rowwise_triton.add_rms_norm_triton) with the same fp32 adds in
    the same order, so the sum's bits equal the XLA add's, in place of XLA's add (and split-K
    combine) and the norm kernel: one launch instead of two."""
    if impl == "xla":
        return add_rms_norm_xla(x, partials, w, eps)
    if impl == "triton":
        check_impl(impl)
        from jspec.kernels.rowwise_triton import add_rms_norm_triton
        D = x.shape[-1]
        with jax.named_scope("add_rms_norm_bi"):
            total, y = add_rms_norm_triton(x.reshape(-1, D),
                                           partials.reshape(partials.shape[0], -1, D), w, eps)
        return total.reshape(x.shape), y.reshape(x.shape)
    raise _bad_impl(impl)


# ---- logsumexp and log-probs -------------------------------------------------------------------

def logsumexp_xla(x):
    return jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)


def logsumexp(x, impl: str = "xla"):
    """x [..., V] -> fp32 [...]: log sum_v exp x[..., v]."""
    if impl == "xla":
        return logsumexp_xla(x)
    if impl == "triton":
        check_impl(impl)
        from jspec.kernels.rowwise_triton import logsumexp_triton
        with jax.named_scope("logsumexp_bi"):
            lse = logsumexp_triton(x.reshape(-1, x.shape[-1]))
        return lse.reshape(x.shape[:-1])
    raise _bad_impl(impl)


def token_logprobs(logits, tokens, impl: str = "xla"):
    """logits [..., V], tokens [...] int -> log softmax(logits)[..., token] in fp32.

    "xla" is the log_softmax the engine always used (the default path's numbers stay put);
    "triton" is logits[token] - logsumexp(row), with the invariant logsumexp: the gather and
    the subtraction are elementwise, so the row's result is invariant too."""
    logits = logits.astype(jnp.float32)
    if impl == "xla":
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    if impl not in REDUCTION_IMPLS:
        raise _bad_impl(impl)
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return picked - logsumexp(logits, impl)


# ---- q/k head norms and RoPE -------------------------------------------------------------------

def rope_cos_sin(positions, head_dim: int, theta: float):
    """positions [...] -> (cos, sin) fp32 [..., head_dim / 2] of rotate-half RoPE (Hugging Face
    convention): angle = position * theta^(-2i / head_dim)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rope_rotate(x, cos, sin):
    """x [..., hd] (fp32) rotated by cos / sin broadcastable to [..., hd / 2]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qk_norm_rope_xla(qkv, wq, wk, cos, sin, eps: float, num_q_heads: int, num_kv_heads: int,
                     out_dtype):
    """The model's math (qwen3.Attention.qkv): q and k heads RMS-normed in fp32 with q_norm /
    k_norm (wq / wk), rotated in fp32, and rounded once with v."""
    f32 = jnp.float32
    q, k, v = jnp.split(qkv.astype(f32), [num_q_heads, num_q_heads + num_kv_heads], axis=-2)
    cos, sin = cos[..., None, :], sin[..., None, :]
    q = rope_rotate(rms_norm_xla(q, wq, eps, f32), cos, sin)
    k = rope_rotate(rms_norm_xla(k, wk, eps, f32), cos, sin)
    return jnp.concatenate([q, k, v], axis=-2).astype(out_dtype)


def qk_norm_rope(qkv_partials, wq, wk, cos, sin, eps: float, num_q_heads: int,
                 num_kv_heads: int, out_dtype, impl: str = "xla"):
    """qkv_partials [P, ..., Hq + 2 Hkv, hd] (the fused projection's fp32 output as
    linear_partials gives it: qkv = sum_in_order of them), wq / wk [hd] (q_norm, k_norm), cos /
    sin [..., hd / 2] (rope_cos_sin of the rows' positions) -> out_dtype [..., Hq + 2 Hkv, hd].
    "triton": one kernel for all heads of a row (rowwise_triton.qk_norm_rope_triton), which
    also sums the partials, instead of a combine, two norm kernels and the XLA fusions around
    them."""
    if impl == "xla":
        return qk_norm_rope_xla(sum_in_order(qkv_partials), wq, wk, cos, sin, eps, num_q_heads,
                                num_kv_heads, out_dtype)
    if impl == "triton":
        check_impl(impl)
        from jspec.kernels.rowwise_triton import qk_norm_rope_triton
        P, lead, heads = qkv_partials.shape[0], qkv_partials.shape[1:-2], qkv_partials.shape[-2:]
        half = cos.shape[-1]
        with jax.named_scope("qk_norm_rope_bi"):
            y = qk_norm_rope_triton(qkv_partials.reshape((P, -1) + heads), wq, wk,
                                    cos.reshape(-1, half), sin.reshape(-1, half), eps,
                                    num_q_heads, num_kv_heads, out_dtype)
        return y.reshape(lead + heads)
    raise _bad_impl(impl)
