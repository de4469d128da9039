"""The model's linear layers behind one interface: y = x @ w^T with fp32 accumulation.

    linear(x[..., K], w[N, K], impl)          -> fp32 [..., N]
    linear_partials(x[..., K], w[N, K], impl) -> fp32 [P, ..., N], y = sum_in_order(partials)

  "xla"     jnp.einsum with fp32 accumulation (the default; the CPU path and the test oracle).
            XLA picks its GEMM by shape, so a row's bits depend on how many rows share the GEMM.
  "triton"  linear_triton.py: batch-invariant (a row's bits never depend on the row count), so
            speculative verify (8 rows per lane) and stock decode (1 row) compute the target
            identically. GPU only, through jax-triton. w may also be int8 values (the drafter's
            weight-only int8, jspec/draft_weights.py): widened tile by tile inside the kernel,
            y = x @ values^T unscaled.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

LINEAR_IMPLS = ("xla", "triton")
MMA_ENV = "JSPEC_LINEAR_MMA"  # the "triton" kernel's MMA family (linear_triton.MMA_FAMILY)


def mma_family_from_env() -> str:
    """The batch-invariant kernel's MMA family this process asked for ("mixed" unless set: v2
    mma.sync plans up to 32 rows, v3 wgmma above), read without importing Triton (records name
    it; linear_triton validates it)."""
    return os.environ.get(MMA_ENV, "mixed")


def linear_xla(x, w):
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)


def linear(x, w, impl: str = "xla"):
    """x [..., K], w [N, K] -> fp32 [..., N]."""
    if impl == "xla":
        return linear_xla(x, w)
    if impl == "triton":
        from jspec.kernels.linear_triton import linear_triton
        lead = x.shape[:-1]
        with jax.named_scope("linear_bi"):  # profiles tell this custom call from attention's
            y = linear_triton(x.reshape(-1, x.shape[-1]), w)
        return y.reshape(lead + (w.shape[0],))
    raise ValueError(f"linear impl must be one of {LINEAR_IMPLS}, got {impl!r}")


def sum_in_order(partials):
    """[P, ...] -> (...((p[0] + p[1]) + p[2]) ... + p[P-1]): fp32 adds in split order, which XLA
    does not reassociate (a sum over axis 0 would take whatever order XLA picks by shape);
    linear_triton.combine's order."""
    y = partials[0]
    for s in range(1, partials.shape[0]):
        y = y + partials[s]
    return y


def linear_partials(x, w, impl: str = "xla"):
    """x [..., K], w [N, K] -> fp32 [P, ..., N] with linear(x, w, impl) = sum_in_order of them:
    the "triton" kernel's split-K partials left uncombined, so that the kernel reading y next
    adds them itself (kernels/reductions.py add_rms_norm, qk_norm_rope) and XLA launches no
    combine of its own; "xla": P = 1."""
    if impl == "xla":
        return linear_xla(x, w)[None]
    if impl == "triton":
        from jspec.kernels.linear_triton import linear_triton_partials
        lead = x.shape[:-1]
        with jax.named_scope("linear_bi"):
            p = linear_triton_partials(x.reshape(-1, x.shape[-1]), w)
        return p.reshape((p.shape[0],) + lead + (w.shape[0],))
    raise ValueError(f"linear impl must be one of {LINEAR_IMPLS}, got {impl!r}")


def check_impl(impl: str) -> None:
    """Refuse an impl this machine cannot run, naming why (before anything is compiled)."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"linear impl must be one of {LINEAR_IMPLS}, got {impl!r}")
    if impl == "triton":
        require_triton_gpu("batch-invariant linear layers")


def require_triton_gpu(what: str) -> None:
    """Refuse the Triton route off an NVIDIA GPU or without jax-triton, naming `what` needs it
    (the batch-invariant kernels' shared precondition)."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"{what} (impl 'triton') need an NVIDIA GPU; this backend is "
                         f"{jax.default_backend()}")
    try:
        import jax_triton  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{what} need jax-triton: {e}") from e
