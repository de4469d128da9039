"""EngineConfig.draft_linear: the drafter's matmuls on XLA's GEMMs ("xla", the default) or on
jspec's linear kernel ("triton", GPU), which reads the drafter's int8 weights itself.

The kernel itself (int8 tiles widened in-kernel, exact) is tested under Triton's interpreter and
compiled for sm_90 in test_kernels_linear.py. Here, on CPU, the kernel is stood in for by its XLA
twin, and what is checked is the wiring: which matmuls take the route, that the int8 values
reach the kernel unconverted and are scaled after it, that the drafter's norms and the target
stay where they were, and that the engine emits what it emits on the default route.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.draft_weights import quantize_int8
from jspec.dspark import init_random_drafter
from jspec.engine import Engine, EngineConfig, Request
from jspec.kernels.linear import linear_xla
from jspec.qwen3 import init_random, project

from test_spec_engine import CFG, DCFG, ECFG, _scaled, tiny_pair_dirs  # noqa: F401 (fixture)

TRITON = "triton"


@pytest.fixture
def kernel_stand_in(monkeypatch):
    """linear_triton(_partials) replaced by the XLA twin, widening int8 values as the kernel
    does; every call's weight dtype is recorded. Also lets the engine take the route on CPU."""
    import jspec.engine
    import jspec.kernels.linear_triton as lt
    calls = []

    def stand_in(x, w, **kw):
        assert x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1]
        assert w.dtype in (x.dtype, jnp.int8)
        calls.append((str(w.dtype), tuple(w.shape)))
        return linear_xla(x, w.astype(x.dtype))

    monkeypatch.setattr(lt, "linear_triton", stand_in)
    monkeypatch.setattr(lt, "linear_triton_partials", lambda x, w, **kw: stand_in(x, w)[None])
    monkeypatch.setattr(jspec.engine, "require_triton_gpu", lambda what: None)
    return calls


