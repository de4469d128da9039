"""The 8B stand-in graft (convert/graft.py), through the mid-size shape: the grafted target's logits,
taps and law equal S's, the grafted drafters' draft logits and confidences equal S's drafters',
every vocabulary row is populated, the 8B plan has the exact 8B layouts, and requests that cannot
be placed are refused with a clear error."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.config import Qwen3Config
from jspec.convert import graft as G
from jspec.convert.safetensors_reader import index_checkpoint, read_tensor
from jspec.dspark import DSparkConfig, abstract_drafter, dense_draft, drafter_checkpoint_shapes
from jspec.loading import load_drafter, load_model
from jspec.qwen3 import checkpoint_shapes, forward_logits

MID = G.SHAPES["mid"]

# S_a: vocabulary 1000 of 2048 ids with a shared row and an extra id->row entry, GQA group 2 with
#      one kv head, untied, eps 1e-6, a 2-layer DSpark drafter (vanilla Markov rank 32) and a
#      1-layer DFlash drafter (T's other draft layers are identities).
# S_b: the full 2048-id vocabulary, 4 q / 2 kv heads (group 2, q width 512 != hidden 256), tied,
#      eps 0 (the bit-exact case), a 3-layer DSpark drafter with a gated Markov head of rank 64.
SOURCES = {
    "a": dict(cfg=Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=6,
                              num_heads=2, num_kv_heads=1, head_dim=128, rms_norm_eps=1e-6,
                              max_position_embeddings=2048, dtype="float32"),
              taps=(0, 1, 2, 3, 4), mask=999, draft_layers=2, rank=32, markov="vanilla",
              hf_extra={"jspec_shared_row": 997, "jspec_id_to_row": {"2040": 998},
                        "eos_token_id": 1500}, dflash=True),  # an EOS S does not model: warned
    "b": dict(cfg=Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=8,
                              num_heads=4, num_kv_heads=2, head_dim=128, rms_norm_eps=0.0,
                              tie_word_embeddings=True, max_position_embeddings=2048, dtype="float32"),
              taps=(1, 2, 4, 5, 6), mask=2000, draft_layers=3, rank=64, markov="gated",
              hf_extra={"jspec_shared_row": 5}, dflash=False),  # (used by the 8B plan only)
}


def _random_drafter(dcfg, seed):
    """A drafter with wide random weights and random norms (NumPy-drawn: no per-shape compiles),
    so every block visibly changes the draft logits."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(abstract_drafter(dcfg))
    params = jax.tree.map(
        lambda x: jnp.asarray((1.0 + 0.2 * rng.standard_normal(x.shape)) if len(x.shape) == 1
                              and x.shape[0] > 1 else 0.1 * rng.standard_normal(x.shape), x.dtype),
        nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _make_source(root, name):
    from hf_models import make_hf_qwen3, save_drafter_checkpoint
    spec = SOURCES[name]
    cfg = spec["cfg"]
    s_dir = root / f"S_{name}"
    model = make_hf_qwen3(cfg, s_dir, seed=11 + ord(name))
    if cfg.rms_norm_eps:
        # A trained model's residual stream has RMS >= 1; at std 0.1 the eps-shift of the grafted
        # hidden norms (eps x 4, see convert/graft.py) would be 100 times its real size.
        import torch
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(10.0)
        model.save_pretrained(s_dir, safe_serialization=True)
    hf = json.loads((s_dir / "config.json").read_text())
    hf.update(spec["hf_extra"])
    (s_dir / "config.json").write_text(json.dumps(hf))
    (s_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    _, s_target = load_model(s_dir)
    dirs = {"target": s_dir}
    kinds = [("draft", spec["rank"], True, spec["draft_layers"])]
    if spec["dflash"]:
        kinds.append(("dflash", 0, False, 1))
    for i, (kind, rank, conf, n_layers) in enumerate(kinds):
        dcfg = DSparkConfig(layers=cfg.replace(num_layers=n_layers), block_size=7,
                            mask_token_id=spec["mask"], target_layer_ids=spec["taps"],
                            markov_rank=rank, markov_head_type=spec["markov"], confidence_head=conf)
        drafter = _random_drafter(dcfg, seed=3 + i)
        save_drafter_checkpoint(drafter, dcfg, root / f"S_{name}_{kind}", target=s_target)
        dirs[kind] = root / f"S_{name}_{kind}"
    return dirs


@pytest.fixture(scope="module", params=sorted(SOURCES))
def grafted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"graft_{request.param}")
    src = _make_source(root, request.param)
    argv = ["--target", str(src["target"]), "--draft", str(src["draft"]), "--out", str(root / "T"),
            "--shape", "mid", "--dtype", "float32", "--shard-mib", "100", "--quiet"]
    if "dflash" in src:
        argv += ["--dflash", str(src["dflash"])]
    assert G.main(argv) == 0
    plan = G.plan_graft(src["target"], src["draft"], src.get("dflash"), shape="mid", dtype="float32")
    s_cfg, s_model = load_model(src["target"])
    t_cfg, t_model = load_model(root / "T" / "target")
    return dict(name=request.param, src=src, out=root / "T", plan=plan, s_cfg=s_cfg, s=s_model,
                t_cfg=t_cfg, t=t_model)


def _ids(g, shape, seed):
    """T ids that hit every kind of row: own rows, the shared class, the mask, overridden ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, g["t_cfg"].vocab_size, shape)
    special = [MID.mask_token_id, 2040, 997, 998, 999, 1000, 2047, 0]
    ids.reshape(-1)[:len(special)] = special
    return ids


# ---- the target -------------------------------------------------------------------------------

def test_grafted_target_layout(grafted):
    g, out = grafted, grafted["out"]
    t = g["t_cfg"]
    assert (t.num_layers, t.hidden_size, t.num_heads, t.num_kv_heads, t.intermediate_size,
            t.vocab_size, t.tie_word_embeddings) == (12, 1024, 8, 2, 1024, 2048, False)
    assert t.rms_norm_eps == g["s_cfg"].rms_norm_eps and t.rope_theta == g["s_cfg"].rope_theta
    files = sorted(p.name for p in (out / "target").iterdir())
    assert "model.safetensors.index.json" in files and "model-00001-of-00003.safetensors" in files
    assert {"generation_config.json", "tokenizer_config.json", "config.json"} <= set(files)
    assert json.loads((out / "target" / "config.json").read_text())["jspec_graft"]["layer_positions"] \
        == g["plan"].positions
    assert sorted(p.name for p in out.iterdir()) == (["dflash", "dspark", "target"] if g["name"] == "a"
                                                     else ["dspark", "target"])


def test_grafted_target_logits_taps_and_law(grafted):
    g = grafted
    sigma, mult = g["plan"].sigma, g["plan"].multiplicity
    s_taps_ids = SOURCES[g["name"]]["taps"]
    d = g["s_cfg"].hidden_size
    ids = _ids(g, (1, 13), seed=1)  # the drafter test's context shape: eager compiles are reused
    t_logits, t_taps = forward_logits(g["t"], jnp.asarray(ids), tap_layers=MID.taps)
    s_logits, s_taps = forward_logits(g["s"], jnp.asarray(sigma[ids]), tap_layers=s_taps_ids)
    t_logits, s_logits = np.asarray(t_logits), np.asarray(s_logits)
    want = s_logits[..., sigma]
    scale = np.abs(want).max()
    assert scale > 5.0 and np.abs(want[:, 1:] - want[:, :-1]).max() > 1.0  # a non-trivial model
    np.testing.assert_allclose(t_logits, want, rtol=0, atol=1e-4 * scale)
    for tt, ts in zip(t_taps, s_taps):
        tt, ts = np.asarray(tt), np.asarray(ts)
        np.testing.assert_allclose(tt[..., :d], ts, rtol=0, atol=1e-4 * np.abs(ts).max())
        assert not tt[..., d:].any()  # T's extra residual channels stay exactly zero
    # The law: T's per-id probabilities are S's multiplicity-weighted row law split evenly.
    s_law = jax.nn.log_softmax(s_logits + np.log(mult), -1)
    np.testing.assert_allclose(np.asarray(jax.nn.log_softmax(t_logits, -1)),
                               np.asarray(s_law)[..., sigma] - np.log(mult)[sigma], atol=1e-4)


def test_check_report_and_warnings(grafted):
    g = grafted
    report = G.check_graft(g["src"]["target"], g["out"], length=13)  # 13: reuses eager compiles
    assert report["max_rel_logit_diff"] < 1e-4 and report["mean_tv"] < 1e-5, report
    assert g["plan"].warnings == (["EOS id 1500 shares S's row 997 with 1048 other id(s)"]
                                  if g["name"] == "a" else [])


def test_vocabulary_rows_populated(grafted):
    g = grafted
    infos = index_checkpoint(g["out"] / "target")
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = read_tensor(infos[key])
        assert rows.shape == (2048, 1024) and np.abs(rows).sum(-1).min() > 0, key
    d_infos = index_checkpoint(g["out"] / "dspark")
    for key in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        rows = read_tensor(d_infos[key])
        assert rows.shape == (2048, 64) and np.abs(rows).sum(-1).min() > 0, key
    sigma, mult = g["plan"].sigma, g["plan"].multiplicity
    assert sigma[MID.mask_token_id] == SOURCES[g["name"]]["mask"]
    if g["name"] == "a":  # ids >= 1000 share row 997; 2040 -> 998; 999 gave its row to the mask
        assert sigma[1000] == sigma[2047] == sigma[999] == sigma[998] == 997 and sigma[2040] == 998
        # row 997: ids 997, 998 (its row serves 2040), 999 (its row serves the mask 2000) and
        # every id >= 1000 but 2000 and 2040
        assert mult[997] == 3 + (2048 - 1000 - 2) and mult[998] == mult[999] == 1
        assert mult.sum() == 2048
    else:
        assert np.array_equal(sigma, np.arange(2048))


def test_grafted_target_matches_transformers_float64(grafted):
    """The protocol's check: the graft loaded by transformers in float64 against S."""
    import torch
    from transformers import AutoModelForCausalLM
    g = grafted
    sigma = g["plan"].sigma
    ids = _ids(g, (1, 16), seed=2)
    out = {}
    for which, d, tok in (("s", g["src"]["target"], sigma[ids]), ("t", g["out"] / "target", ids)):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
        with torch.no_grad():
            out[which] = model(torch.tensor(tok)).logits.numpy()
    want = out["s"][..., sigma]
    err = np.abs(out["t"] - want).max() / np.abs(want).max()
    if g["s_cfg"].rms_norm_eps == 0.0:
        # Bit-exact: zero padding leaves every product and (here) every summation order unchanged.
        assert err == 0.0, err
    else:
        assert err < 1e-5, err  # the eps shift of the hidden norms: 2e-6 here


# ---- the drafters -------------------------------------------------------------------------------

def _dense_block(target, drafter, dcfg, context, anchor, prev):
    """Draft logits U + B and confidence logits of one block (jspec.dspark.dense_draft)."""
    logits, _, conf = dense_draft(target, drafter, [context], [anchor], [prev])
    return np.asarray(logits[0]), np.asarray(conf[0])


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_grafted_drafter_matches_source(grafted, kind):
    g = grafted
    if kind == "dflash" and "dflash" not in g["src"]:
        pytest.skip("S_b has no DFlash drafter")
    sigma = g["plan"].sigma
    s_dir = g["src"]["draft" if kind == "dspark" else "dflash"]
    s_dcfg, s_drafter = load_drafter(s_dir, g["s_cfg"], g["s"])
    t_dcfg, t_drafter = load_drafter(g["out"] / kind, g["t_cfg"], g["t"])  # checks the copies too
    assert t_dcfg.target_layer_ids == MID.taps and t_dcfg.layers.num_layers == MID.draft_layers
    assert t_dcfg.mask_token_id == MID.mask_token_id
    assert t_dcfg.markov_rank == (0 if kind == "dflash" else MID.markov_rank)
    ids = _ids(g, (20,), seed=3)
    context, anchor = ids[:13].tolist(), int(ids[13])
    prev = [anchor] + ids[14:20].tolist()
    t_logits, t_conf = _dense_block(g["t"], t_drafter, t_dcfg, context, anchor, prev)
    s_logits, s_conf = _dense_block(g["s"], s_drafter, s_dcfg, sigma[context].tolist(),
                                    int(sigma[anchor]), sigma[prev].tolist())
    want = s_logits[..., sigma]
    scale = np.abs(want).max()
    assert np.abs(want[1:] - want[:-1]).max() > 1.0
    np.testing.assert_allclose(t_logits, want, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(t_conf, s_conf, rtol=0, atol=1e-4 * max(1.0, np.abs(s_conf).max()))
    if kind == "dspark":
        assert np.abs(s_conf).max() > 0.1


# ---- the 8B plan --------------------------------------------------------------------------------

def test_8b_plan_has_the_8b_layouts(grafted):
    """The same S planned into qwen3-8b: exactly Qwen3-8B's and DSpark-8B's keys and shapes; a few
    tensors made (not written) to check they come out in bf16 at those shapes."""
    from jspec.config import PRESETS
    g = grafted
    src = g["src"]
    plan = G.plan_graft(src["target"], src["draft"], src.get("dflash"), shape="qwen3-8b")
    t = plan.target_cfg
    assert t == PRESETS["qwen3-8b"].replace(rms_norm_eps=g["s_cfg"].rms_norm_eps,
                                           max_position_embeddings=2048)
    hf, items = plan.outputs["target"]
    assert {n: s for n, s, _ in items} == {k: v[0] for k, v in checkpoint_shapes(PRESETS["qwen3-8b"]).items()}
    assert hf["num_hidden_layers"] == 36 and hf["vocab_size"] == 151936
    hf_d, d_items = plan.outputs["dspark"]
    d8 = DSparkConfig.from_hf_dict(hf_d)
    assert (d8.target_layer_ids, d8.layers.num_layers, d8.mask_token_id, d8.block_size) == \
        ((1, 9, 17, 25, 33), 5, 151669, 7)
    assert d8.markov_rank == 256 and d8.confidence_head
    shapes = {n: s for n, s, _ in d_items}
    assert shapes["fc.weight"] == (4096, 20480) and shapes["confidence_head.proj.weight"] == (1, 4352)
    assert shapes["markov_head.markov_w1.weight"] == (151936, 256)
    assert set(shapes) == set(drafter_checkpoint_shapes(d8)) | {"embed_tokens.weight", "lm_head.weight"}
    made = {n: G.materialize(s, f) for n, s, f in items
            if n in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                     "model.layers.0.mlp.down_proj.weight")}
    q = made["model.layers.1.self_attn.q_proj.weight"]  # T layer 1 holds S layer 0 (a tap)
    assert q.shape == (4096, 4096) and q.dtype == jnp.bfloat16 and q[:, :256].all()
    assert not q[:, 256:].any()
    assert made["model.layers.1.mlp.down_proj.weight"][:256].any()
    assert made["model.layers.0.mlp.down_proj.weight"].any() == plan.layer_live[0]  # identity: 0
    assert plan.layer_live[0] == (g["name"] == "b")  # S_a's first layer is a tap: T layer 1
    assert plan.positions[SOURCES[g["name"]]["taps"][0]] == 1
    assert [plan.positions[i] for i in SOURCES[g["name"]]["taps"]] == [1, 9, 17, 25, 33]
    lean = G.plan_graft(src["target"], src["draft"], shape="qwen3-8b", drafter_copies=False)
    assert {n for n, _, _ in lean.outputs["dspark"][1]} == set(drafter_checkpoint_shapes(d8))
    assert G.main(["--target", str(src["target"]), "--draft", str(src["draft"]), "--out",
                   str(g["out"] / "never"), "--dry-run"]) == 0
    assert not (g["out"] / "never").exists()


# ---- the maps and refusals -----------------------------------------------------------------------

def test_layer_placement():
    assert G.place_layers(6, (0, 1, 2, 3, 4), 12, (1, 3, 5, 7, 9)) == [1, 3, 5, 7, 9, 10]
    assert G.place_layers(8, (1, 2, 4, 5, 6), 12, (1, 3, 5, 7, 9)) == [0, 1, 3, 4, 5, 7, 9, 10]
    pos = G.place_layers(28, (1, 7, 13, 19, 25), 36, (1, 9, 17, 25, 33))
    assert [pos[i] for i in (1, 7, 13, 19, 25)] == [1, 9, 17, 25, 33] and pos[-1] == 35
    assert all(b > a for a, b in zip(pos, pos[1:]))
    src, live = G.layer_sources([1, 3, 5], 7)
    assert src == [0, 0, 0, 1, 1, 2, 2] and live == [False, True, False, True, False, True, False]


@pytest.mark.parametrize("args,message", [
    ((8, (0, 1, 4, 5, 6), 12, (1, 3, 5, 7, 9)), "between its taps 1 and 4"),
    ((6, (2, 3, 4), 12, (1, 3, 5)), "before its first tap"),
    ((9, (0, 1, 2, 3, 4), 12, (1, 3, 5, 7, 9)), "after its last tap"),
    ((6, (0, 1, 2, 3), 12, (1, 3, 5, 7, 9)), "counts must be equal"),
    ((6, (0, 1, 2, 3, 5), 12, (1, 3, 5, 7, 9)), "excluding the last"),
    ((40, (1, 9, 17, 25, 33), 36, (1, 9, 17, 25, 33)), "more than the shape's"),
])
def test_unplaceable_layers_are_refused(args, message):
    with pytest.raises(G.GraftError, match=message):
        G.place_layers(*args)


def test_head_map():
    base = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=2, head_dim=128)
    t = Qwen3Config(**{**base, "hidden_size": 1024}, num_heads=8, num_kv_heads=2)
    h = G.head_map(Qwen3Config(**base, num_heads=4, num_kv_heads=2), t)
    assert h.live_t.tolist() == [0, 1, 4, 5] and h.live_s.tolist() == [0, 1, 2, 3]
    assert h.q_src.tolist() == [0, 1, 0, 1, 2, 3, 2, 3] and h.kv_src.tolist() == [0, 1]
    assert np.array_equal(h.q_src // 2, h.kv_src[np.arange(8) // 4])  # every copy keeps its kv head
    with pytest.raises(G.GraftError, match="GQA group"):
        G.head_map(Qwen3Config(**base, num_heads=8, num_kv_heads=1), t)
    with pytest.raises(G.GraftError, match="kv heads"):
        G.head_map(Qwen3Config(**base, num_heads=4, num_kv_heads=4), t)
    with pytest.raises(G.GraftError, match="head_dim"):
        G.head_map(Qwen3Config(**{**base, "head_dim": 64}, num_heads=4, num_kv_heads=2), t)
    with pytest.raises(G.GraftError, match="power of 4"):
        G._Builder(Qwen3Config(**{**base, "hidden_size": 512}, num_heads=4, num_kv_heads=2), t, h,
                   np.float32)


def test_vocab_law_refusals():
    assert np.array_equal(G.vocab_law({}, 8, 8, 7, 7)[0], np.arange(8))
    sigma, n = G.vocab_law({"jspec_shared_row": 0}, 6, 10, 5, 9)
    assert sigma.tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 0, 5] and n.tolist() == [5, 1, 1, 1, 1, 1]
    with pytest.raises(G.GraftError, match="jspec_shared_row"):
        G.vocab_law({}, 6, 10, 5, 9)
    with pytest.raises(G.GraftError, match="jspec_shared_row"):
        G.vocab_law({}, 10, 10, 5, 9)  # row 5 serves the mask id 9: id 5 needs the shared row
    with pytest.raises(G.GraftError, match="reached by no T id"):
        G.vocab_law({"jspec_shared_row": 0}, 10, 10, 9, 5)  # mask id 5 -> row 9: row 5 orphaned
    with pytest.raises(G.GraftError, match="mask"):
        G.vocab_law({"jspec_shared_row": 0, "jspec_id_to_row": {"9": 3}}, 6, 10, 5, 9)
    with pytest.raises(G.GraftError, match="more than the shape"):
        G.vocab_law({}, 12, 10, 5, 9)


