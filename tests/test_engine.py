"""The stock paged engine: exactness against the no-cache reference, page reuse, preemption,
no recompilation, batch independence, stops, the API and the CLI."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.config import PRESETS
from jspec.engine import Engine, EngineConfig, Request
from jspec.qwen3 import forward_logits, init_random
from jspec.simple_generate import greedy_generate
from jspec.steps import compile_count

CFG = PRESETS["tiny-untied"]


@pytest.fixture(scope="module")
def model():
    m = init_random(CFG, seed=1)
    # Larger weights than the init so that greedy outputs vary instead of repeating one token.
    nnx.update(m, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(m)))
    return m


def _engine(model, **kw):
    base = dict(max_lanes=3, page_size=8, max_context=128, prefill_chunk=16, decode_steps=5,
                attn_impl="xla")
    base.update(kw)
    return Engine(CFG, model, eos_ids=(), engine_cfg=EngineConfig(**base))


def _requests(specs, temperature=0.0, seed0=0):
    rng = np.random.default_rng(7)
    return [Request(rng.integers(0, CFG.vocab_size, n).tolist(), temperature=temperature,
                    max_tokens=m, seed=seed0 + i, request_id=i) for i, (n, m) in enumerate(specs)]


SPECS = [(5, 20), (20, 7), (33, 12), (9, 30), (3, 1), (17, 16)]


def test_greedy_matches_no_cache_reference_under_continuous_batching(model):
    eng = _engine(model)
    reqs = eng.generate(_requests(SPECS))
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_ids == greedy_generate(model, r.prompt_ids, r.max_tokens), r.request_id
    assert len({t for r in reqs for t in r.output_ids}) > 10
    assert eng.allocator.num_free == eng.allocator.num_pages - 1  # every page came back


def test_logprobs_are_the_models(model):
    eng = _engine(model)
    (r,) = eng.generate(_requests([(6, 9)], temperature=1.0))
    tokens = np.asarray([r.prompt_ids + r.output_ids])
    logits, _ = forward_logits(model, tokens)
    logp = jax.nn.log_softmax(np.asarray(logits[0]), axis=-1)
    ref = [float(logp[len(r.prompt_ids) - 1 + i, t]) for i, t in enumerate(r.output_ids)]
    np.testing.assert_allclose(r.logprobs, ref, atol=1e-4)


def test_reused_pages_give_fresh_engine_outputs(model):
    eng = _engine(model, max_lanes=1)
    first, second = _requests([(30, 25), (12, 20)], temperature=1.0)
    eng.generate([first])
    reused_pages_before = eng.allocator.num_free
    eng.generate([second])
    fresh = _engine(model, max_lanes=1).generate(_requests([(30, 25), (12, 20)], temperature=1.0)[1:])
    assert second.output_ids == fresh[0].output_ids
    assert reused_pages_before == eng.allocator.num_pages - 1


def test_preemption_when_the_pool_is_full_keeps_outputs(model):
    # 3 lanes but only 12 usable pages of 8 tokens: long requests cannot all run at once.
    specs = [(40, 40), (30, 45), (35, 30), (20, 50)]
    small = _engine(model, num_pages=13)
    got = small.generate(_requests(specs, temperature=0.8))
    assert small.stats["preemptions"] > 0
    ref = _engine(model).generate(_requests(specs, temperature=0.8))
    for a, b in zip(got, ref):
        assert a.output_ids == b.output_ids
    assert small.allocator.num_free == 12


def test_request_larger_than_pool_is_refused(model):
    eng = _engine(model, num_pages=4)
    with pytest.raises(ValueError, match="pages"):
        eng.generate(_requests([(30, 40)]))


def test_no_recompilation_after_warmup(model):
    """Lengths and parameters never recompile; the first batch that needs a filtering path
    compiles each program's variant for it once (sampling.SamplingArrays.filter_paths: the
    top-k candidate path, or all paths), and only once."""
    eng = _engine(model)

    def counts():
        return compile_count(eng.programs.prefill), compile_count(eng.programs.decode)

    eng.generate(_requests([(10, 6)]))
    plain = counts()
    eng.generate(_requests([(3, 2), (40, 11), (17, 30), (1, 5), (25, 9)], temperature=0.7))
    assert counts() == plain
    eng.generate([Request([1, 2, 3], temperature=1.0, top_k=5, top_p=0.9, max_tokens=8)])
    candidate = counts()
    assert all(c <= p + 1 for c, p in zip(candidate, plain))
    eng.generate(_requests([(5, 7)], temperature=0.9)
                 + [Request([4, 5], temperature=0.5, top_k=20, top_p=0.8, max_tokens=9)])
    assert counts() == candidate
    eng.generate(_requests([(5, 7), (30, 12)], temperature=0.9)
                 + [Request([4, 5], temperature=0.5, top_p=0.8, max_tokens=9)])
    everything = counts()
    assert all(e <= c + 1 for e, c in zip(everything, candidate))
    eng.generate([Request([6, 7], temperature=0.8, top_k=100, max_tokens=5)])
    eng.generate(_requests([(12, 3)], temperature=0.0))
    eng.generate([Request([1, 2, 3], temperature=1.0, top_k=5, top_p=0.9, max_tokens=8)])
    assert counts() == everything


def test_seeded_request_alone_or_batched_gives_same_tokens(model):
    target = Request([5, 6, 7, 8], temperature=1.0, top_k=40, top_p=0.9, seed=1234, max_tokens=24)
    alone = _engine(model).generate([target])[0].output_ids
    others = _requests([(9, 30), (20, 10), (4, 25)], temperature=1.0, seed0=99)
    mixed = _engine(model).generate(others[:2] + [Request([5, 6, 7, 8], temperature=1.0, top_k=40,
                                                          top_p=0.9, seed=1234, max_tokens=24)]
                                    + others[2:])
    assert mixed[2].output_ids == alone
    other_seed = _engine(model).generate([Request([5, 6, 7, 8], temperature=1.0, top_k=40,
                                                  top_p=0.9, seed=1235, max_tokens=24)])
    assert other_seed[0].output_ids != alone  # the seed matters


def test_eos_stops_a_request(model):
    (probe,) = _engine(model).generate(_requests([(8, 12)]))
    eos = probe.output_ids[5]
    first = probe.output_ids.index(eos)
    eng = Engine(CFG, model, eos_ids=(eos,), engine_cfg=EngineConfig(
        max_lanes=2, page_size=8, max_context=128, prefill_chunk=16, decode_steps=5, attn_impl="xla"))
    (r,) = eng.generate(_requests([(8, 12)]))
    assert r.finish_reason == "eos" and r.output_ids == probe.output_ids[:first + 1]
    (r2,) = eng.generate([Request(r.prompt_ids, temperature=0.0, max_tokens=12, stop_on_eos=False)])
    assert r2.output_ids == probe.output_ids and r2.finish_reason == "length"


@pytest.mark.parametrize("bad,message", [([], "empty prompt"), (list(range(200)), "maximum context"),
                                         ([CFG.vocab_size], "outside the vocabulary")])
def test_bad_prompts_are_refused(model, bad, message):
    with pytest.raises(ValueError, match=message):
        _engine(model).generate([Request(bad, max_tokens=4)])


# ---- API and CLI on a complete tiny model directory ---------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from hf_models import make_hf_qwen3, write_tiny_tokenizer
    d = tmp_path_factory.mktemp("tiny-llm")
    make_hf_qwen3(CFG, d, seed=5, std=0.3)
    write_tiny_tokenizer(d, CFG.vocab_size)
    return d


def test_api_generate_text_ids_logprobs_and_stop_strings(tiny_dir):
    from jspec.api import LLM, SamplingParams
    llm = LLM(tiny_dir, max_lanes=2, max_context=128, attn_impl="xla")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    a, b = llm.generate(["def add(a, b):", "The quick brown"], greedy)
    assert a.token_ids and len(a.logprobs) == len(a.token_ids) and a.finish_reason == "length"
    assert a.text == llm.tokenizer.decode(a.token_ids)
    # A stop string taken from the middle of the greedy text cuts it there.
    stop = a.text[len(a.text) // 2:len(a.text) // 2 + 2]
    assert stop and stop.strip()
    (c,) = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=24,
                                                           ignore_eos=True, stop=(stop,)))
    assert c.finish_reason == "stop" and c.text == a.text[:a.text.find(stop)]
    assert c.token_ids == a.token_ids[:len(c.token_ids)]
    streamed = []
    (d,) = llm.generate(["The quick brown"], greedy, on_text=lambda i, t: streamed.append(t))
    assert "".join(streamed) == d.text == b.text and len(streamed) > 1


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -1), ("max_tokens", 0)])
def test_sampling_params_are_validated(field, value):
    from jspec.api import SamplingParams
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_cli_generate_json(tiny_dir, capsys):
    from jspec.cli import main
    args = ["generate", "--model", str(tiny_dir), "--prompt", "def f(x):", "--prompt", "class A:",
            "--max-tokens", "6", "--seed", "3", "--temperature", "0.9", "--top-k", "50",
            "--attn-impl", "xla", "--max-context", "128", "--json"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == ["def f(x):", "class A:"]
    assert all(1 <= len(r["token_ids"]) <= 6 and "text" in r for r in records)
    assert main(args) == 0  # seeded: the same again
    assert [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()] == records


@pytest.mark.parametrize("extra,message", [
    (["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p"), (["--top-k", "-2"], "top_k"),
    (["--prompt", ""], "empty"), (["--prompt", "x " * 400], "maximum context"),
    (["--batch-invariant"], "NVIDIA GPU" if jax.default_backend() != "gpu" else "Triton attention")])
def test_cli_generate_bad_input_one_line_error(tiny_dir, capsys, extra, message):
    from jspec.cli import main
    args = ["generate", "--model", str(tiny_dir), "--max-context", "128", "--attn-impl", "xla"]
    if "--prompt" not in extra:
        args += ["--prompt", "hi"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_generate_not_a_model_dir(tmp_path, capsys):
    from jspec.cli import main
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_batch_invariant_engine_is_refused_without_a_gpu(model):
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU refusal")
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        _engine(model, batch_invariant=True)


@pytest.mark.parametrize("invariant_prefill", [False, True])
def test_batch_invariant_engine_prefills_on_the_chosen_route(model, monkeypatch, invariant_prefill):
    """With batch_invariant, decode runs the invariant kernels ("triton") and prefill XLA's GEMMs
    unless invariant_prefill; both share one set of parameters. (Built, not run: the Triton
    kernels need a GPU; tests/test_batch_invariance_gpu.py runs both routes.)"""
    import jspec.engine
    monkeypatch.setattr(jspec.engine, "check_impl", lambda impl: None)
    eng = _engine(model, batch_invariant=True, invariant_prefill=invariant_prefill, attn_impl="auto")
    progs = eng.programs
    decode_model = nnx.merge(progs.graphdef, eng.params)
    prefill_model = nnx.merge(progs.prefill_graphdef, eng.params)
    want = "triton" if invariant_prefill else "xla"
    assert decode_model.linear_impl == decode_model.norm.impl == "triton"
    assert prefill_model.linear_impl == prefill_model.norm.impl == want
    for layer in prefill_model.layers:
        assert layer.mlp.linear_impl == layer.self_attn.linear_impl == want
        assert layer.input_layernorm.impl == layer.self_attn.k_norm.impl == want
    assert prefill_model.embed_tokens[...] is decode_model.embed_tokens[...]
    with pytest.raises(ValueError, match="invariant_prefill needs batch_invariant"):
        EngineConfig(invariant_prefill=True)


def _carry_run(model, carry, check=False, tamper=False, **kw):
    """Sampled requests through 2 lanes and a small pool (preemptions, admissions mid-run),
    with the previous dispatch's device state carried or re-sent every time."""
    eng = _engine(model, max_lanes=2, num_pages=11, **kw)
    eng.carry_state, eng.check_carry = carry, check

    def on_update(req):
        if tamper and eng._carry is not None:  # every carry one position off
            key, state, pages = eng._carry
            eng._carry = (key, dataclasses.replace(state, lengths=state.lengths + 1), pages)

    reqs = eng.generate(_requests([(40, 30), (9, 25), (30, 40), (5, 3), (22, 18)], temperature=1.0),
                        on_update=on_update)
    return [r.output_ids for r in reqs], eng.stats