def test_int8_projection_hands_the_kernel_int8_values(kernel_stand_in):
    """project(x, Int8Weight, "triton"): the kernel gets the int8 values themselves (no widened
    copy) and the scale multiplies its output: the XLA route's numbers exactly."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 64)), jnp.bfloat16)
    w = quantize_int8(jnp.asarray(rng.normal(size=(4, 8, 64)), jnp.bfloat16), (2,))
    got = project(x, w, TRITON)
    assert kernel_stand_in == [("int8", (32, 64))]
    assert got.shape == (3, 5, 4, 8) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(project(x, w, "xla")))
    # a scale per output channel, applied after the GEMM: a wrong axis would show here
    want = np.einsum("tk,nk->tn", np.asarray(x, np.float64).reshape(15, 64),
                     np.asarray(w.values, np.float64).reshape(32, 64)) * np.asarray(
                         w.scale, np.float64).reshape(1, 32)
    np.testing.assert_allclose(np.asarray(got).reshape(15, 32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad", ["cuda", "", None])
def test_unknown_route_is_refused(bad):
    with pytest.raises(ValueError, match="draft_linear must be one of"):
        EngineConfig(draft_linear=bad)


def _requests(temperature):
    rng = np.random.default_rng(11)
    return [Request(rng.integers(0, CFG.vocab_size, n).tolist(), temperature=temperature,
                    max_tokens=m, seed=i, request_id=i)
            for i, (n, m) in enumerate([(5, 20), (20, 9), (33, 14)])]


@pytest.fixture(scope="module")
def pair():
    return (_scaled(init_random(CFG, seed=1), 5), _scaled(init_random_drafter(DCFG, seed=3), 5))


def test_the_route_needs_a_gpu(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="draft_linear='triton'.*NVIDIA GPU"):
        Engine(CFG, target, (), dataclasses.replace(ECFG, draft_linear=TRITON), drafter=drafter,
               draft_cfg=DCFG)


@pytest.mark.parametrize("weights", [None, "int8"])
def test_drafter_matmuls_take_the_route_and_the_outputs_do_not_change(pair, kernel_stand_in,
                                                                      weights):
    """With draft_linear="triton" every matmul of the drafter (its layers, fc, the context K/V,
    the Markov W2, and with int8 weights the head rows) runs on the kernel, int8 values as they
    are; its norms stay on XLA, and the target keeps its own route. With the kernel's XLA twin
    the engine then emits exactly what the default route emits, token for token and step for
    step, greedy and sampled."""
    target, drafter = pair
    base = dataclasses.replace(ECFG, draft_weight_dtype=weights)
    want = {t: Engine(CFG, target, (), base, drafter=drafter, draft_cfg=DCFG).generate(
        _requests(t)) for t in (0.0, 1.0)}
    assert kernel_stand_in == []  # the default route never calls the kernel
    eng = Engine(CFG, target, (), dataclasses.replace(base, draft_linear=TRITON),
                 drafter=drafter, draft_cfg=DCFG)
    t, d = eng.programs.models(eng.params)
    assert d.linear_impl == TRITON and d.hidden_norm.impl == d.norm.impl == "xla"
    for layer in d.layers:
        assert layer.mlp.linear_impl == layer.self_attn.linear_impl == TRITON
        assert layer.input_layernorm.impl == layer.self_attn.k_norm.impl == "xla"
    assert t.linear_impl == t.norm.impl == "xla"
    for t in (0.0, 1.0):
        got = eng.generate(_requests(t))
        for a, b in zip(want[t], got):
            assert a.output_ids == b.output_ids
            assert a.step_tokens == b.step_tokens  # the same drafts accepted
    lc = DCFG.layers
    D, V, F, hd = lc.hidden_size, lc.vocab_size, lc.intermediate_size, lc.head_dim
    want_shapes = {(lc.num_heads * hd, D), (lc.num_kv_heads * hd, D), (D, lc.num_heads * hd),
                   (2 * F, D), (D, F),  # a layer's q, k / v, o, gate_up, down
                   (D, len(DCFG.target_layer_ids) * D),  # fc
                   (lc.num_layers * 2 * lc.num_kv_heads * hd, D),  # the context K/V, stacked
                   (V, DCFG.markov_rank)}  # Markov W2 (and, int8, the head rows: [V, D])
    assert {shape for _, shape in kernel_stand_in} == want_shapes
    assert {dtype for dtype, _ in kernel_stand_in} == {"int8" if weights else "float32"}


def test_api_and_cli_thread_it(tiny_pair_dirs, capsys):
    from jspec.api import LLM
    from jspec.cli import main
    target_dir, draft_dir = tiny_pair_dirs
    kw = dict(max_lanes=2, max_context=128, attn_impl="xla")
    with pytest.raises(ValueError, match="draft_linear needs a draft model"):
        LLM(target_dir, draft_linear=TRITON, **kw)
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        LLM(target_dir, draft=draft_dir, draft_linear=TRITON, **kw)
    assert LLM(target_dir, draft=draft_dir, draft_linear="xla", **kw).engine.ecfg.draft_linear == "xla"
    args = ["generate", "--model", str(target_dir), "--draft", str(draft_dir), "--prompt",
            "def f(x):", "--max-tokens", "8", "--temperature", "0", "--max-context", "128",
            "--attn-impl", "xla", "--json", "--draft-linear", "xla"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens_per_step"] >= 1.0
    with pytest.raises(SystemExit):
        main(args[:-1] + ["cuda"])
    assert "--draft-linear: invalid choice: 'cuda'" in capsys.readouterr().err


def test_bench_takes_it_per_workload_and_records_it(tmp_path, capsys):
    from jspec.bench.run import command_line, draft_linear_choice
    from jspec.cli import build_parser, main
    base = ["bench", "--model", "m", "--draft", "d", "--out", str(tmp_path)]
    args = build_parser().parse_args(base + ["--draft-linear", "solo=triton,team=triton"])
    assert draft_linear_choice(args) == {"solo": TRITON, "team": TRITON, "busy": "xla"}
    assert "--draft-linear solo=triton,team=triton" in command_line(args)
    plain = build_parser().parse_args(base)
    assert draft_linear_choice(plain) == {"solo": "xla", "team": "xla", "busy": "xla"}
    assert "--draft-linear" not in command_line(plain)
    code = main(["bench", "--model", str(tmp_path / "nowhere"), "--draft", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o"), "--draft-linear", "busy=cuda"])
    assert code == 2
    assert "--draft-linear: 'busy=cuda': the value must be one of xla, triton, none" in \
        capsys.readouterr().err
    assert not (tmp_path / "o").exists()
