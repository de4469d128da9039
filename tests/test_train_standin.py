"""scripts/train_standin.py end to end at toy size on CPU, in the stand-in's real configuration
(Qwen3 tokenizer, compact vocabulary, chat-form tasks, replies through the engine on the expanded
S), split as on the GPU machine: a first run that stops after the replies, and a second that
resumes without the corpus and trains the drafter. Then scripts/standin_transfer.py brings the
weights back exactly as int8 x bf16 rows."""

import importlib.util
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py", "fnmatch.py"):
        src = Path(json_module_dir()).parent / name
        (corpus / name.replace("/", "_")).write_text(src.read_text())
    out = tmp_path_factory.mktemp("run")
    common = ["--corpus", str(corpus), "--out", str(out), "--tokenizer", "qwen3", "--compact-rows", "512",
              "--chat-tasks", "40", "--hidden", "32", "--layers", "6", "--heads", "2", "--kv-heads", "1",
              "--head-dim", "16", "--ffn", "64", "--seq-len", "128", "--batch", "2", "--target-steps", "6",
              "--eval-every", "3", "--eval-rows", "2", "--heldout-fraction", "0.2", "--prompts", "6",
              "--eval-prompts", "2", "--prompt-min", "16", "--prompt-max", "120", "--reply-tokens", "8",
              "--reply-lanes", "4", "--draft-seq-len", "160", "--draft-layers", "1", "--anchors", "4",
              "--markov-rank", "4", "--draft-batch", "2", "--draft-steps", "3", "--skip-dflash",
              "--compute-dtype", "float32", "--export-dtype", "float32", "--ckpt-every", "3",
              "--no-remat", "--quiet", "--reply-t1", "--short-seq-len", "64", "--long-every", "2"]
    ts = _script("train_standin")
    ts.main(common + ["--only-target"])
    first = {p.name for p in out.iterdir()}
    with pytest.raises(SystemExit, match="replies are not all in"):  # the T = 1 set is not there yet
        ts.main(common + ["--reply-sets", "train,eval"])
    # the reply sets as two processes would sample them side by side (one per GPU)
    ts.main(common + ["--stop-after-replies", "--reply-sets", "train_t1"])
    ts.main(common + ["--only-drafter", "dspark"])
    return out, first


def json_module_dir():
    import json as j
    return Path(j.__file__).parent


def test_calls_resume_from_s_and_its_prompts_then_replies_then_one_drafter(trained):
    out, first = trained
    assert {"manifest.json", "target", "data"} <= first and "dspark" not in first
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["file_count"] == 5 and len(manifest["sha256"]) == 64
    hf = json.loads((out / "target" / "config.json").read_text())
    assert hf["vocab_size"] == 512 and "jspec_shared_row" in hf and hf["jspec_id_to_row"]["151669"] == 511
    replies = [json.loads(l) for l in (out / "data" / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == 6 and all(1 <= len(r["reply_ids"]) <= 8 for r in replies)
    assert any(t >= 512 for r in replies for t in r["prompt_ids"])  # full Qwen3 ids, not rows
    d = json.loads((out / "dspark" / "config.json").read_text())
    assert d["mask_token_id"] == 511 and d["num_hidden_layers"] == 1
    full = json.loads((out / "full" / "dspark" / "config.json").read_text())
    assert full["mask_token_id"] == 151669 and full["vocab_size"] == 151936
    t1 = [json.loads(l) for l in (out / "data" / "replies_t1.jsonl").read_text().splitlines()]
    assert [r["prompt_ids"] for r in t1] == [r["prompt_ids"] for r in replies]  # same prompts, T = 1
    summary = json.loads((out / "summary_dspark.json").read_text())
    assert summary["dspark"]["metrics"]["steps"] == 3 and "dflash" not in summary
    assert not (out / "dflash").exists()
    log = [json.loads(l) for l in (out / "logs" / "target.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 7))


def test_transfer_round_trip_is_int8_rows_times_bf16_scales(trained, tmp_path):
    out, _ = trained
    tr = _script("standin_transfer")
    tr.save({"target": out / "target", "dspark": out / "dspark"}, tmp_path / "x", max_mib=0.05)
    assert len(list((tmp_path / "x").glob("xfer-*.npz"))) > 2  # sharded under the size cap
    tr.load(tmp_path / "x", tmp_path / "back")
    for name in ("target", "dspark"):
        a = load_file(str(out / name / "model.safetensors"))
        b = load_file(str(tmp_path / "back" / name / "model.safetensors"))
        assert set(a) == set(b)
        for k, w in a.items():
            if w.ndim == 2:
                q, s = tr.quantize_rows(w)
                np.testing.assert_array_equal(b[k], q.astype(np.float32) * s.astype(np.float32)[:, None])
                assert np.abs(q).max() <= 127
                err = np.abs(b[k] - w).max(axis=1) / np.maximum(np.abs(w).max(axis=1), 1e-30)
                assert err.max() <= 1 / 127 + 1e-6
            else:
                np.testing.assert_array_equal(b[k], w.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert (tmp_path / "back" / name / "config.json").read_text() == (out / name / "config.json").read_text()