def test_carried_decode_state_equals_the_hosts(model):
    """Carrying the last dispatch's output state on the device instead of re-sending it gives the
    same state every dispatch (checked field by field) and the same tokens, through admissions,
    page growth and preemptions; a corrupted carry is caught by the check."""
    sent, sent_stats = _carry_run(model, carry=False)
    carried, stats = _carry_run(model, carry=True, check=True)
    assert carried == sent
    assert sent_stats["state_carries"] == 0
    assert stats["state_carries"] > 5 and stats["state_uploads"] > 2 and stats["preemptions"] > 0
    with pytest.raises(AssertionError, match="lengths"):
        _carry_run(model, carry=True, check=True, tamper=True)


def test_device_loop_stops_once_every_lane_has_ended():
    """loop_while_active runs steps until the last lane ends (or num_steps), and none at all when
    no lane is active; the fixed loop it replaces runs them all (the control)."""
    from types import SimpleNamespace

    from jspec.steps import loop_while_active

    ends_b = jnp.asarray([2, 4])  # lane b ends after step ends_b[b]

    def body(i, carry):
        count, active_b = carry
        return count + 1, active_b & (i < ends_b)

    def steps_run(active_b, early_exit):
        carry = (jnp.int32(0), jnp.asarray(active_b))
        if early_exit:
            return int(jax.jit(lambda c: loop_while_active(
                16, body, c, lambda c: SimpleNamespace(active=c[1])))(carry)[0])
        return int(jax.jit(lambda c: jax.lax.fori_loop(0, 16, body, c))(carry)[0])

    assert steps_run([True, True], early_exit=True) == 5
    assert steps_run([True, False], early_exit=True) == 3
    assert steps_run([False, False], early_exit=True) == 0
    assert steps_run([True, True], early_exit=False) == 16


