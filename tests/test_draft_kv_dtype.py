"""EngineConfig.draft_kv_dtype: the drafter's KV pool in float8_e4m3fn.

It may change what the drafter proposes (acceptance) but never what the engine emits: the
target's pool, the verifier and the rejection sampler do not see it. The kernels' side (write_kv
clipping, fp8 pages in the XLA reference and the Triton kernel) is in test_kernels_attention.py.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.dspark import init_random_drafter
from jspec.engine import Engine, EngineConfig, Request
from jspec.qwen3 import init_random

# The speculative engine tests' tiny float32 pair and engine config (and their CLI/API fixture).
from test_spec_engine import CFG, DCFG, ECFG, K, _scaled, tiny_pair_dirs  # noqa: F401 (fixture)

FP8 = "float8_e4m3fn"


def _loud(drafter):
    """Drafter K/V of several hundred (v_proj and k_norm x 300): a few % of them lie past fp8's
    +-448, so the pool only stays finite if writes clip."""
    for layer in drafter.layers:
        layer.self_attn.v_proj[...] = layer.self_attn.v_proj[...] * 300
        layer.self_attn.k_norm.weight[...] = layer.self_attn.k_norm.weight[...] * 300
    return drafter


def _requests(specs, temperature=0.0):
    rng = np.random.default_rng(7)
    return [Request(rng.integers(0, CFG.vocab_size, n).tolist(), temperature=temperature,
                    max_tokens=m, seed=i, request_id=i) for i, (n, m) in enumerate(specs)]


SPECS = [(5, 20), (20, 7), (33, 12), (9, 30), (14, 25)]


@pytest.fixture(scope="module")
def pair():
    return _scaled(init_random(CFG, seed=1), 5), _loud(_scaled(init_random_drafter(DCFG, seed=3), 5))


def test_fp8_drafter_pool_greedy_is_token_identical_to_stock(pair):
    target, drafter = pair
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS))
    eng = Engine(CFG, target, (), dataclasses.replace(ECFG, draft_kv_dtype=FP8),
                 drafter=drafter, draft_cfg=DCFG)
    # Only the drafter's pool changes dtype; the target's stays the model's.
    assert eng.draft_cache_shape.dtype == FP8 and eng.cache_shape.dtype == CFG.dtype
    assert {c.dtype for pair in eng.caches[1] for c in pair} == {jnp.dtype(FP8)}
    assert {c.dtype for pair in eng.caches[0] for c in pair} == {jnp.dtype(CFG.dtype)}
    spec = eng.generate(_requests(SPECS))
    for a, b in zip(stock, spec):
        assert a.output_ids == b.output_ids
        assert b.step_tokens and 1 <= b.tokens_per_step <= K + 1
    # Writes clip to fp8's finite range: no NaN ever enters the drafter's pool.
    assert max(float(jnp.abs(c.astype(jnp.float32)).max()) for pair in eng.caches[1]
               for c in pair) == 448.0
    assert all(np.isfinite(np.asarray(c.astype(jnp.float32))).all()
               for pair in eng.caches[1] for c in pair)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1


def test_fp8_drafter_pool_in_a_bf16_engine():
    """bf16 queries over fp8 pages (the GPU's combination): the pool is half the bf16 one and a
    sampled run completes with acceptance statistics."""
    cfg = CFG.replace(dtype="bfloat16")
    dcfg = dataclasses.replace(DCFG, layers=DCFG.layers.replace(dtype="bfloat16"))
    target, drafter = init_random(cfg, seed=1), init_random_drafter(dcfg, seed=3)
    bf16 = Engine(cfg, target, (), ECFG, drafter=drafter, draft_cfg=dcfg)
    fp8 = Engine(cfg, target, (), dataclasses.replace(ECFG, draft_kv_dtype=FP8),
                 drafter=drafter, draft_cfg=dcfg)
    assert fp8.draft_cache_shape.page_bytes * 2 == bf16.draft_cache_shape.page_bytes
    assert fp8.cache_shape == bf16.cache_shape
    reqs = fp8.generate(_requests(SPECS[:3], temperature=1.0))
    assert all(len(r.output_ids) == r.max_tokens and r.step_tokens for r in reqs)


def test_stock_engine_ignores_it(pair):
    """One EngineConfig serves both engines of a comparison; a stock engine has no drafter pool."""
    target, _ = pair
    ecfg = dataclasses.replace(ECFG, draft_kv_dtype=FP8)
    eng = Engine(CFG, target, (), ecfg)
    assert {c.dtype for pair in eng.caches for c in pair} == {jnp.dtype(CFG.dtype)}
    assert ([r.output_ids for r in eng.generate(_requests(SPECS[:2]))]
            == [r.output_ids for r in Engine(CFG, target, (), ECFG).generate(_requests(SPECS[:2]))])


@pytest.mark.parametrize("bad", ["float16", "fp8", "bfloat16", "float8_e5m2"])
def test_invalid_draft_kv_dtype_is_refused(bad):
    with pytest.raises(ValueError, match=f"draft_kv_dtype must be one of .*float8_e4m3fn.*{bad}"):
        EngineConfig(draft_kv_dtype=bad)


# ---- API and CLI ----------------------------------------------------------------------------------

def test_api_and_cli_thread_it(tiny_pair_dirs, capsys):
    from jspec.api import LLM
    from jspec.cli import main
    target_dir, draft_dir = tiny_pair_dirs
    kw = dict(max_lanes=2, max_context=128, attn_impl="xla")
    llm = LLM(target_dir, draft=draft_dir, draft_kv_dtype=FP8, **kw)
    assert llm.engine.ecfg.draft_kv_dtype == FP8 and llm.engine.draft_cache_shape.dtype == FP8
    with pytest.raises(ValueError, match="draft_kv_dtype needs a draft model"):
        LLM(target_dir, draft_kv_dtype=FP8, **kw)

    args = ["generate", "--model", str(target_dir), "--draft", str(draft_dir), "--prompt",
            "def f(x):", "--max-tokens", "8", "--temperature", "0", "--max-context", "128",
            "--attn-impl", "xla", "--json", "--draft-kv-dtype", FP8]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tokens_per_step"] >= 1.0
    with pytest.raises(SystemExit):  # argparse names the allowed choice
        main(args[:-1] + ["float16"])
    assert "--draft-kv-dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_bench_records_it(tmp_path):
    from jspec.bench.run import command_line
    from jspec.cli import build_parser
    base = ["bench", "--model", "m", "--draft", "d", "--out", str(tmp_path)]
    args = build_parser().parse_args(base + ["--draft-kv-dtype", FP8])
    assert args.draft_kv_dtype == FP8 and f"--draft-kv-dtype {FP8}" in command_line(args)
    assert "--draft-kv-dtype" not in command_line(build_parser().parse_args(base))
