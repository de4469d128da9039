"""EngineConfig.draft_weight_dtype = "int8": the drafter's big weights as int8 with a scale per
output channel (jspec/draft_weights.py).

Like draft_kv_dtype it may change what the drafter proposes, never what the engine emits; and a
drafter whose weights already lie on such a grid must propose exactly what it proposed before.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.draft_weights import (Int8Weight, dequantize, quantize_drafter_state, quantize_int8,
                                 quantized_count, widen)
from jspec.dspark import init_random_drafter
from jspec.engine import Engine, EngineConfig, Request
from jspec.qwen3 import fuse_projections, init_random

# The speculative engine tests' tiny float32 pair and engine config (and their CLI/API fixture).
from test_spec_engine import CFG, DCFG, ECFG, K, _scaled, tiny_pair_dirs  # noqa: F401 (fixture)

INT8 = "int8"


# ---- quantize / widen -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape, axes", [((6, 4, 32), (2,)), ((32, 3, 4), (1, 2)), ((50, 16), (1,))])
def test_quantize_int8_error_is_at_most_half_a_step(shape, axes):
    w = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 0.02
    w = w.at[1].set(0.0)  # an all-zero output channel
    q = quantize_int8(w, axes)
    assert q.values.dtype == jnp.int8 and q.values.shape == shape
    kept = [1 if i in axes else n for i, n in enumerate(shape)]
    assert list(q.scale.shape) == kept
    # Each output channel uses the whole range once, and the zero channel gets scale 1.
    assert int(jnp.max(jnp.abs(q.values.astype(jnp.int32)))) == 127
    assert float(q.scale.reshape(-1)[0 if axes != (2,) else 4]) > 0
    np.testing.assert_array_equal(np.asarray(q.values[1]), 0)
    err = jnp.abs(widen(q) - w)
    assert bool(jnp.all(err <= q.scale / 2 * (1 + 1e-6)))
    assert float(err.max()) > 0  # off the grid: not a copy


def test_weights_on_an_int8_grid_come_back_exactly():
    """Power-of-two scales per channel and a +-127 in each: the round trip is bit-exact."""
    rng = np.random.default_rng(1)
    values = rng.integers(-127, 128, (40, 24)).astype(np.float32)
    values[:, 3] = 127.0 * np.where(rng.random(40) < 0.5, 1, -1)
    scale = 2.0 ** rng.integers(-12, -4, (40, 1)).astype(np.float32)
    w = jnp.asarray(values * scale)
    q = quantize_int8(w, (1,))
    np.testing.assert_array_equal(np.asarray(widen(q)), np.asarray(w))
    assert q.nbytes == 40 * 24 + 4 * 40 and widen(q).dtype == w.dtype


def test_bf16_weights_widen_to_bf16():
    w = (jax.random.normal(jax.random.key(2), (16, 8)) * 0.1).astype(jnp.bfloat16)
    q = quantize_int8(w, (1,))
    assert q.dtype == "bfloat16" and widen(q).dtype == jnp.bfloat16


# ---- the drafter's state --------------------------------------------------------------------------

def _served(drafter):
    fuse_projections(drafter, qkv=False)  # the engine's layout for a drafter
    return drafter


def test_drafter_state_quantizes_exactly_the_big_weights():
    d = _served(init_random_drafter(DCFG, seed=3))
    _, state = nnx.split(d)
    assert quantize_drafter_state(state, None) is state
    q = quantize_drafter_state(state, INT8)
    names = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            q, is_leaf=lambda x: isinstance(x, Int8Weight))[0]:
        if isinstance(leaf, Int8Weight):
            names.add(next(k.key for k in reversed(path) if getattr(k, "key", None) not in
                           (None, "value", "raw_value") and isinstance(k.key, str)))
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj", "fc",
                     "markov_w2"}
    # Per layer: q, k, v, o, gate_up, down; plus fc and markov_w2. Norms and the small heads stay.
    assert quantized_count(q) == 6 * DCFG.layers.num_layers + 2
    # Each quantized float32 weight now takes a byte a value plus 4 bytes a channel's scale.
    is_q = lambda x: isinstance(x, Int8Weight)  # noqa: E731
    ints = [x for x in jax.tree.leaves(q, is_leaf=is_q) if is_q(x)]
    saved = sum(3 * x.values.size - 4 * x.scale.size for x in ints)
    assert saved > 0
    assert (sum(x.nbytes for x in jax.tree.leaves(q, is_leaf=is_q))
            == sum(x.nbytes for x in jax.tree.leaves(state)) - saved)


@pytest.mark.parametrize("bad", ["int4", "float8_e4m3fn", "bfloat16", "INT8"])
def test_invalid_draft_weight_dtype_is_refused(bad):
    with pytest.raises(ValueError, match=f"draft_weight_dtype must be one of .*int8.*{bad}"):
        EngineConfig(draft_weight_dtype=bad)
    with pytest.raises(ValueError, match="draft_weight_dtype must be one of"):
        quantize_drafter_state({}, bad)


# ---- the engine -----------------------------------------------------------------------------------

def _requests(specs, temperature=0.0):
    rng = np.random.default_rng(7)
    return [Request(rng.integers(0, CFG.vocab_size, n).tolist(), temperature=temperature,
                    max_tokens=m, seed=i, request_id=i) for i, (n, m) in enumerate(specs)]


SPECS = [(5, 20), (20, 7), (33, 12), (9, 30), (14, 25)]


def _on_grid(drafter):
    """Every quantized weight snapped to int8 x a power-of-two channel scale with a 127 in each
    channel: quantize then widen must give these very numbers back."""
    _, state = nnx.split(drafter)

    def snap(x):
        if not isinstance(x, Int8Weight):
            return x
        pow2 = 2.0 ** jnp.ceil(jnp.log2(x.scale))
        v = jnp.clip(jnp.round(widen(x) / pow2), -127, 127)
        # One +127 per output channel, so that the channel's scale comes back as pow2 exactly.
        first = tuple(0 if n == 1 else slice(None) for n in x.scale.shape)
        return v.at[first].set(127.0) * pow2

    snapped = jax.tree.map(snap, quantize_drafter_state(state, INT8),
                           is_leaf=lambda x: isinstance(x, Int8Weight))
    nnx.update(drafter, snapped)
    return drafter


@pytest.fixture(scope="module")
def target():
    return _scaled(init_random(CFG, seed=1), 5)


def test_int8_drafter_greedy_is_token_identical_to_stock(target):
    drafter = _served(_scaled(init_random_drafter(DCFG, seed=3), 5))
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS))
    eng = Engine(CFG, target, (), dataclasses.replace(ECFG, draft_weight_dtype=INT8),
                 drafter=drafter, draft_cfg=DCFG)
    # The engine's drafter also holds the stacked context K/V weight (fuse_context_kv).
    assert quantized_count(eng.params[1]) == 6 * DCFG.layers.num_layers + 3
    spec = eng.generate(_requests(SPECS))
    for a, b in zip(stock, spec):
        assert a.output_ids == b.output_ids
        assert b.step_tokens and 1 <= b.tokens_per_step <= K + 1
    assert eng.allocator.num_free == eng.allocator.num_pages - 1


def _draft_outputs(target, drafter, dtype=None):
    """dense_draft's (logits + Markov bias, hidden, confidence) for a few blocks; `dtype` "int8"
    runs the same drafter with its weights as Int8Weight inside its modules (the engine's way)."""
    from jspec.dspark import dense_draft
    g, state = nnx.split(drafter)
    d = nnx.merge(g, quantize_drafter_state(state, dtype))
    rng = np.random.default_rng(3)
    ctx = rng.integers(0, CFG.vocab_size, (2, 9))
    prev = rng.integers(0, CFG.vocab_size, (2, DCFG.block_size))
    return dense_draft(target, d, ctx, ctx[:, -1], prev)


def test_int8_drafter_computes_exactly_on_the_grid(target):
    """fc, the layers' projections and Markov W2 all read Int8Weight (scaled after the GEMM):
    on power-of-two grids that is bit-exact, so any missing or misplaced scale shows."""
    drafter = _on_grid(_served(_scaled(init_random_drafter(DCFG, seed=4), 5)))
    for a, b in zip(_draft_outputs(target, drafter), _draft_outputs(target, drafter, INT8)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_int8_drafter_off_the_grid_is_close_not_equal(target):
    drafter = _served(_scaled(init_random_drafter(DCFG, seed=5), 5))
    (la, ha, _), (lb, hb, _) = _draft_outputs(target, drafter), _draft_outputs(target, drafter, INT8)
    assert float(jnp.abs(la - lb).max()) > 0
    # Half an int8 step per weight: the drafter's logits move by a few % of their spread.
    assert float(jnp.abs(la - lb).max()) < 0.1 * float(jnp.std(la))
    np.testing.assert_allclose(np.asarray(ha), np.asarray(hb), atol=0.1)


def test_on_grid_drafter_proposes_exactly_as_before(target):
    """Sampled at T = 1 with the same seeds, an int8 engine over on-grid weights and a float
    engine over the same weights make the same replies in the same verify steps: the widening
    inside the programs reproduces the weights (a wrong scale axis or a missing scale would
    change the proposals, hence the step counts)."""
    drafter = _on_grid(_served(_scaled(init_random_drafter(DCFG, seed=4), 5)))
    plain = Engine(CFG, target, (), ECFG, drafter=drafter, draft_cfg=DCFG)
    int8 = Engine(CFG, target, (), dataclasses.replace(ECFG, draft_weight_dtype=INT8),
                  drafter=drafter, draft_cfg=DCFG)
    # The int8 engine really holds int8 values, and they widen back to the float engine's.
    _, state = nnx.split(drafter)
    for a, b in zip(jax.tree.leaves(dequantize(int8.params[1])), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    a = plain.generate(_requests(SPECS, temperature=1.0))
    b = int8.generate(_requests(SPECS, temperature=1.0))
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids and x.step_tokens == y.step_tokens


def _target_head_on_grid(target):
    """The target's lm_head snapped to int8 x a power-of-two row scale with a 127 in each row,
    so that the drafter's int8 copy of it is exact (the target is then that model)."""
    w = target.lm_head[...]
    pow2 = 2.0 ** jnp.ceil(jnp.log2(jnp.max(jnp.abs(w), 1, keepdims=True) / 127))
    v = jnp.clip(jnp.round(w / pow2), -127, 127).at[:, 0].set(127.0)
    target.lm_head[...] = (v * pow2).astype(w.dtype)
    return target


def _drafts(eng, state):
    target, drafter = eng.programs.models(eng.params)
    _, tokens, q, conf = eng.programs.draft(target, drafter, eng.caches[1], state,
                                            eng.programs.draft_vocab(eng.params),
                                            eng.programs.draft_head(eng.params))
    return np.asarray(tokens), np.asarray(q), np.asarray(conf)


@pytest.mark.parametrize("vocab", [None, 40])
def test_the_draft_step_reads_int8_and_is_exact_on_the_grid(vocab):
    """One draft step of an int8 engine against a float engine over the same on-grid weights
    (the drafter's and the target's lm_head): the same tokens and bit-equal q. The int8 engine
    holds an int8 copy of the head (no vocabulary) or int8 vocabulary rows, and the target keeps
    its float lm_head for verify."""
    target = _target_head_on_grid(_scaled(init_random(CFG, seed=1), 5))
    drafter = _on_grid(_served(_scaled(init_random_drafter(DCFG, seed=4), 5)))
    ranked = np.random.default_rng(0).permutation(CFG.vocab_size).tolist()
    ecfg = dataclasses.replace(ECFG, draft_vocab=vocab)
    plain = Engine(CFG, target, (), ecfg, drafter=drafter, draft_cfg=DCFG, draft_vocab_ids=ranked)
    int8 = Engine(CFG, target, (), dataclasses.replace(ecfg, draft_weight_dtype=INT8),
                  drafter=drafter, draft_cfg=DCFG, draft_vocab_ids=ranked)
    if vocab is None:
        head = int8.programs.draft_head(int8.params)
        assert isinstance(head, Int8Weight) and head.shape == (CFG.vocab_size, CFG.hidden_size)
    else:
        dv = int8.programs.draft_vocab(int8.params)
        assert int8.programs.draft_head(int8.params) is None
        assert isinstance(dv.head, Int8Weight) and isinstance(dv.markov_w2, Int8Weight)
        assert dv.head.shape[0] >= vocab
    assert not any(isinstance(x, Int8Weight) for x in jax.tree.leaves(
        int8.params[0], is_leaf=lambda x: isinstance(x, Int8Weight)))  # verify's head stays
    reqs = _requests([(6, 12), (9, 10)], temperature=1.0)
    plain.generate(reqs)
    state = plain._carry[1]
    int8.caches = plain.caches  # the same drafter context in both
    for a, b in zip(_drafts(plain, state), _drafts(int8, state)):
        np.testing.assert_array_equal(a, b)
    # The control: the same drafter over a target whose lm_head is off the grid. Only the int8
    # head can differ now, so q moves (the int8 head is what the draft reads), a little.
    off = _scaled(init_random(CFG, seed=1), 5)
    plain = Engine(CFG, off, (), ecfg, drafter=drafter, draft_cfg=DCFG, draft_vocab_ids=ranked)
    int8 = Engine(CFG, off, (), dataclasses.replace(ecfg, draft_weight_dtype=INT8),
                  drafter=drafter, draft_cfg=DCFG, draft_vocab_ids=ranked)
    plain.generate(_requests([(6, 12), (9, 10)], temperature=1.0))
    state = plain._carry[1]
    int8.caches = plain.caches
    qa, qb = _drafts(plain, state)[1], _drafts(int8, state)[1]
    finite = np.isfinite(qa)
    assert np.array_equal(finite, np.isfinite(qb))
    gap = np.abs(qa[finite] - qb[finite])
    assert 0 < gap.max() < 0.5


def test_off_grid_drafter_changes_proposals_not_the_output(target):
    """The negative control of the test above: off the grid, int8 perturbs the drafter (its
    widened weights differ from the float ones), yet greedy output stays the target's."""
    drafter = _served(_scaled(init_random_drafter(DCFG, seed=5), 5))
    eng = Engine(CFG, target, (), dataclasses.replace(ECFG, draft_weight_dtype=INT8),
                 drafter=drafter, draft_cfg=DCFG)
    _, state = nnx.split(drafter)
    diffs = [float(jnp.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(dequantize(eng.params[1])), jax.tree.leaves(state))]
    assert max(diffs) > 0
    stock = Engine(CFG, target, (), ECFG).generate(_requests(SPECS[:3]))
    assert [r.output_ids for r in eng.generate(_requests(SPECS[:3]))] == \
        [r.output_ids for r in stock]


def test_stock_engine_ignores_it(target):
    eng = Engine(CFG, target, (), dataclasses.replace(ECFG, draft_weight_dtype=INT8))
    assert quantized_count(eng.params) == 0


# ---- API, CLI and bench ---------------------------------------------------------------------------

def test_api_and_cli_thread_it(tiny_pair_dirs, capsys):
    from jspec.api import LLM
    from jspec.cli import main
    target_dir, draft_dir = tiny_pair_dirs
    kw = dict(max_lanes=2, max_context=128, attn_impl="xla")
    llm = LLM(target_dir, draft=draft_dir, draft_weight_dtype=INT8, **kw)
    assert llm.engine.ecfg.draft_weight_dtype == INT8 and quantized_count(llm.engine.params[1]) > 0
    with pytest.raises(ValueError, match="draft_weight_dtype needs a draft model"):
        LLM(target_dir, draft_weight_dtype=INT8, **kw)

    args = ["generate", "--model", str(target_dir), "--draft", str(draft_dir), "--prompt",
            "def f(x):", "--max-tokens", "8", "--temperature", "0", "--max-context", "128",
            "--attn-impl", "xla", "--json", "--draft-weight-dtype", INT8]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tokens_per_step"] >= 1.0
    with pytest.raises(SystemExit):
        main(args[:-1] + ["int4"])
    assert "--draft-weight-dtype: invalid choice: 'int4'" in capsys.readouterr().err


def test_bench_records_it(tmp_path):
    from jspec.bench.run import command_line
    from jspec.cli import build_parser
    base = ["bench", "--model", "m", "--draft", "d", "--out", str(tmp_path)]
    args = build_parser().parse_args(base + ["--draft-weight-dtype", INT8])
    assert args.draft_weight_dtype == INT8 and "--draft-weight-dtype int8" in command_line(args)
    assert "--draft-weight-dtype" not in command_line(build_parser().parse_args(base))
    args = build_parser().parse_args(base + ["--draft-weight-dtype", "solo=int8,team=int8"])
    assert "--draft-weight-dtype solo=int8,team=int8" in command_line(args)


def test_bench_takes_it_per_workload():
    from jspec.bench.run import parse_per_workload_choice as parse
    flag, choices = "--draft-weight-dtype", (INT8,)
    assert parse(None, flag, choices) == {"solo": None, "team": None, "busy": None}
    assert parse("int8", flag, choices) == {"solo": INT8, "team": INT8, "busy": INT8}
    assert parse("solo=int8, team=int8", flag, choices) == {"solo": INT8, "team": INT8, "busy": None}
    assert parse("solo=int8,busy=none", flag, choices)["busy"] is None
    for bad, msg in [("int4", "must be one of int8, none"), ("idle=int8", "WORKLOAD one of"),
                     ("solo=int4", "must be one of"), (",", "empty")]:
        with pytest.raises(ValueError, match=msg):
            parse(bad, flag, choices)


def test_bench_refuses_a_bad_value_before_loading(tmp_path, capsys):
    from jspec.cli import main
    code = main(["bench", "--model", str(tmp_path / "nowhere"), "--draft", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o"), "--draft-weight-dtype", "busy=int4"])
    assert code == 2
    assert "--draft-weight-dtype: 'busy=int4': the value must be one of int8, none" in \
        capsys.readouterr().err
    assert not (tmp_path / "o").exists()