def _lookahead_run(model, lookahead, device_loop, eos, specs=((7, 40), (12, 30), (20, 33)),
                   **kw):
    """Sampled replies through the engine, one of them ended by a host-side stop (as the API's
    stop strings do) and some by EOS inside a dispatch."""
    eng = Engine(CFG, model, eos_ids=eos if isinstance(eos, tuple) else (eos,),
                 engine_cfg=EngineConfig(**{
                     **dict(max_lanes=3, page_size=8, max_context=128, prefill_chunk=16,
                            decode_steps=5, attn_impl="xla"),
                     **kw, "lookahead": lookahead, "device_loop": device_loop}))
    eng.check_carry = True

    def on_update(req):  # a stop checker: request 1 stops after 11 tokens
        if req.request_id == 1 and len(req.output_ids) >= 11 and not req.finished:
            req.output_ids = req.output_ids[:11]
            req.logprobs = req.logprobs[:11]
            req.finish_reason = "stop"

    reqs = eng.generate(_requests(list(specs), temperature=1.0), on_update)
    return [(r.output_ids, r.logprobs, r.finish_reason) for r in reqs], eng


@pytest.mark.parametrize("lanes,num_pages", [(3, None), (1, None), (3, 12)])
def test_lookahead_and_device_loop_change_when_not_what(model, lanes, num_pages):
    """Launching the next dispatch before reading the last one (lookahead) and ending the step
    loop once every lane has ended (device_loop) change when the work runs, never what it
    computes: the same tokens, log-probs and finish reasons as the fixed loop with every dispatch
    read before the next. Through EOS inside a dispatch, a host-side stop, admissions (one
    lane: requests wait) and a pool too small to look ahead every time."""
    probe, _ = _lookahead_run(model, False, False, eos=-1, max_lanes=1)
    eos = probe[0][0][8]  # a token request 0 samples mid-reply: it ends there
    kw = dict(max_lanes=lanes, num_pages=num_pages)
    ref, ref_eng = _lookahead_run(model, False, False, eos, **kw)
    assert ref_eng.stats["lookahead_dispatches"] == 0
    assert {f for _, _, f in ref} == {"eos", "stop", "length"}
    for lookahead, device_loop in [(True, True), (True, False), (False, True)]:
        got, eng = _lookahead_run(model, lookahead, device_loop, eos, **kw)
        assert [(t, f) for t, _, f in got] == [(t, f) for t, _, f in ref], (lookahead, device_loop)
        for (_, lp, _), (_, lp_ref, _) in zip(got, ref):
            np.testing.assert_allclose(lp, lp_ref, atol=1e-6)
        assert (eng.stats["lookahead_dispatches"] > 0) == lookahead
        assert eng.allocator.num_free == eng.allocator.num_pages - 1  # every page came back


