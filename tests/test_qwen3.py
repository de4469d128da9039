"""The Qwen3 model against transformers: logits, taps, greedy tokens, conversion, errors."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jspec.cli import main as cli_main
from jspec.config import PRESETS, ConfigError, Qwen3Config
from jspec.convert.safetensors_reader import CheckpointError
from jspec.loading import is_jspec_dir, load_model
from jspec.qwen3 import forward_logits
from jspec.simple_generate import greedy_generate


def _hf_forward(model_dir, tokens, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        out = hf(torch.tensor(tokens), output_hidden_states=True)
    return hf, out


def _tokens(cfg, shape=(2, 40), seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape)


# ---- config ----------------------------------------------------------------------------------

def test_config_roundtrip_and_presets():
    for name, cfg in PRESETS.items():
        assert Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg, name
    c8 = PRESETS["qwen3-8b"]
    assert (c8.num_layers, c8.hidden_size, c8.num_heads, c8.num_kv_heads, c8.intermediate_size,
            c8.vocab_size, c8.tie_word_embeddings) == (36, 4096, 32, 8, 12288, 151936, False)
    assert PRESETS["qwen3-0.6b"].tie_word_embeddings


def test_config_reads_transformers5_rope_parameters():
    hf = PRESETS["tiny-untied"].to_hf_dict()
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert Qwen3Config.from_hf_dict(hf).rope_theta == 5e5


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
    ("use_sliding_window", True),
    ("layer_types", ["sliding_attention"] * 6),
    ("attention_bias", True),
    ("hidden_act", "gelu"),
    ("model_type", "qwen3_moe"),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_unsupported_config_field_is_named(field, value):
    hf = PRESETS["tiny-untied"].to_hf_dict()
    hf[field] = value
    with pytest.raises(ConfigError, match=field):
        Qwen3Config.from_hf_dict(hf)


def test_missing_required_field_is_named():
    hf = PRESETS["tiny-untied"].to_hf_dict()
    del hf["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        Qwen3Config.from_hf_dict(hf)


# ---- forward against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-tied", "tiny-untied"])
def test_fp32_logits_and_taps_match_transformers(hf_tiny_dirs, name):
    cfg, model = load_model(hf_tiny_dirs[name])
    tokens = _tokens(cfg)
    _, out = _hf_forward(hf_tiny_dirs[name], tokens)
    taps = tuple(range(cfg.num_layers - 1))  # the last slot of HF hidden_states is final-normed
    logits, tapped = forward_logits(model, jnp.asarray(tokens), tap_layers=taps)
    ref = out.logits.numpy()
    assert np.abs(np.asarray(logits) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    for i, h in zip(taps, tapped):
        np.testing.assert_allclose(np.asarray(h), out.hidden_states[i + 1].numpy(), atol=1e-4, rtol=1e-4)
    # The test has teeth: the logits vary across positions and layers change the stream.
    assert np.abs(ref[:, 1:] - ref[:, :-1]).max() > 0.5
    assert np.abs(np.asarray(tapped[1]) - np.asarray(tapped[0])).max() > 0.1


def test_bf16_logits_within_bf16_tolerance(hf_tiny_dirs):
    d = hf_tiny_dirs["tiny-untied"]
    cfg, model = load_model(d, dtype="bfloat16")
    assert model.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    tokens = _tokens(cfg)
    _, out32 = _hf_forward(d, tokens)  # the exact answer
    _, out16 = _hf_forward(d, tokens, torch.bfloat16)  # transformers' own bf16 error, for scale
    ours = np.asarray(forward_logits(model, jnp.asarray(tokens))[0], np.float32)
    exact = out32.logits.numpy()
    theirs = out16.logits.float().numpy()
    ours_err = np.linalg.norm(ours - exact) / np.linalg.norm(exact)
    theirs_err = np.linalg.norm(theirs - exact) / np.linalg.norm(exact)
    # bf16 tolerance = transformers' own bf16 error (1.4-2.1 % over seeds on this model).
    assert ours_err < 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(exact) < 3e-2


@pytest.mark.parametrize("name", ["tiny-tied", "tiny-untied"])
def test_greedy_32_tokens_match_transformers_generate(hf_tiny_dirs, name):
    from transformers import AutoModelForCausalLM
    cfg, model = load_model(hf_tiny_dirs[name])
    prompt = _tokens(cfg, (1, 11), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(hf_tiny_dirs[name], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    ref_new = ref[0, prompt.shape[1]:].tolist()
    ours = greedy_generate(model, prompt[0].tolist(), 32)
    assert len(ref_new) == 32 and ours == ref_new
    assert len(set(ours)) >= 2  # not a single repeated token


# ---- conversion --------------------------------------------------------------------------------

def test_convert_to_orbax_gives_same_logits(hf_tiny_dirs, tmp_path):
    src = hf_tiny_dirs["tiny-untied"]
    dst = tmp_path / "converted"
    assert cli_main(["convert", str(src), str(dst), "--quiet"]) == 0
    assert is_jspec_dir(dst) and (dst / "generation_config.json").is_file()
    cfg, hf_model = load_model(src)
    cfg2, orbax_model = load_model(dst)
    assert cfg2 == cfg
    tokens = jnp.asarray(_tokens(cfg))
    np.testing.assert_array_equal(np.asarray(forward_logits(hf_model, tokens)[0]),
                                  np.asarray(forward_logits(orbax_model, tokens)[0]))


def test_convert_bf16_then_load(hf_tiny_dirs, tmp_path):
    dst = tmp_path / "bf16"
    assert cli_main(["convert", str(hf_tiny_dirs["tiny-tied"]), str(dst), "--dtype", "bfloat16",
                     "--quiet"]) == 0
    cfg, model = load_model(dst)
    assert cfg.dtype == "bfloat16" and model.embed_tokens[...].dtype == jnp.bfloat16


def test_convert_refuses_existing_dst_without_force(hf_tiny_dirs, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    assert cli_main(["convert", str(hf_tiny_dirs["tiny-tied"]), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err
    assert (dst / "keep.txt").read_text() == "precious"
    assert cli_main(["convert", str(hf_tiny_dirs["tiny-tied"]), str(dst), "--force", "--quiet"]) == 0
    assert is_jspec_dir(dst) and not (dst / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial or backup left


def test_interrupted_convert_leaves_nothing(hf_tiny_dirs, tmp_path, monkeypatch):
    import jspec.convert.hf_to_jspec as conv

    def boom(model, path):
        path.mkdir(parents=True)
        (path / "half-written").write_text("x")
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "save_orbax", boom)
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        conv.convert_checkpoint(hf_tiny_dirs["tiny-tied"], dst, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_failed_force_convert_keeps_old_dst(hf_tiny_dirs, tmp_path, monkeypatch):
    import jspec.convert.hf_to_jspec as conv
    dst = tmp_path / "out"
    conv.convert_checkpoint(hf_tiny_dirs["tiny-tied"], dst, progress=False)
    monkeypatch.setattr(conv, "save_orbax", lambda m, p: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        conv.convert_checkpoint(hf_tiny_dirs["tiny-tied"], dst, force=True, progress=False)
    assert is_jspec_dir(dst) and load_model(dst)[0] == PRESETS["tiny-tied"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ---- checkpoint errors ---------------------------------------------------------------------------

def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.2.mlp.up_proj.weight"), "missing.*model.layers.2.mlp.up_proj.weight"),
    (lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", np.zeros((2, 2), np.float32)),
     "unexpected.*model.layers.9.mlp.up_proj.weight"),
    (lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight",
                             t["model.layers.1.self_attn.k_proj.weight"][:-1]),
     "model.layers.1.self_attn.k_proj.weight.*shape"),
])
def test_bad_checkpoint_names_the_tensor(hf_tiny_dirs, tmp_path, edit, message):
    bad = _broken_copy(hf_tiny_dirs["tiny-untied"], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)
    dst = tmp_path / "dst"
    assert cli_main(["convert", str(bad), str(dst), "--quiet"]) == 2
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_tied_checkpoint_with_differing_head_is_refused(hf_tiny_dirs, tmp_path):
    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0
    bad = _broken_copy(hf_tiny_dirs["tiny-tied"], tmp_path / "bad", add_head)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(bad)


def test_not_a_model_directory(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not a model directory"):
        load_model(tmp_path)
    assert cli_main(["convert", str(tmp_path / "nope"), str(tmp_path / "dst")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sharded_checkpoint_with_index(hf_tiny_dirs, tmp_path):
    src = hf_tiny_dirs["tiny-untied"]
    d = tmp_path / "sharded"
    d.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src / f, d / f)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, d / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, d / "model-00002-of-00002.safetensors")
    weight_map = {n: ("model-00001-of-00002.safetensors" if i < half else
                      "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg, a = load_model(src)
    _, b = load_model(d)
    tokens = jnp.asarray(_tokens(cfg))
    np.testing.assert_array_equal(np.asarray(forward_logits(a, tokens)[0]),
                                  np.asarray(forward_logits(b, tokens)[0]))


def test_bf16_model_keeps_an_fp32_residual_stream(hf_tiny_dirs):
    """Rounding the residual to bf16 after every add is what made a q_len-8 verify and a q_len-1
    decode drift apart (docs/benchmarks.md, the bench's fixed-text gate): the stream stays fp32,
    the matmul inputs and the taps are bf16."""
    cfg, model = load_model(hf_tiny_dirs["tiny-untied"], dtype="bfloat16")
    tokens = jnp.asarray(_tokens(cfg))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    from jspec.qwen3 import causal_attention
    x = model.embed(tokens)
    out, _ = model.layers[0](0, x, positions, causal_attention(), None)
    assert out.dtype == jnp.float32
    hidden, taps, _ = model(tokens, positions, attention=causal_attention(), tap_layers=(0, 1))
    assert hidden.dtype == jnp.bfloat16 and all(t.dtype == jnp.bfloat16 for t in taps)
    # The fp32 stream is not a bf16 one upcast: it holds values bf16 cannot.
    assert not np.array_equal(np.asarray(out), np.asarray(out.astype(jnp.bfloat16).astype(jnp.float32)))


def test_residual_adds_folded_into_the_norms_change_no_bit(hf_tiny_dirs):
    """Qwen3.__call__ runs each residual add inside the norm after it (DecoderLayer.step, the
    previous layer's MLP output pending into the next layer): on the XLA route the hidden states
    and every tap equal, bit for bit, the layer loop as it was written before (each layer adding
    its own attention and MLP outputs, verbatim below), in bf16 with the fp32 stream."""
    import jax

    from jspec.kernels.linear import sum_in_order
    from jspec.qwen3 import causal_attention
    cfg, model = load_model(hf_tiny_dirs["tiny-untied"], dtype="bfloat16")
    tokens = jnp.asarray(_tokens(cfg))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    attention = causal_attention()
    taps = tuple(range(cfg.num_layers))

    def before(tokens, positions):
        x_btd, outputs = model.embed(tokens), []
        for i, layer in enumerate(model.layers):
            x_btd = x_btd.astype(jnp.float32)
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x_btd), positions)
            attn_bthk, _ = attention(i, q, k, v, None)
            x_btd = x_btd + sum_in_order(layer.self_attn.out_partials(attn_bthk.astype(q.dtype)))
            x_btd = x_btd + sum_in_order(layer.mlp.partials(layer.post_attention_layernorm(x_btd)))
            outputs.append(x_btd.astype(jnp.bfloat16))
        return model.norm(x_btd), outputs

    def now(tokens, positions):
        hidden, got_taps, _ = model(tokens, positions, attention=attention, tap_layers=taps)
        return hidden, got_taps

    want_hidden, want_taps = jax.jit(before)(tokens, positions)
    got_hidden, got_taps = jax.jit(now)(tokens, positions)
    np.testing.assert_array_equal(np.asarray(got_hidden), np.asarray(want_hidden))
    for got, want in zip(got_taps, want_taps, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A layer called alone still adds its own MLP output (the drafter and training call it so).
    x0 = model.embed(tokens)
    alone, _ = model.layers[0](0, x0, positions, attention, None)
    np.testing.assert_array_equal(np.asarray(alone.astype(jnp.bfloat16)), np.asarray(want_taps[0]))


def test_fused_projections_compute_the_same_model(hf_tiny_dirs):
    """The serving layout (q/k/v and gate/up as one weight each) is the same model: logits and
    taps match the checkpoint layout, the old weights are gone, and fusing twice is a no-op."""
    from jspec.qwen3 import fuse_projections
    cfg, model = load_model(hf_tiny_dirs["tiny-untied"])
    tokens = jnp.asarray(_tokens(cfg))
    taps = (0, 1)
    before, tapped_before = forward_logits(model, tokens, tap_layers=taps)
    q0 = np.asarray(model.layers[0].self_attn.q_proj[...])
    fuse_projections(model)
    fuse_projections(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    assert attn.qkv_proj.shape == (cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)
    assert mlp.gate_up_proj.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(attn.qkv_proj[...])[:cfg.num_heads], q0)
    after, tapped_after = forward_logits(model, tokens, tap_layers=taps)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), atol=1e-5, rtol=1e-5)
    for a, b in zip(tapped_after, tapped_before):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(before)).max() > 0.1  # not a vacuous comparison of zeros
    # ...and back: the checkpoint layout, bit for bit (what checkpoint writers rely on).
    from jspec.qwen3 import unfuse_projections
    unfuse_projections(model)
    unfuse_projections(model)
    assert not hasattr(attn, "qkv_proj") and not hasattr(mlp, "gate_up_proj")
    np.testing.assert_array_equal(np.asarray(attn.q_proj[...]), q0)
    assert attn.v_proj.shape == (cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)
    assert mlp.up_proj.shape == (cfg.intermediate_size, cfg.hidden_size)


def test_linear_impl_plumbing_gives_the_same_model(hf_tiny_dirs, monkeypatch):
    """The serving layout's other matmul route (kernels/linear.py "triton": 2-D x [M, K] @ w [N, K]^T,
    GPU only) gets its operands reshaped right: with the kernel stood in for by the XLA twin (and
    a check that every call is 2-D), logits and taps equal the default route's."""
    import jspec.kernels.linear_triton as lt
    from jspec.kernels.linear import linear_xla
    from jspec.qwen3 import fuse_projections
    calls = []

    def stand_in(x, w, **kw):
        assert x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1]
        calls.append(w.shape)
        return linear_xla(x, w)

    def partials_stand_in(x, w, **kw):  # two split partials over the halves of K, as the kernel
        stand_in(x, w)
        h = x.shape[1] // 2
        return jnp.stack([linear_xla(x[:, :h], w[:, :h]), linear_xla(x[:, h:], w[:, h:])])

    monkeypatch.setattr(lt, "linear_triton", stand_in)
    monkeypatch.setattr(lt, "linear_triton_partials", partials_stand_in)
    # The norms follow the matmul route (qwen3._set_linear_impl): their kernels are GPU-only too.
    import jspec.kernels.reductions as red
    import jspec.kernels.rowwise_triton as rw
    monkeypatch.setattr(rw, "rms_norm_triton", lambda x, w, eps, f32_out=False: red.rms_norm_xla(
        x, w, eps, jnp.float32 if f32_out else None))
    monkeypatch.setattr(rw, "add_rms_norm_triton", red.add_rms_norm_xla)
    monkeypatch.setattr(rw, "qk_norm_rope_triton", lambda x, *a: red.qk_norm_rope_xla(
        red.sum_in_order(x), *a))
    monkeypatch.setattr(red, "check_impl", lambda impl: None)
    cfg, model = load_model(hf_tiny_dirs["tiny-untied"])
    tokens = jnp.asarray(_tokens(cfg))
    fuse_projections(model)
    want, want_taps = forward_logits(model, tokens, tap_layers=(0, 2))
    fuse_projections(model, linear_impl="triton")
    got, got_taps = forward_logits(model, tokens, tap_layers=(0, 2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for a, b in zip(got_taps, want_taps):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    assert len(calls) == 4 * cfg.num_layers + 1 and calls[-1] == (V, D)
    assert calls[:4] == [((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, D),
                         (D, cfg.num_heads * cfg.head_dim), (2 * F, D), (D, F)]
