"""jax-triton kernels through jaxlib's FFI custom call, so that XLA can put them in command
buffers (CUDA graphs).

    triton_call(*args, **kwargs)   jax_triton.triton_call, lowered to `triton_kernel_call_ffi`

Why: jax-triton 0.3.1 (the release that runs with Triton 3.6) lowers every kernel to the legacy
custom call `triton_kernel_call` (API version 2), and XLA never captures a legacy custom call in a
command buffer. On the H200 the batch-invariant decode step (Triton GEMMs, four per layer) left
the host launching kernels for 5.6 of its 6.1 ms whether command buffers were on or off, while
the XLA path's launches took 2.35 of 5.43 ms with them (docs/benchmarks.md, "Is the stock step
launch-bound?"). jaxlib also registers `triton_kernel_call_ffi`: a typed-FFI handler, marked
command-buffer compatible, that reads the same zlib-compressed kernel-call proto from an `opaque`
attribute. Newer jax-triton releases lower to it, but they need Triton >= 3.7.

How: `install()` re-registers jax-triton's CUDA lowering as a wrapper. The wrapper runs jax-triton's
own lowering, which compiles the kernel and builds the proto. It then replaces the legacy op it
emitted with an FFI call that carries the same operands, results, aliases and proto. The kernel
launched and its arguments do not change, only the custom call that wraps it does.

JSPEC_TRITON_FFI selects the route: "1" the FFI target, "0" the legacy one (jax-triton as is),
"auto" (the default) the FFI target if a small probe kernel compiles and runs through it on this
machine's jaxlib, else the legacy one, with a warning.
"""

from __future__ import annotations

import functools
import os
import warnings

import triton
import triton.language as tl

FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
_route: str | None = None  # "ffi" | "legacy", decided once per process


def route() -> str:
    """The custom call route this process uses (deciding it on first use)."""
    install()
    return _route


def triton_call(*args, **kwargs):
    """jax_triton.triton_call through the route of `route()`."""
    import jax_triton as jt

    install()
    return jt.triton_call(*args, **kwargs)


def _ffi_lowering(legacy_rule, ctx, *array_args, **params):
    """jax-triton's lowering, then its legacy custom call swapped for the FFI target."""
    import jax
    from jax.interpreters.mlir import ir

    results = legacy_rule(ctx, *array_args, **params)
    legacy_op = results[0].owner
    legacy_op = getattr(legacy_op, "operation", legacy_op)
    target = ir.StringAttr(legacy_op.attributes["call_target_name"]).value
    if target != LEGACY_TARGET:
        raise RuntimeError(f"jax-triton emitted custom call {target!r}, expected {LEGACY_TARGET!r}: "
                           "this jax-triton version is not the one kernels/triton_ffi.py wraps")
    opaque = ir.StringAttr(legacy_op.attributes["backend_config"]).value_bytes
    aliases = dict(params.get("input_output_aliases") or {})
    ffi_results = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4, operand_output_aliases=aliases)(
        ctx, *array_args, opaque=opaque)
    legacy_op.erase()  # its results have no users yet: the wrapper returns the FFI op's instead
    return ffi_results


def _register(use_ffi: bool) -> None:
    import jax_triton.triton_lib as jtl
    from jax.interpreters import mlir

    legacy_rule = functools.partial(jtl.triton_kernel_call_lowering, jtl.get_cuda_backend)
    rule = functools.partial(_ffi_lowering, legacy_rule) if use_ffi else legacy_rule
    mlir.register_lowering(jtl.triton_kernel_call_p, rule, platform="cuda")


def _probe_kernel(x_ptr, y_ptr, n_elements: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0 + 1.0, mask=mask)


def _probe() -> str | None:
    """None if a small kernel compiles and runs through the FFI target, else why not."""
    import jax
    import jax.numpy as jnp
    import jax_triton as jt
    import numpy as np

    try:
        # The first kernel call usually comes while a model is being traced: evaluate eagerly.
        with jax.ensure_compile_time_eval():
            x = jnp.arange(100, dtype=jnp.float32)
            y = np.asarray(jax.jit(lambda x: jt.triton_call(
                x, kernel=triton.jit(_probe_kernel),
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,), n_elements=100,
                BLOCK=128))(x))
        if not np.array_equal(y, np.arange(100, dtype=np.float32) * 2 + 1):
            return "the probe kernel's output is wrong through the FFI target"
    except Exception as e:  # noqa: BLE001 - any failure means: use the legacy route
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def install() -> None:
    """Decide the route once per process and register jax-triton's CUDA lowering for it."""
    global _route
    if _route is not None:
        return
    mode = os.environ.get("JSPEC_TRITON_FFI", "auto").strip().lower()
    if mode not in ("1", "0", "auto"):
        raise ValueError(f"JSPEC_TRITON_FFI must be 1, 0 or auto, got {mode!r}")
    if mode == "0":
        _register(False)
        _route = "legacy"
        return
    _register(True)
    _route = "ffi"
    if mode == "auto":
        why = _probe()
        if why is not None:
            warnings.warn(f"jax-triton kernels stay on the legacy custom call (no CUDA graphs): "
                          f"the FFI target {FFI_TARGET} failed here ({why})", RuntimeWarning)
            _register(False)
            _route = "legacy"