@pytest.mark.parametrize("lanes,num_pages", [(3, None), (2, 14)])
def test_lookahead_admission_changes_when_not_what(model, lanes, num_pages):
    """lookahead_admission (requests seated while a look-ahead dispatch runs, their first tokens
    merged into the carried state on the device) gives the same tokens, log-probs and finish
    reasons as the engine that reads every dispatch before the next: eight requests for two or
    three lanes, EOS inside a dispatch and as a first token, a host-side stop, a one-token
    request, and a pool too small to look ahead every time."""
    specs = [(7, 40), (12, 30), (20, 33), (5, 1), (9, 25), (14, 18), (3, 22), (11, 9)]
    probe, _ = _lookahead_run(model, False, False, eos=-1, specs=specs, max_lanes=1)
    # request 0 samples the first mid-reply (it ends there), request 5 the second first
    eos = (probe[0][0][8], probe[5][0][0])
    kw = dict(max_lanes=lanes, num_pages=num_pages, specs=specs)
    ref, _ = _lookahead_run(model, False, False, eos, **kw)
    assert {f for _, _, f in ref} == {"eos", "stop", "length"}
    assert len(ref[5][0]) == 1 and ref[5][2] == "eos"
    got, eng = _lookahead_run(model, True, True, eos, lookahead_admission=True, **kw)
    assert [(t, f) for t, _, f in got] == [(t, f) for t, _, f in ref]
    for (_, lp, _), (_, lp_ref, _) in zip(got, ref):
        np.testing.assert_allclose(lp, lp_ref, atol=1e-6)
    assert eng.stats["admissions_ahead"] > 0 and eng.stats["state_merges"] > 0
    assert eng.allocator.num_free == eng.allocator.num_pages - 1  # every page came back
    assert not eng._joining and not eng._joined