def test_unplaceable_graft_is_refused_by_the_cli(grafted, tmp_path, capsys):
    """A drafter whose taps cannot land on the shape's taps: a clear error, nothing written."""
    g = grafted
    if g["name"] != "b":
        pytest.skip("needs S_b's 8 layers")
    bad = tmp_path / "bad_draft"
    shutil.copytree(g["src"]["draft"], bad)
    hf = json.loads((bad / "config.json").read_text())
    hf["target_layer_ids"] = [0, 1, 4, 5, 6]  # a gap of 3 layers; the mid shape's gaps are 2
    (bad / "config.json").write_text(json.dumps(hf))
    rc = G.main(["--target", str(g["src"]["target"]), "--draft", str(bad), "--out",
                 str(tmp_path / "T"), "--shape", "mid", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "T").exists()
    assert "between its taps 1 and 4" in err and "3 layer(s)" in err, err


def test_graft_writes_the_draft_vocabulary_ranking(grafted):
    """A compact S (S_a: ids beyond its 1000 rows share one) has its rows ranked by corpus
    frequency, so the graft writes its own-row ids in row order beside each drafter, without
    the shared row's ids and T's mask id. S_b has a row for every id (its shared row serves
    none): no ranking is written."""
    from jspec.draft_vocab import read_ranked_ids
    plan, sigma, mult = grafted["plan"], grafted["plan"].sigma, grafted["plan"].multiplicity
    for kind in [k for k in ("dspark", "dflash") if (grafted["out"] / k).is_dir()]:
        if mult.max() == 1:
            assert not (grafted["out"] / kind / "draft_vocab.json").exists()
            continue
        ranked = read_ranked_ids(grafted["out"] / kind)
        assert len(set(ranked)) == len(ranked)
        assert all(mult[sigma[t]] == 1 for t in ranked)  # own rows only
        assert MID.mask_token_id not in ranked
        rows = sigma[np.asarray(ranked)]
        assert np.all(np.diff(rows) > 0)  # in row order
        own = np.flatnonzero(mult[sigma] == 1)
        assert set(ranked) == set(own.tolist()) - {MID.mask_token_id}
