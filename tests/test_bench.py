"""`jspec bench`: the gate statistics on hand-made numbers (including checks that must fail), and
the whole pipeline end to end with --quick on a tiny target + drafter."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jspec.bench import gate as G
from jspec.bench import workloads as W


# ---- interval checks and the underpowered rule -------------------------------------------------

def test_interval_check_pass_biased_and_underpowered():
    ok = G.interval_check(0.01, 0.01, (-0.05, 0.05), 0.05)
    assert ok["ok"] and ok["intersects"] and not ok["underpowered"]
    assert ok["low"] == pytest.approx(0.01 - G.Z95 * 0.01)
    # A biased candidate: the whole interval lies outside the band.
    biased = G.interval_check(0.2, 0.01, (-0.05, 0.05), 0.05)
    assert not biased["intersects"] and not biased["underpowered"] and not biased["ok"]
    # Intersecting but too wide: half-width 1.96 * 0.06 = 0.118 > 2 * 0.05.
    wide = G.interval_check(0.0, 0.06, (-0.05, 0.05), 0.05)
    assert wide["intersects"] and wide["underpowered"] and not wide["ok"]
    # Exactly at the power limit passes; just over it does not.
    assert not G.interval_check(0.0, 0.0999 / G.Z95, (-0.05, 0.05), 0.05)["underpowered"]
    assert G.interval_check(0.0, 0.1001 / G.Z95, (-0.05, 0.05), 0.05)["underpowered"]
    # The interval only has to reach the band.
    assert G.interval_check(0.0699, 0.02 / G.Z95, (-0.05, 0.05), 0.05)["ok"]
    assert not G.interval_check(0.0701, 0.02 / G.Z95, (-0.05, 0.05), 0.05)["ok"]
    # A check that cannot be evaluated fails.
    for est, se in ((None, 0.1), (0.0, math.nan), (0.0, math.inf)):
        assert not G.interval_check(est, se, (-1, 1), 1)["ok"]


def test_ratio_of_means_delta_method_by_hand():
    # R = mean([2, 4]) / mean([1, 3]) = 3 / 2.
    # Unpaired: se^2 = var_c / (n m_s^2) + R^2 var_s / (n m_s^2) = 2/8 + 2.25 * 2/8 = 0.8125.
    r = G.ratio_of_means([2, 4], [1, 3], paired=False)
    assert r["ratio"] == pytest.approx(1.5) and r["se"] == pytest.approx(math.sqrt(0.8125))
    # Paired: D = ([2, 4] - 1.5 [1, 3]) / 2 = [0.25, -0.25]; var 0.125; se^2 = 0.125 / 2.
    r = G.ratio_of_means([2, 4], [1, 3], paired=True)
    assert r["se"] == pytest.approx(math.sqrt(0.0625))


def test_pooled_ratio_difference_by_hand():
    # Candidate: y = [2, 4], x = [1, 3] -> R_c = 6/4 = 1.5, IF = (y - 1.5 x) / 2 = [0.25, -0.25].
    # Stock: y = [1, 1], x = [1, 1] -> R_s = 1, IF = [0, 0].
    d = G.ratio_difference([2, 4], [1, 3], [1, 1], [1, 1], paired=False)
    assert d["gap"] == pytest.approx(0.5)
    assert d["se"] == pytest.approx(math.sqrt(0.125 / 2))
    d = G.ratio_difference([2, 4], [1, 3], [1, 1], [1, 1], paired=True)
    assert d["se"] == pytest.approx(math.sqrt(0.125 / 2)) and d["paired"]


def _replies(rng, n, per_token_mean, share, engine, mean_len=200):
    out = []
    for i in range(n):
        length = int(rng.integers(mean_len // 2, 3 * mean_len // 2))
        logp = rng.normal(per_token_mean, 1.0, length)  # token log-likelihoods
        out.append({"workload": "team", "pass": i // 100, "prompt": i % 100, "engine": engine,
                    "n": length, "logp": float(logp.sum()),
                    "hits": int(rng.binomial(length, share))})
    return out


def test_likelihood_and_argmax_gates_pass_when_equal_and_fail_when_biased():
    rng = np.random.default_rng(0)
    stock = _replies(rng, 300, -1.0, 0.6, "stock")
    same = _replies(rng, 300, -1.0, 0.6, "spec")
    lk, am = G.likelihood_check(same, stock), G.argmax_check(same, stock)
    assert lk["ok"] and am["ok"] and lk["paired"] and not lk["too_few_replies"]
    assert lk["low"] <= 0.05 and lk["high"] >= -0.05
    # A candidate whose replies are 0.2 nats/token less likely (e.g. a lossy sampler): must fail,
    # and not for lack of power.
    biased = _replies(rng, 300, -1.2, 0.6, "spec")
    lk = G.likelihood_check(biased, stock)
    assert not lk["ok"] and not lk["underpowered"] and lk["high"] < -0.05
    # A candidate that picks the argmax far more often (a greedy-leaning sampler): must fail.
    greedyish = _replies(rng, 300, -1.0, 0.7, "spec")
    am = G.argmax_check(greedyish, stock)
    assert not am["ok"] and not am["underpowered"] and am["low"] > 0.01
    # Too few replies: fails even though the estimate is perfect.
    small = G.likelihood_check(same[:50], stock[:50])
    assert small["too_few_replies"] and not small["ok"]


def test_lengths_gate():
    rng = np.random.default_rng(1)
    stock = _replies(rng, 300, -1.0, 0.6, "stock")
    same = _replies(rng, 300, -1.0, 0.6, "spec")
    assert G.replies_lengths_check(same, stock, min_replies=200)["ok"]
    longer = _replies(rng, 300, -1.0, 0.6, "spec", mean_len=260)  # 30 % longer replies
    chk = G.replies_lengths_check(longer, stock, min_replies=200)
    assert not chk["ok"] and chk["low"] > 1.05 and not chk["underpowered"]
    noisy = G.lengths_check([1, 300, 2, 250], [150, 140, 160, 151], paired=True)
    assert noisy["underpowered"] and not noisy["ok"]


def test_interval_coverage_under_the_null():
    """Both engines sample the same law: the 95 % interval of the likelihood gap must cover 0 in
    about 95 % of repeated experiments (fixed seed)."""
    rng = np.random.default_rng(2)
    covered = 0
    trials = 300
    for _ in range(trials):
        c, s = (_replies(rng, 60, -1.0, 0.5, e, mean_len=40) for e in ("spec", "stock"))
        d = G.likelihood_check(c, s, min_replies=0)
        covered += d["low"] <= 0 <= d["high"]
    assert 0.91 <= covered / trials <= 0.99, covered / trials


def test_greedy_agreement_fidelity_memory_specscore():
    assert G.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert G.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert G.agreement([1, 2], [1, 2, 3]) == pytest.approx(2 / 3)  # runs on: counts against
    g = G.greedy_check([[1, 2, 3, 4]] * 3, [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5]])
    assert g["mean"] == pytest.approx((1 + 1 + 0.75) / 3) and not g["ok"] and g["identical"] == 2
    assert G.fidelity_check([0.001, -0.001, 0.0015])["ok"]
    f = G.fidelity_check([0.003, -0.002, 0.004])
    assert not f["ok"] and f["max"] == pytest.approx(0.004)
    m = G.memory_check(10 * 2 ** 30, 10 * 2 ** 30 + 4000 * 2 ** 20)
    assert m["ok"] and m["allowed_mib"] == pytest.approx(10 * 1024 + 4096)
    assert not G.memory_check(2 ** 30, 2 ** 30 + 5000 * 2 ** 20)["ok"]
    assert G.memory_check(None, None)["ok"] is None
    ratios = {"solo": 1.5, "team": 2.0, "busy": 3.0}
    passing = {"a": {"ok": True}, "b": {"ok": True}}
    score, reason = G.specscore(ratios, passing)
    assert score == pytest.approx(9 ** (1 / 3)) and reason is None
    score, reason = G.specscore(ratios, {**passing, "likelihood": {"ok": False, "why": "biased"}})
    assert score is None and "likelihood: biased" in reason
    score, reason = G.specscore({**ratios, "busy": None}, passing)
    assert score is None and "busy" in reason


# ---- workloads ------------------------------------------------------------------------------------

class _CharTokenizer:
    eos_ids = (0,)

    def encode(self, text):
        return [ord(c) % 250 + 1 for c in text]

    def apply_chat_template(self, messages):
        return "<u>" + messages[0]["content"] + "</u>"


def test_busy_prompts_pool_sizing_and_seeds():
    texts = [f"text number {i} " * (3 + i % 5) for i in range(40)]
    tok = _CharTokenizer()
    prompts = W.concatenated_prompts(tok, texts, 8, 300)
    assert len(prompts) == 8 and all(len(p) >= 300 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8
    fixed = W.fixed_texts(tok, texts, 3, 64)
    assert all(len(c) == 64 for _, c in fixed)
    lens = [3000] * 32
    pages = W.busy_num_pages(lens, 32, 256, 16, 16)
    steady = 32 * ((3000 + 128 + 16) / 16 + 0.5)  # pages the lanes hold at the mean context
    assert 0.96 <= steady / (pages - 1) <= 0.98
    assert W.request_seed("team", 0, "stock", 3) != W.request_seed("team", 0, "spec", 3)
    assert W.request_seed("team", 0, "stock", 3) == W.request_seed("team", 0, "stock", 3)
    assert W.request_seed("team", 0, "stock", 3) != W.request_seed("team", 1, "stock", 3)


# ---- the pipeline, end to end ------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_pair(tmp_path_factory):
    from hf_models import make_hf_qwen3, save_drafter_checkpoint, write_tiny_tokenizer
    from jspec.config import PRESETS
    from jspec.dspark import DSparkConfig, init_random_drafter
    from jspec.loading import load_model
    cfg = PRESETS["tiny-untied"]
    dcfg = DSparkConfig(layers=cfg.replace(num_layers=2), block_size=7,
                        mask_token_id=cfg.vocab_size - 1, target_layer_ids=(0, 2, 4),
                        markov_rank=cfg.hidden_size)
    d = tmp_path_factory.mktemp("bench-target")
    make_hf_qwen3(cfg, d, seed=5, std=0.3)
    write_tiny_tokenizer(d, cfg.vocab_size)
    _, target = load_model(d)
    drafter = init_random_drafter(dcfg, seed=8)
    nnx.update(drafter, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(drafter)))
    dd = tmp_path_factory.mktemp("bench-draft")
    save_drafter_checkpoint(drafter, dcfg, dd, target=target)
    return d, dd


def test_bench_quick_end_to_end(bench_pair, tmp_path, capsys):
    import argparse

    from jspec.bench.report import REQUIRED_KEYS
    from jspec.bench.run import add_bench_parser
    target_dir, draft_dir = bench_pair
    parser = argparse.ArgumentParser(prog="jspec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "bench"
    args = parser.parse_args(["bench", "--model", str(target_dir), "--draft", str(draft_dir),
                              "--out", str(out), "--quick", "--no-progress"])
    assert args.func(args) == 0
    rec = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").stat().st_size > 0 and (out / "bench.png").stat().st_size > 1000
    for key in REQUIRED_KEYS:
        assert key in rec, key
    for w in ("solo", "team", "busy"):
        assert len(rec["ratios"][w]["passes"]) == 3 and rec["ratios"][w]["ratio"] > 0
        assert rec["acceptance"][w] >= 1.0
        assert rec["efficiency"][w] == pytest.approx(rec["ratios"][w]["ratio"] / rec["acceptance"][w])
        assert rec["tokens_per_s"][w]["stock"] > 0 and rec["tokens_per_s"][w]["spec"] > 0
        assert {"ratio", "low", "high"} <= set(rec["lengths"][w])
        assert not rec["workloads"][w]["recompiled"]
        details = rec["workloads"][w]
        for e in ("stock", "spec"):  # the engine's wall time by phase, per pass
            for t, wall in zip(details["engine_time"][e], details["wall_s"][e]):
                assert t["decode_dispatches"] >= 1 and min(t["prepare_s"], t["call_s"], t["emit_s"]) > 0
                assert t["prefill_s"] + t["prepare_s"] + t["call_s"] + t["wait_s"] + t["emit_s"] <= wall
    for key in ("gap", "se", "candidate", "stock"):
        assert rec["likelihood"][key] is not None
    assert {"gap", "se"} <= set(rec["argmax"])
    # Fidelity: verify vs decode on fp32 weights agree to far below the limit.
    assert rec["fidelity"]["mean"] <= 0.002 and rec["fidelity"]["max"] is not None
    assert rec["greedy_agreement"] == pytest.approx(1.0)
    assert set(rec["memory"]) >= {"peak_mib_stock", "peak_mib_spec", "allowed_mib", "ok"}
    assert rec["memory"]["ok"] is None  # CPU: no device statistics
    assert rec["roofline"]["solo_stock_fraction"] > 0 and rec["roofline"]["device"] == "cpu"
    assert set(rec["env"]) >= {"gpu", "jax", "jaxlib", "commit", "command", "date"}
    assert "--quick" in rec["env"]["command"]
    # Quick is honest: too few replies, so the gates fail and there is no SpecScore.
    assert rec["specscore"] is None and "too few replies" in rec["reason"]
    assert rec["likelihood"]["too_few_replies"] and not rec["gates"]["likelihood"]["ok"]
    assert rec["peer"]["status"] == "skipped"
    assert "SpecScore: null" in capsys.readouterr().out
    # The run's key names the invariant kernel's MMA family only when that kernel runs.
    assert json.loads((out / "parts" / "solo.json").read_text())["key"]["linear_mma"] is None

    # The same run split over two --out directories (as on two GPUs) merges into one record.
    import shutil
    halves = {"a": ("solo", "peer"), "b": ("team", "busy")}
    for name, parts in halves.items():
        (tmp_path / name / "parts").mkdir(parents=True)
        for part in parts:
            shutil.copy(out / "parts" / f"{part}.json", tmp_path / name / "parts")
    other = json.loads((out / "parts" / "busy.json").read_text())
    other["key"] = {**other["key"], "sampling": "greedy"}  # another run's part: must stay out
    (tmp_path / "c" / "parts").mkdir(parents=True)
    (tmp_path / "c" / "parts" / "busy.json").write_text(json.dumps(other))
    merged = tmp_path / "merged"
    args = parser.parse_args(["bench", "--model", str(target_dir), "--draft", str(draft_dir),
                              "--out", str(merged), "--quick", "--no-progress", "--workloads", "none",
                              "--merge-parts", str(tmp_path / "a"), "--merge-parts", str(tmp_path / "b"),
                              "--merge-parts", str(tmp_path / "c")])
    assert args.func(args) == 0
    assert "belongs to another run" in capsys.readouterr().err
    again = json.loads((merged / "bench.json").read_text())
    for key in ("ratios", "acceptance", "efficiency", "tokens_per_s", "likelihood", "argmax",
                "fidelity", "lengths", "greedy_agreement", "gates", "specscore", "reason"):
        assert again[key] == rec[key], key
    with pytest.raises(ValueError, match="none, with --merge-parts"):
        args = parser.parse_args(["bench", "--model", str(target_dir), "--draft", str(draft_dir),
                                  "--out", str(merged), "--quick", "--workloads", "none"])
        args.func(args)


def test_bench_quick_qwen_sampling_compiles_its_variant_in_warmup(bench_pair, tmp_path):
    """Qwen3's defaults (top-k 20, top-p 0.8) take the sampler's candidate-path variant in both
    engines: it compiles during warm-up, never inside the timed passes."""
    import argparse

    from jspec.bench.run import add_bench_parser
    target_dir, draft_dir = bench_pair
    parser = argparse.ArgumentParser(prog="jspec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "bench"
    args = parser.parse_args(["bench", "--model", str(target_dir), "--draft", str(draft_dir),
                              "--out", str(out), "--quick", "--no-progress", "--workloads", "solo",
                              "--sampling", "qwen", "--peer", "off",
                              "--num-draft-tokens", "solo=3, busy=5",
                              "--verify-threshold", "solo=0.2",
                              "--draft-weight-dtype", "solo=int8", "--draft-linear", "solo=xla",
                              "--lookahead-admission"])
    assert args.func(args) == 0
    rec = json.loads((out / "bench.json").read_text())
    sampling = rec["config"]["sampling"]
    assert sampling["name"] == "qwen" and sampling["top_k"] > 0 and sampling["top_p"] < 1
    assert not rec["workloads"]["solo"]["recompiled"]
    assert rec["acceptance"]["solo"] >= 1.0 and rec["fidelity"]["mean"] <= 0.002
    # The per-workload verify width reached solo's speculative engine, and its verify path.
    solo = rec["workloads"]["solo"]
    assert solo["engine"]["num_draft_tokens"] == 3 and len(solo["acceptance_per_position"]) == 3
    assert rec["fidelity"]["path"]["candidate"] == "verify, blocks of 4"
    assert 1.0 <= rec["acceptance"]["solo"] <= 4.0
    key = json.loads((out / "parts" / "solo.json").read_text())["key"]
    assert key["num_draft_tokens"] == "solo=3,busy=5"
    # Solo's drafter ran with int8 weights (jspec/draft_weights.py), named in the record.
    assert key["draft_weight_dtype"] == "solo=int8" and solo["engine"]["draft_weight_dtype"] == "int8"
    assert key["draft_linear"] == "solo=xla" and solo["engine"]["draft_linear"] == "xla"
    # DSpark's prefix rule on solo: the record says how many drafts a verify step verified.
    assert key["verify_threshold"] == "solo=0.2" and solo["verify_threshold"] == 0.2
    assert key["verify_rule"] == "block" == solo["verify_rule"]  # the default
    assert "--verify-rule block" in solo["command"]
    assert key["lookahead_admission"] and "--lookahead-admission" in solo["command"]
    assert 0.0 <= solo["drafts_per_step"] <= 3.0
    assert "drafts / step" in (out / "bench.md").read_text()


def test_num_draft_tokens_per_workload():
    """--num-draft-tokens: K everywhere, or WORKLOAD=K (the rest verify the whole block);
    --verify-threshold likewise with T in [0, 1); anything else is refused with the item named."""
    from jspec.bench.run import canonical_per_workload, parse_num_draft
    assert parse_num_draft(None, 7) == {"solo": 7, "team": 7, "busy": 7}
    assert parse_num_draft("4", 7) == {"solo": 4, "team": 4, "busy": 4}
    assert parse_num_draft(5, 7) == {"solo": 5, "team": 5, "busy": 5}
    assert parse_num_draft("team=3, busy=2", 7) == {"solo": 7, "team": 3, "busy": 2}
    assert canonical_per_workload("team=3, busy=2") == "team=3,busy=2"
    assert canonical_per_workload(None) is None
    for bad, why in (("8", "1..7"), ("busy=0", "1..7"), ("crowd=3", "'crowd=3'"),
                     ("team=x", "integer"), ("", "empty"), ("3,4", "'3'")):
        with pytest.raises(ValueError, match=why):
            parse_num_draft(bad, 7)
    from jspec.bench.run import parse_per_workload
    threshold = lambda v: parse_per_workload(v, "--verify-threshold", float, 0.0, (0.0, 1.0))
    assert threshold("team=0.1,busy=0.25") == {"solo": 0.0, "team": 0.1, "busy": 0.25}
    assert threshold("0.3") == {"solo": 0.3, "team": 0.3, "busy": 0.3}
    for bad, why in (("busy=1.0", r"\[0.0, 1.0\)"), ("-0.1", r"\[0.0"), ("team=a", "a number")):
        with pytest.raises(ValueError, match=why):
            threshold(bad)


def test_bench_quick_draft_vocabulary(bench_pair, tmp_path):
    """--draft-vocab N: the spec engine drafts from the N most frequent ids ranked in the
    drafter's draft_vocab.json; the record says so, and a drafter without the ranking is
    refused with the file named."""
    import argparse
    import shutil

    from jspec.bench.run import add_bench_parser
    from jspec.config import ConfigError
    from jspec.draft_vocab import write_ranked_ids
    target_dir, draft_dir = bench_pair
    parser = argparse.ArgumentParser(prog="jspec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))

    def run(draft, out):
        return parser.parse_args(["bench", "--model", str(target_dir), "--draft", str(draft),
                                  "--out", str(out), "--quick", "--no-progress", "--workloads",
                                  "solo", "--peer", "off", "--draft-vocab", "64"])

    args = run(draft_dir, tmp_path / "refused")
    with pytest.raises(ConfigError, match="draft_vocab.json"):
        args.func(args)
    ranked = shutil.copytree(draft_dir, tmp_path / "draft")
    write_ranked_ids(ranked, np.random.default_rng(0).permutation(512).tolist())
    args = run(ranked, tmp_path / "bench")
    assert args.func(args) == 0
    rec = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert "--draft-vocab 64" in rec["env"]["command"]
    assert not rec["workloads"]["solo"]["recompiled"]
    assert rec["acceptance"]["solo"] >= 1.0 and rec["fidelity"]["mean"] <= 0.002



def _bench(bench_pair, out, *extra):
    """A Bench over bench_pair writing to `out`, built from `jspec bench` options (`extra`)."""
    import argparse

    from jspec.bench.run import Bench, add_bench_parser
    target_dir, draft_dir = bench_pair
    parser = argparse.ArgumentParser(prog="jspec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--model", str(target_dir), "--draft", str(draft_dir),
                              "--out", str(out), "--workloads", "peer", "--no-progress", *extra])
    return Bench(args, ["peer"])


def _peer_part(bench, device="Some GPU 80GB"):
    return {"part": "peer", "key": bench.key, "workload": "solo", "status": "ok", "reason": None,
            "device": device, "tokens_per_s": 100.0}


def test_peer_only_record_names_the_gpu_the_peer_ran_on(bench_pair, tmp_path):
    # `--workloads peer` never touches JAX's device, so only the peer's part knows the GPU; the
    # record's header printed "GPU: None" before.
    bench = _bench(bench_pair, tmp_path)
    bench.write_part("peer", _peer_part(bench))
    rec = bench.assemble()
    assert rec["env"]["gpu"] == "Some GPU 80GB"
    assert "GPU: Some GPU 80GB" in (tmp_path / "bench.md").read_text()


def test_a_peer_part_belongs_to_every_run_on_the_same_model_sampling_and_code(bench_pair, tmp_path):
    # The peer runs the checkpoint as stored, so the jspec engines' knobs do not touch it: a
    # peer part measured without --batch-invariant enters a run with it; another sampling's does
    # not, and the record says why.
    plain = _bench(bench_pair, tmp_path)
    plain.write_part("peer", _peer_part(plain))
    parts, warnings = _bench(bench_pair, tmp_path, "--batch-invariant", "--prefill-chunk", "512").read_parts()
    assert parts["peer"]["tokens_per_s"] == 100.0 and not warnings
    parts, warnings = _bench(bench_pair, tmp_path, "--sampling", "greedy").read_parts()
    assert "peer" not in parts and "differs in sampling" in warnings[0]
    # Engine parts still need the whole key.
    plain.write_part("solo", {"part": "solo", "key": plain.key})
    parts, warnings = _bench(bench_pair, tmp_path, "--batch-invariant").read_parts()
    assert "solo" not in parts and "batch_invariant" in warnings[0]


def test_gpu_facts_parses_nvidia_smi_and_never_fails_a_record():
    import subprocess

    from jspec.bench.run import GPU_FACTS, gpu_facts

    row = "580.65.06, 700.00, 1980, 2619, 1980, 2619, P0, 41, 0x0000000000000000"
    calls = []

    def fake(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=row + "\n", stderr="")

    facts = gpu_facts(fake)
    assert list(facts) == list(GPU_FACTS)
    assert facts["power.limit"] == "700.00" and facts["clocks.max.mem"] == "2619"
    assert facts["clocks_throttle_reasons.active"] == "0x0000000000000000"
    assert calls[0][1] == "--query-gpu=" + ",".join(GPU_FACTS)

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    def failing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 9, stdout="", stderr="no devices")

    def short(cmd, **kw):  # a field this driver does not know would shift every value
        return subprocess.CompletedProcess(cmd, 0, stdout="580.65.06, 700.00\n", stderr="")

    def hung(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))

    for runner in (missing, failing, short, hung):
        assert gpu_facts(runner) is None, runner.__name__

    asked = []

    def old_driver(cmd, **kw):  # refuses one field, and so any query that names it
        fields = cmd[1].split("=", 1)[1].split(",")
        asked.append(fields)
        if "clocks_throttle_reasons.active" in fields:
            return subprocess.CompletedProcess(cmd, 2, stdout="", stderr="not a valid field")
        return subprocess.CompletedProcess(cmd, 0, stdout=", ".join(f"v-{f}" for f in fields), stderr="")

    facts = gpu_facts(old_driver)
    assert list(facts) == [f for f in GPU_FACTS if f != "clocks_throttle_reasons.active"]
    assert facts["power.limit"] == "v-power.limit"
    assert len(asked) == 1 + len(GPU_FACTS)  # the whole query, then one field at a time


def test_bench_markdown_shows_the_gpu_state_only_when_recorded():
    from pathlib import Path

    from jspec.bench.report import markdown

    rec = json.loads((Path(__file__).resolve().parent.parent /
                      "docs/results/2026-12-07-h100-bench-drafter2/bench.json").read_text())
    assert "GPU state" not in markdown(rec)
    rec["env"]["gpu_facts"] = {"power.limit": "700.00", "clocks.max.mem": "2619"}
    md = markdown(rec)
    assert "GPU state (nvidia-smi): power.limit 700.00, clocks.max.mem 2619" in md
    assert md.index("GPU: NVIDIA H100") < md.index("GPU state") < md.index("`jspec bench")