def test_lookahead_admission_needs_lookahead():
    with pytest.raises(ValueError, match="lookahead_admission needs lookahead"):
        EngineConfig(lookahead=False, lookahead_admission=True)


def test_prefill_buckets_sizes_outputs_and_no_recompilation(model, monkeypatch):
    """A prompt's last chunk is padded to the smallest prefill size that holds it (256: 64,
    128 or 256 rows): greedy outputs and log-probs are those of padding to the whole chunk,
    and once precompile_prefill has run, no prompt length compiles another prefill."""
    assert EngineConfig(prefill_chunk=256).prefill_sizes() == (64, 128, 256)
    assert EngineConfig(prefill_chunk=512).prefill_sizes() == (64, 128, 256, 512)
    assert EngineConfig(prefill_chunk=128).prefill_sizes() == (64, 128)
    assert EngineConfig(prefill_chunk=96).prefill_sizes() == (96,)  # 48 < 64
    assert EngineConfig(prefill_chunk=16).prefill_sizes() == (16,)
    assert EngineConfig(prefill_chunk=256, prefill_buckets=False).prefill_sizes() == (256,)
    specs = [(5, 6), (70, 5), (130, 4), (300, 3), (64, 5)]  # 300: a full chunk, then 44
    runs, padded = {}, {}
    for buckets in (False, True):
        eng = _engine(model, max_context=320, prefill_chunk=256, prefill_buckets=buckets)
        eng.precompile_prefill()
        compiled = compile_count(eng.programs.prefill)
        prefill = eng.programs.prefill
        padded[buckets] = []

        def spy(params, caches, tokens, *rest, _prefill=prefill, _seen=padded[buckets]):
            _seen.append(int(tokens.shape[0]))
            return _prefill(params, caches, tokens, *rest)

        monkeypatch.setattr(eng.programs, "prefill", spy)
        runs[buckets] = eng.generate(_requests(specs))
        monkeypatch.undo()
        assert compile_count(eng.programs.prefill) == compiled  # every size compiled up front
    assert padded[False] == [256, 256, 256, 256, 256, 256]
    assert padded[True] == [64, 128, 256, 256, 64, 64]  # 300 tokens: 256, then 44 in 64
    for a, b in zip(runs[False], runs[True]):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_admission_launches_a_rounds_prefills_before_reading_a_token(model, monkeypatch):
    """Three free lanes, six requests: the first round's three prefills are all launched before
    the host reads the first prefill's token (no sync per request), the tokens are emitted in
    admission order, and the outputs are the one-request-at-a-time engine's (a request that ends
    at its first token frees its lane for the next round)."""
    eng = _engine(model)
    events = []
    prefill, emit = eng.programs.prefill, eng._emit

    def logged_prefill(*a, **kw):
        events.append("prefill")
        return prefill(*a, **kw)

    def logged_emit(req, *a, **kw):
        events.append(("emit", req.request_id))
        return emit(req, *a, **kw)

    monkeypatch.setattr(eng.programs, "prefill", logged_prefill)
    monkeypatch.setattr(eng, "_emit", logged_emit)
    specs = [(5, 1), (20, 7), (9, 12), (33, 3), (3, 1), (17, 5)]  # 20 tokens: two chunks of 16
    reqs = eng.generate(_requests(specs))
    first_emit = next(i for i, e in enumerate(events) if e != "prefill")
    assert events[:first_emit] == ["prefill"] * sum(-(-n // 16) for n, _ in specs[:3])  # chunks
    assert events[first_emit:first_emit + 3] == [("emit", 0), ("emit", 1), ("emit", 2)]
    one_lane = _engine(model, max_lanes=1).generate(_requests(specs))
    assert [r.output_ids for r in reqs] == [r.output_ids for r in one_lane]
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1


@pytest.mark.parametrize("admission", [False, True])
def test_bench_warmup_compiles_the_state_merge_with_lookahead_admission(model, admission):
    """jspec bench's warm-up seats a request more than the lanes when lookahead_admission is on,
    so the state merge (its own program) compiles there and not inside the first timed pass."""
    from types import SimpleNamespace

    from jspec.bench import workloads as W
    from jspec.bench.run import Bench
    eng = Engine(CFG, model, eos_ids=(), engine_cfg=EngineConfig(
        max_lanes=2, page_size=8, max_context=128, prefill_chunk=16, decode_steps=5,
        attn_impl="xla", lookahead_admission=admission))
    spec = W.WorkloadSpec("team", lanes=2, num_prompts=6, max_new_tokens=40)
    prompts = [list(range(3, 9 + i)) for i in range(6)]
    Bench.warm(SimpleNamespace(sampling=W.SAMPLING["t1"]), eng, spec, prompts, "stock")
    assert (eng.stats["state_merges"] > 0) == admission
