"""kernels/triton_ffi.py: the rewrite of jax-triton's legacy custom call into jaxlib's FFI target,
checked on CPU on the lowered module (the GPU run is tests/test_kernels_gpu.py), and the route
switch."""

from __future__ import annotations

import functools

import jax
import jax.extend  # noqa: F401 - jax.extend.core.Primitive
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir

pytest.importorskip("triton")
from jspec.kernels import triton_ffi  # noqa: E402

PROTO = b"\x78\x9c compressed kernel-call proto \x00\x01\xff"


def _legacy_rule(ctx, *array_args, input_output_aliases, **_):
    """What jax-triton 0.3.1 emits: the legacy target, API version 2, the proto as backend_config."""
    return jax.ffi.ffi_lowering(triton_ffi.LEGACY_TARGET, api_version=2, backend_config=PROTO,
                                operand_output_aliases=dict(input_output_aliases))(ctx, *array_args)


def _lowered_text(rule, aliases):
    prim = jax.extend.core.Primitive(f"fake_triton_{id(rule)}")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *avals, **_: [jax.core.ShapedArray(avals[0].shape, jnp.float32)])
    mlir.register_lowering(prim, functools.partial(rule, input_output_aliases=aliases))
    x = jnp.ones((4, 8), jnp.float32)
    return jax.jit(lambda x, y: prim.bind(x, y)[0]).lower(x, x).as_text()


@pytest.mark.parametrize("aliases", [{}, {0: 0}])
def test_legacy_call_becomes_the_ffi_target_with_the_same_proto(aliases):
    legacy = _lowered_text(_legacy_rule, aliases)
    assert f'@{triton_ffi.LEGACY_TARGET}(' in legacy and "api_version = 2" in legacy
    ffi = _lowered_text(functools.partial(triton_ffi._ffi_lowering, _legacy_rule), aliases)
    assert f'@{triton_ffi.FFI_TARGET}(' in ffi and f'@{triton_ffi.LEGACY_TARGET}(' not in ffi
    # jax's own typed-FFI form (what jax.ffi.ffi_call emits): attributes in mhlo.backend_config.
    assert "mhlo.backend_config = {opaque = " in ffi and "api_version = 2" not in ffi
    assert ffi.count("stablehlo.custom_call") == 1  # the legacy op is gone, not left dead
    assert ffi.count("output_operand_aliases") == legacy.count("output_operand_aliases") == len(aliases)
    # The proto travels unchanged: the same escaped bytes in both modules.
    escaped = legacy.split("backend_config = ")[1].split('"')[1]
    assert ffi.split("opaque = ")[1].split('"')[1] == escaped


def test_an_unexpected_target_is_refused():
    def other_rule(ctx, *array_args, input_output_aliases, **_):
        return jax.ffi.ffi_lowering("some_other_call", api_version=2, backend_config=PROTO)(
            ctx, *array_args)

    with pytest.raises(RuntimeError, match="some_other_call"):
        _lowered_text(functools.partial(triton_ffi._ffi_lowering, other_rule), {})


def test_route_setting_is_validated(monkeypatch):
    monkeypatch.setattr(triton_ffi, "_route", None)
    monkeypatch.setenv("JSPEC_TRITON_FFI", "yes")
    with pytest.raises(ValueError, match="JSPEC_TRITON_FFI"):
        triton_ffi.install()
    assert triton_ffi._route is None


@pytest.mark.parametrize("mode,probe_error,route", [
    ("0", None, "legacy"), ("1", "never asked", "ffi"), ("auto", None, "ffi"),
    ("auto", "XlaRuntimeError: no FFI handler", "legacy")])
def test_route_choice(monkeypatch, mode, probe_error, route):
    """auto keeps the FFI lowering only when the probe kernel ran through it; 0 never probes."""
    registered, probed = [], []
    monkeypatch.setattr(triton_ffi, "_route", None)
    monkeypatch.setattr(triton_ffi, "_register", registered.append)
    monkeypatch.setattr(triton_ffi, "_probe", lambda: probed.append(1) or probe_error)
    monkeypatch.setenv("JSPEC_TRITON_FFI", mode)
    if route == "legacy" and mode == "auto":
        with pytest.warns(RuntimeWarning, match="no FFI handler"):
            assert triton_ffi.route() == route
    else:
        assert triton_ffi.route() == route
    assert registered[-1] == (route == "ffi")
    assert bool(probed) == (mode == "auto")
    triton_ffi.install()  # decided once per process
    assert len(probed) == (mode == "auto")
