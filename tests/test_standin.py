"""The stand-in pair (jspec.standin): the int8 package, its names, the cache, and `jspec demo`.

Packing and names are tested on a tiny random compact pair built here (tests/standin_pack.py)
and pointed at through $JSPEC_STANDIN_DIR, with $JSPEC_CACHE in a temporary directory. The
`jspec demo` test runs against the real shipped pair in jspec/assets/standin when it is present
(the CI case once the trained pair is committed) and otherwise against the tiny random pack, so
the code path is proven either way; which one ran is printed in the test's output.
"""

import json
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jspec import standin as ST
from jspec.config import ConfigError
from jspec.convert.safetensors_reader import index_checkpoint, read_tensor
from standin_pack import ROWS, standin_env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny compact pair, its package, and a fresh cache: names point at them."""
    base = tmp_path_factory.mktemp("standin")
    with standin_env(base, prefer_shipped=False) as (pack_dir, _):
        yield {"base": base, "pack": pack_dir, "src": base / "tiny-standin" / "src",
               "cache": base / "jspec-cache"}


# ---- quantisation -------------------------------------------------------------------------------

@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_rows(pow2):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 97)) * rng.uniform(1e-4, 30.0, (40, 1))
    w[3] = 0.0
    w[5, 7] = 1.0  # a row whose max is exactly a power of two: q = 127 must not overflow
    q, s = ST.quantize_rows(w, pow2=pow2)
    assert q.dtype == np.int8 and s.dtype == ST.BF16 and q.shape == w.shape and s.shape == (40,)
    assert np.abs(q.astype(int)).max() <= 127
    s64 = s.astype(np.float64)
    amax = np.abs(w).max(1)
    assert np.all(s64 * 127 >= amax) and s64[3] == 0 and not q[3].any()
    if pow2:
        nz = s64 > 0
        assert np.all(np.log2(s64[nz]) == np.round(np.log2(s64[nz])))
        assert np.all(s64[nz] < 2 * amax[nz] / 127)  # the least such power of two
    deq = ST.dequantize(q, s)
    # The weight is q * s exactly: float32 holds it; bfloat16 too with power-of-two scales.
    np.testing.assert_array_equal(deq.astype(np.float64), q.astype(np.float64) * s64[:, None])
    assert ST.exact_in(deq, ST.BF16) == pow2
    err = np.abs(deq - w).max(1)
    assert np.all(err <= s64 / 2 + 1e-12 * amax)  # round to nearest
    # Weights that already are int8 x bfloat16 are kept as they are: re-packing is lossless.
    q2, s2 = ST.quantize_rows(deq, pow2=pow2)
    np.testing.assert_array_equal(ST.dequantize(q2, s2), deq)


def test_transferred_weights_repack_losslessly():
    """scripts/standin_transfer.py brings the trained pair back as int8 x bf16 (its own scale
    rule); packing those weights keeps them exactly, rows with max |q| = 126 included."""
    sys.path.insert(0, str(ST.Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from standin_transfer import quantize_rows as transfer_quantize
    finally:
        sys.path.pop(0)
    w = np.random.default_rng(1).standard_normal((300, 64)).astype(np.float32)
    q, s = transfer_quantize(w)
    back = q.astype(np.float32) * s.astype(np.float32)[:, None]
    assert (np.abs(q).max(1) < 127).any()  # the case a plain re-quantisation would change
    q2, s2 = ST.quantize_rows(back)
    np.testing.assert_array_equal(ST.dequantize(q2, s2), back)


# ---- the package --------------------------------------------------------------------------------

def test_pack_round_trip(tiny):
    src, pack_dir = tiny["src"], tiny["pack"]
    assert sorted(p.name for p in pack_dir.iterdir()) == ["dflash", "dspark", "target"]
    for kind in ("target", "dspark", "dflash"):
        raw = load_file(pack_dir / kind / ST.WEIGHTS_FILE)
        source = {k: read_tensor(i) for k, i in index_checkpoint(src / kind).items()}
        hf_src = json.loads((src / kind / "config.json").read_text())
        assert json.loads((pack_dir / kind / "config.json").read_text()) == hf_src  # unchanged
        # The drafters' copies of the target's embedding / lm_head are not stored.
        keep = {k for k in source if kind == "target" or k not in ("embed_tokens.weight", "lm_head.weight")}
        assert {k.removesuffix(".q").removesuffix(".scale") for k in raw} == keep
        _, weights = ST.read_packed(kind)
        compact = ST.compact_dir({"target": "standin"}.get(kind, f"standin-{kind}"))
        stored = {k: read_tensor(i) for k, i in index_checkpoint(compact).items()}
        assert all(v.dtype == np.float32 for v in stored.values())  # q * s is not bf16-exact
        for key in keep:
            w = source[key].astype(np.float64)
            if w.ndim == 2:
                q, s = raw[key + ".q"], raw[key + ".scale"]
                assert q.dtype == np.int8 and s.dtype == ST.BF16 and s.shape == (w.shape[0],)
                want = q.astype(np.float64) * s.astype(np.float64)[:, None]
                bound = 1 / 127  # |w - q s| <= s / 2 < max|w_row| / 127
            else:
                assert raw[key].dtype == ST.BF16
                want = raw[key].astype(np.float64)
                bound = 2.0 ** -8  # bfloat16 rounding
            np.testing.assert_array_equal(weights[key].astype(np.float64), want)
            np.testing.assert_array_equal(stored[key].astype(np.float64), want)
            amax = np.abs(w).max(axis=-1, keepdims=True) if w.ndim == 2 else np.abs(w).max()
            assert np.all(np.abs(w - want) <= bound * amax)
    assert (pack_dir / "target" / "generation_config.json").is_file()
    tdir = ST.compact_dir("standin")
    assert (tdir / "tokenizer.json").is_file() and (tdir / "generation_config.json").is_file()
    assert json.loads((tdir / "config.json").read_text())["jspec_shared_row"] is not None


def test_pack_cli_check_and_refusals(tiny, tmp_path, monkeypatch):
    src = tiny["src"]
    out = tmp_path / "p"
    args = [sys.executable, "-m", "jspec.standin", "pack", "--target", str(src / "target"),
            "--dspark", str(src / "dspark"), "--out", str(out), "--check"]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "model.layers.0.self_attn.q_proj.weight" in r.stdout and "total" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["dspark", "target"]
    r = subprocess.run(args, capture_output=True, text=True)  # exists: refused
    assert r.returncode == 2 and "already exists" in r.stderr
    # Power-of-two scales: q * s fits bfloat16, so the compact directory is bfloat16 and exact.
    r = subprocess.run(args + ["--force", "--pow2-scales"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("JSPEC_STANDIN_DIR", str(out))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    raw = load_file(out / "target" / ST.WEIGHTS_FILE)
    compact = {k: read_tensor(i) for k, i in index_checkpoint(ST.compact_dir("standin")).items()}
    s = raw["model.layers.1.mlp.down_proj.weight.scale"].astype(np.float64)
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    w = compact["model.layers.1.mlp.down_proj.weight"]
    assert w.dtype == ST.BF16
    np.testing.assert_array_equal(w.astype(np.float64), raw["model.layers.1.mlp.down_proj.weight.q"]
                                  * s[:, None])
    with pytest.raises(ConfigError, match="DFlash"):  # drafters swapped
        ST.pack(src / "target", src / "dflash", tmp_path / "q")
    with pytest.raises(ConfigError, match="drafter"):
        ST.pack(src / "dspark", src / "dspark", tmp_path / "q")
    assert not (tmp_path / "q").exists()


# ---- names and the cache ------------------------------------------------------------------------

def test_names_resolve(tiny, tmp_path, monkeypatch):
    t = ST.resolve("standin")
    assert t.parent == tiny["cache"] / "standin" and t.name.startswith("standin-")
    assert (t / ST.COMPLETE_MARKER).is_file()
    assert ST.resolve("standin") == t and ST.resolve_model("standin") == t
    d = ST.resolve_drafter("standin-dspark")
    assert json.loads((d / "config.json").read_text())["mask_token_id"] == ST.QWEN3_MASK_ID
    hf = json.loads((t / "config.json").read_text())
    assert hf["vocab_size"] == ST.QWEN3_VOCAB and not any(k.startswith("jspec_") for k in hf)
    # Paths pass through; a local directory that looks like a name is a path.
    assert ST.resolve(str(tmp_path)) == tmp_path
    (tmp_path / "standin-mine").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ST.resolve("standin-mine") == ST.Path("standin-mine")
    with pytest.raises(ConfigError, match="standin, standin-dspark, standin-dflash"):
        ST.resolve("standin-xyz")
    with pytest.raises(ConfigError, match="is a drafter"):
        ST.resolve_model("standin-dspark")
    with pytest.raises(ConfigError, match="is the target"):
        ST.resolve_drafter("standin")


def test_names_through_the_entry_points(tiny):
    from jspec.cli import main
    from jspec.loading import load_drafter, load_model
    from jspec.tokenizer import Tokenizer
    cfg, model = load_model("standin")
    assert cfg.vocab_size == ST.QWEN3_VOCAB
    dcfg, _ = load_drafter("standin-dflash", cfg, model)
    assert dcfg.is_dflash and dcfg.mask_token_id == ST.QWEN3_MASK_ID
    tok = Tokenizer.from_dir("standin")
    assert tok.eos_ids == (151645, 151643)
    with pytest.raises(ConfigError, match="unknown stand-in name 'standin-big'"):
        load_model("standin-big")
    assert main(["generate", "--model", "standin-xyz", "--prompt", "x"]) == 2


def test_missing_pack_file_is_named(tiny, tmp_path, monkeypatch, capsys):
    broken = tmp_path / "pack"
    shutil.copytree(tiny["pack"], broken)
    (broken / "dspark" / ST.WEIGHTS_FILE).unlink()
    monkeypatch.setenv("JSPEC_STANDIN_DIR", str(broken))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    assert ST.resolve("standin").is_dir()  # the target's files are all there
    with pytest.raises(FileNotFoundError, match=re.escape(str(broken / "dspark" / ST.WEIGHTS_FILE))):
        ST.resolve("standin-dspark")
    from jspec.cli import main
    assert main(["demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights.safetensors is missing" in err[0]


def test_cache_key_follows_the_package(tiny, tmp_path, monkeypatch):
    other = tmp_path / "pack"
    shutil.copytree(tiny["pack"], other)
    monkeypatch.setenv("JSPEC_STANDIN_DIR", str(other))
    assert ST.resolve("standin") == ST.resolve("standin")  # same files, same entry
    before = ST.resolve("standin")
    gen = other / "target" / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [151645]}))
    after = ST.resolve("standin")
    assert after != before and json.loads((after / "generation_config.json").read_text()) == \
        {"eos_token_id": [151645]}


def test_interrupted_build_is_not_reused(tiny, tmp_path, monkeypatch):
    from jspec.convert import expand_vocab
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    real = expand_vocab.expand_target

    def dies_half_way(src, dst, **kw):
        dst.mkdir(parents=True)
        (dst / "config.json").write_text("{}")  # a half-written directory
        raise KeyboardInterrupt

    monkeypatch.setattr(expand_vocab, "expand_target", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        ST.resolve("standin")
    root = tmp_path / "cache" / "standin"
    assert not [p for p in root.iterdir() if p.name.startswith("standin-")]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    # A process killed outright leaves its temporary directory: a later build ignores and removes it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(expand_vocab, "expand_target", real)
    good = ST.resolve("standin")
    stale = root / f".tmp-{good.name}-{dead}"
    (stale / "d").mkdir(parents=True)
    (good / ST.COMPLETE_MARKER).unlink()  # an entry without its marker is never used: rebuilt
    again = ST.resolve("standin")
    assert again == good and (again / ST.COMPLETE_MARKER).is_file() and not stale.exists()
    from jspec.loading import load_model
    assert load_model(again)[0].vocab_size == ST.QWEN3_VOCAB


# ---- the expanded pair computes the compact one ------------------------------------------------

def test_expanded_logits_are_compact_rows_by_sigma(tiny):
    from jspec.convert.expand_vocab import compact_law
    from jspec.dspark import dense_draft
    from jspec.loading import load_drafter, load_model
    from jspec.qwen3 import forward_logits
    from standin_pack import assert_close_rows
    full_cfg, full = load_model("standin", dtype="float32")
    compact_cfg, compact = load_model(ST.compact_dir("standin"), dtype="float32")
    assert compact_cfg.vocab_size == ROWS
    hf = json.loads((ST.compact_dir("standin") / "config.json").read_text())
    dhf = json.loads((ST.compact_dir("standin-dspark") / "config.json").read_text())
    sigma, mult = compact_law(hf, ST.QWEN3_VOCAB, dhf["mask_token_id"], ST.QWEN3_MASK_ID)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ST.QWEN3_VOCAB, (1, 12))
    ids[0, :4] = [151643, 151645, 151669, 11]
    z_full = np.asarray(forward_logits(full, jnp.asarray(ids))[0])
    z_rows = np.asarray(forward_logits(compact, jnp.asarray(sigma[ids]))[0])
    assert_close_rows(z_full, z_rows[..., sigma])
    # The drafter too: its draft logits over ids are the compact drafter's over rows by sigma.
    dcfg, drafter = load_drafter("standin-dspark", full_cfg, full)
    cdcfg, cdrafter = load_drafter(ST.compact_dir("standin-dspark"), compact_cfg, compact)
    ctx, anchor, prev = ids[:, :8], ids[:, 8], ids[:, 8:12]
    u_full = np.asarray(dense_draft(full, drafter, jnp.asarray(ctx), jnp.asarray(anchor),
                                    jnp.asarray(prev))[0])
    u_rows = np.asarray(dense_draft(compact, cdrafter, jnp.asarray(sigma[ctx]),
                                    jnp.asarray(sigma[anchor]), jnp.asarray(sigma[prev]))[0])
    assert_close_rows(u_full, u_rows[..., sigma], tol=1e-5)


def test_graft_takes_the_compact_pair_by_name(tiny, capsys):
    from jspec.convert import graft as G
    plan = G.plan_graft("standin", "standin-dspark", "standin-dflash", shape="qwen3-8b")
    assert plan.source_cfg.vocab_size == ROWS  # S's own rows, not the expanded 151936
    assert set(plan.outputs) == {"target", "dspark", "dflash"}
    assert G.main(["--target", "standin", "--draft", "standin-dspark", "--out", "unused",
                   "--dry-run"]) == 0
    assert "vocabulary: 151936 ids onto 256 rows" in capsys.readouterr().out
    assert G.main(["--target", "standin-nope", "--draft", "standin-dspark", "--out", "x"]) == 2


# ---- jspec demo ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_env(tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "standin-demo"  # shared with tests/test_notebook.py
    with standin_env(base) as (pack_dir, shipped):
        print(f"jspec demo against {'the shipped pair' if shipped else 'a tiny random pack'} "
              f"({pack_dir})")
        yield shipped


def test_demo(demo_env, capsys):
    from jspec.cli import main
    max_tokens = 32 if demo_env else 16
    assert main(["demo", "--max-tokens", str(max_tokens), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    records, summary = lines[:-1], lines[-1]
    assert len(records) == 3 and all(r["match"] for r in records)
    assert all(r["token_ids"] == r["stock_token_ids"] for r in records)
    assert summary["greedy_match"] is True
    assert summary["stock_tokens_per_s"] > 0 and summary["spec_tokens_per_s"] > 0
    assert 1.0 <= summary["tokens_per_step"] <= 8.0
    if demo_env:  # the trained pair: its drafter must be worth something
        assert summary["tokens_per_step"] > 1.3


def test_demo_exits_nonzero_when_outputs_differ(monkeypatch, tmp_path, capsys):
    """The exit code, through a fake LLM (no model) whose speculative output differs."""
    import jspec.api
    from jspec.api import GenerationResult
    from jspec.cli import main

    class FakeLLM:
        def __init__(self, model, draft=None, **kw):
            self.draft = draft

        def generate(self, prompts, params):
            ids = [1, 2, 3] if self.draft is None or len(prompts) == 1 else [1, 2, 4]
            return [GenerationResult("p", "t", ids, [0.0] * 3, "length", list(p),
                                     2.0 if self.draft else None) for p in prompts]

    class FakeTokenizer:
        @staticmethod
        def from_dir(d):
            return FakeTokenizer()

        def encode(self, text):
            return [5, 6]

    monkeypatch.setattr(jspec.api, "LLM", FakeLLM)
    monkeypatch.setattr("jspec.tokenizer.Tokenizer", FakeTokenizer)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    assert main(["demo", "--model", str(tmp_path), "--draft", str(tmp_path), "--prompts",
                 str(prompts), "--no-chat"]) == 1
    out = capsys.readouterr().out
    assert "DIFFER" in out
