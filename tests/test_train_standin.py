"""scripts/train_standin.py end to end at toy size on CPU, in the stand-in's real configuration
(Qwen3 tokenizer, compact vocabulary, chat-form tasks, replies through the engine on the expanded
S), split as on the GPU machine: a first run that stops after the replies, and a second that
resumes without the corpus and trains the drafter. Then scripts/standin_transfer.py brings the
weights back exactly as int8 x bf16 rows."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


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
    ts = load_script("train_standin")
    ts.main(common + ["--only-target"])
    first = {p.name for p in out.iterdir()}
    with pytest.raises(SystemExit, match="replies are not all in"):  # the T = 1 set is not there yet
        ts.main(common + ["--reply-sets", "train,eval"])
    # the reply sets as two processes would sample them side by side (one per GPU)
    with pytest.raises(SystemExit, match="unknown set.*eval_t2"):
        ts.main(common + ["--stop-after-replies", "--reply-sets", "train_t1,eval_t2"])
    ts.main(common + ["--stop-after-replies", "--reply-sets", "train_t1,eval_t1"])
    ts.main(common + ["--only-drafter", "dspark"])
    return out, first, common


def json_module_dir():
    import json as j
    return Path(j.__file__).parent


def test_calls_resume_from_s_and_its_prompts_then_replies_then_one_drafter(trained):
    out, first, _ = trained
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
    evals = [json.loads(l) for l in (out / "data" / "replies_eval.jsonl").read_text().splitlines()]
    eval_t1 = [json.loads(l) for l in (out / "data" / "replies_eval_t1.jsonl").read_text().splitlines()]
    assert [r["prompt_ids"] for r in eval_t1] == [r["prompt_ids"] for r in evals]  # held out, T = 1
    summary = json.loads((out / "summary_dspark.json").read_text())
    assert summary["dspark"]["metrics"]["steps"] == 3 and "dflash" not in summary
    for stage in ("untrained", "trained"):  # evaluated on the greedy and the T = 1 held-out replies
        m = summary["dspark"]["metrics"][stage]
        assert {"tau_prob", "c_star_1", "t1_tau_prob", "t1_c_star_1"} <= set(m)
        assert 1.0 <= m["t1_tau_prob"] <= 8.0 and 0.0 <= m["t1_c_star_1"] <= 1.0
    assert not (out / "dflash").exists()
    log = [json.loads(l) for l in (out / "logs" / "target.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 7))


def test_transfer_round_trip_is_int8_rows_times_bf16_scales(trained, tmp_path):
    out, _, _ = trained
    tr = load_script("standin_transfer")
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


def test_a_drafter_continues_from_given_weights(trained, tmp_path):
    """--init-drafter: a later run starts from a trained drafter (here at a vanishing learning
    rate, so what it exports is what it started from); a drafter of other shapes is refused."""
    import shutil

    from safetensors.numpy import load_file
    out, _, common = trained
    out2 = tmp_path / "run2"
    out2.mkdir()
    for name in ("target", "data"):
        shutil.copytree(out / name, out2 / name)
    shutil.copy(out / "manifest.json", out2 / "manifest.json")
    argv = [a if a != str(out) else str(out2) for a in common]
    ts = load_script("train_standin")
    with pytest.raises(SystemExit, match="not a drafter of this run's shapes"):
        ts.main(argv + ["--only-drafter", "dspark", "--init-drafter", f"dspark={out / 'dspark'}",
                        "--markov-rank", "8"])  # the given drafter's Markov head has rank 4
    ts.main(argv + ["--only-drafter", "dspark", "--init-drafter", f"dspark={out / 'dspark'}",
                    "--draft-lr", "1e-12"])
    before, after = load_file(out / "dspark" / "model.safetensors"), load_file(out2 / "dspark" / "model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_allclose(after[k], before[k], atol=1e-6, err_msg=k)
    # ... and not what a fresh start would have given
    fresh = tmp_path / "run3"
    shutil.copytree(out2, fresh, ignore=shutil.ignore_patterns("dspark", "ckpt", "logs", "full", "summary*"))
    ts.main([a if a != str(out) else str(fresh) for a in common] + ["--only-drafter", "dspark", "--draft-lr", "1e-12"])
    other = load_file(fresh / "dspark" / "model.safetensors")
    moved = max(float(np.abs(other[k] - before[k]).max()) for k in before)
    assert moved > 1e-4, moved  # three toy training steps moved the given drafter this far


def test_a_given_s_is_kept_and_its_vocabulary_checked(trained, tmp_path):
    """S placed in OUT/target beforehand (gpu_train_standin.sh CONTINUE=1) is not retrained, and
    a corpus that gives another compact vocabulary is refused by name."""
    import shutil
    out, _, common = trained
    corpus = Path(common[common.index("--corpus") + 1])
    ts = load_script("train_standin")
    kept = tmp_path / "kept"
    shutil.copytree(out / "target", kept / "target")
    weights = (kept / "target" / "model.safetensors").read_bytes()
    ts.main([a if a != str(out) else str(kept) for a in common] + ["--only-target"])
    assert (kept / "target" / "model.safetensors").read_bytes() == weights  # not retrained
    assert not (kept / "logs" / "target.jsonl").exists() and (kept / "data" / "prompts.jsonl").is_file()
    other_corpus = tmp_path / "corpus2"
    other_corpus.mkdir()
    for f in sorted(corpus.iterdir())[:2]:  # a smaller corpus: other frequent ids
        shutil.copy(f, other_corpus / f.name)
    other = tmp_path / "other"
    shutil.copytree(out / "target", other / "target")
    argv = [a if a != str(out) else str(other) for a in common]
    argv[argv.index("--corpus") + 1] = str(other_corpus)
    with pytest.raises(SystemExit, match="compact vocabulary is not the one this corpus gives"):
        ts.main(argv + ["--only-target"])


def test_prompt_seed_draws_other_training_prompts_on_the_same_held_out_set(trained, tmp_path):
    """--prompt-seed (gpu_train_standin's PROMPT_SEED): another draw of training prompts from the
    same corpus, while the held-out prompts (what every session's eval reads) stay the run seed's."""
    import shutil
    out, _, common = trained
    run = tmp_path / "reseeded"
    shutil.copytree(out / "target", run / "target")
    load_script("train_standin").main([a if a != str(out) else str(run) for a in common]
                                  + ["--only-target", "--prompt-seed", "5"])
    read = lambda d, n: (d / "data" / f"{n}.jsonl").read_text()  # noqa: E731
    assert read(run, "prompts_eval") == read(out, "prompts_eval")
    assert read(run, "prompts") != read(out, "prompts")
    assert len(read(run, "prompts").splitlines()) == len(read(out, "prompts").splitlines())


def test_a_quarter_of_the_training_prompts_ask_for_a_function_in_words(trained):
    """--described-tasks (0.25): of the 6 training prompts, 2 ask for a function in one sentence
    made from a corpus docstring, up to 3 are code tasks, the rest corpus windows; the held-out
    prompts have none."""
    from jspec.tokenizer import Tokenizer
    from jspec.train.data import DESCRIPTION_TEMPLATES
    out, _, _ = trained
    tok = Tokenizer.qwen3()
    openers = tuple(t.split("{task}")[0] for ts in DESCRIPTION_TEMPLATES.values() for t in ts)
    user_turns = lambda n: [tok.decode(json.loads(line)["prompt_ids"], skip_special_tokens=False)  # noqa: E731
                            for line in (out / "data" / f"{n}.jsonl").read_text().splitlines()]
    train = user_turns("prompts")
    described = [t for t in train if t.startswith("<|im_start|>user\n")
                 and t.split("\n", 1)[1].startswith(openers)]
    assert len(train) == 6 and len(described) == 2, train
    assert all("```" not in t for t in described)
    # code tasks longer than --prompt-max are dropped and windows take their place
    assert 1 <= sum("```python" in t for t in train) <= 3
    assert not any(t.split("\n", 1)[-1].startswith(openers) for t in user_turns("prompts_eval"))


def test_the_ce_ablation_trains_dspark_on_cross_entropy_alone(trained):
    """--only-drafter dspark_ce: DSpark's architecture (Markov head, confidence head) on the CE-only
    objective, beside the others in the same run directory."""
    out, _, common = trained
    load_script("train_standin").main(common + ["--only-drafter", "dspark_ce"])
    cfg = json.loads((out / "dspark_ce" / "config.json").read_text())
    dspark = json.loads((out / "dspark" / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "_name_or_path"} == {
        k: v for k, v in dspark.items() if k != "_name_or_path"}  # the same drafter shape
    summary = json.loads((out / "summary_dspark_ce.json").read_text())
    assert summary["dspark_ce"]["metrics"]["steps"] == 3 and "dspark" not in summary
    log = [json.loads(l) for l in (out / "logs" / "dspark_ce.jsonl").read_text().splitlines()]
    last = [r for r in log if "loss" in r][-1]
    assert last["loss"] == pytest.approx(last["ce"] + last["conf"], rel=1e-5)  # no L1 term
    # ...where DSpark's own objective weighs it in (0.1 CE + 0.9 L1 + confidence BCE)
    last = [r for r in (json.loads(l) for l in (out / "logs" / "dspark.jsonl").read_text().splitlines())
            if "loss" in r][-1]
    assert last["loss"] == pytest.approx(0.1 * last["ce"] + 0.9 * last["l1"] + last["conf"], rel=1e-5)


def test_joined_rows_and_the_long_prompt_eval_run_end_to_end(trained, tmp_path):
    """--joined-rows trains on rows joined into one sequence; --eval-long-tokens adds a T = 1
    engine eval on busy-like prompts (first turns joined to >= N tokens) to the summary."""
    import shutil
    out, _, common = trained
    prompts_dir = ROOT.parent / "shared" / "data" / "prompts"
    if not (prompts_dir / "humaneval.jsonl").is_file():
        pytest.skip(f"no prompt sets at {prompts_dir}")
    run = tmp_path / "joined"
    run.mkdir()
    for name in ("target", "data", "full"):
        if (out / name).exists():
            shutil.copytree(out / name, run / name, ignore=shutil.ignore_patterns("dspark*"))
    shutil.copy(out / "manifest.json", run / "manifest.json")
    argv = [a if a != str(out) else str(run) for a in common]
    ts = load_script("train_standin")
    with pytest.raises(SystemExit, match="--joined-rows needs --pack-replies"):
        ts.main(argv + ["--only-drafter", "dspark", "--joined-rows", "0.5", "--no-pack-replies"])
    ts.main(argv + ["--only-drafter", "dspark", "--joined-rows", "1.0", "--draft-steps", "2",
                    "--eval-prompts-dir", str(prompts_dir), "--eval-limit", "3", "--eval-max-tokens", "4",
                    "--eval-long-tokens", "300", "--eval-long-count", "2"])
    summary = json.loads((run / "summary_dspark.json").read_text())
    assert summary["args"]["joined_rows"] == 1.0 and summary["dspark"]["metrics"]["steps"] == 2
    long = summary["engine_eval"]["dspark_t1"]["long"]
    assert long["prompts"] == 2 and long["prompt_tokens_mean"] >= 300
    assert 1.0 <= long["tokens_per_step"] <= 8.0
    for rec in (summary["engine_eval"]["dspark_t1"], long):  # what compare_drafters.py pairs
        per = rec["per_request"]
        assert len(per["tokens"]) == len(per["steps"]) >= 2
        assert sum(per["tokens"]) / sum(per["steps"]) == pytest.approx(rec["tokens_per_step"], rel=1e-3)
    assert "long" not in summary["engine_eval"]["dspark_greedy"]
    # the prompts in order: each set's first --eval-limit first turns (compare_drafters splits by it)
    assert summary["engine_eval"]["sets"] == {"humaneval": 3, "mbpp": 3}
    assert len(summary["engine_eval"]["dspark_t1"]["per_request"]["tokens"]) == 6


def test_eval_args_take_the_parsers_defaults():
    """standin_acceptance builds the engine eval's options through eval_args: every option the
    script's parser has gets its default, given values win, unknown names are refused."""
    ts = load_script("train_standin")
    args = ts.eval_args(eval_prompts_dir="p", eval_limit=3)
    full = ts.parse_args(["--corpus", "c", "--out", "o", "--eval-prompts-dir", "p", "--eval-limit", "3"])
    for key, value in vars(args).items():
        assert getattr(full, key) == value, key
    assert args.eval_long_tokens == 0 and args.eval_max_tokens == 256
    with pytest.raises(TypeError, match="eval_limt"):
        ts.eval_args(eval_limt=3)


def test_the_engine_eval_at_t1_only_runs_no_greedy(trained, tmp_path):
    """--eval-samplings t1 (standin_acceptance --samplings t1): the T = 1 figure alone, no greedy
    record and no stock reference; an unknown sampling is refused by name."""
    out, _, _ = trained
    prompts_dir = ROOT.parent / "shared" / "data" / "prompts"
    if not (prompts_dir / "humaneval.jsonl").is_file():
        pytest.skip(f"no prompt sets at {prompts_dir}")
    ts = load_script("train_standin")
    with pytest.raises(ValueError, match="--eval-samplings.*t2"):
        ts.eval_samplings("t1,t2")
    assert ts.eval_samplings("greedy, t1,greedy") == ("greedy", "t1")
    with pytest.raises(SystemExit, match="--eval-samplings"):  # before any training starts
        ts.main(["--corpus", str(tmp_path), "--out", str(tmp_path / "never"),
                 "--eval-samplings", "greedy,tl"])
    assert not (tmp_path / "never").exists()
    args = ts.eval_args(eval_prompts_dir=str(prompts_dir), eval_limit=1, eval_max_tokens=4,
                        eval_samplings="t1")
    rec = ts.stage_engine_eval(args, tmp_path, out / "full" / "target",
                               {"dspark": out / "full" / "dspark"}, tmp_path / "eval.json")
    assert "dspark_t1" in rec and "dspark_greedy" not in rec
    assert 1.0 <= rec["dspark_t1"]["tokens_per_step"] <= 8.0
    assert json.loads((tmp_path / "eval.json").read_text())["sets"] == {"humaneval": 1, "mbpp": 1}


def test_standin_acceptance_refuses_an_unknown_sampling_by_its_own_option(tmp_path, capsys):
    sa = load_script("standin_acceptance")
    with pytest.raises(SystemExit) as exit_info:
        sa.main(["--prompts-dir", str(tmp_path), "--samplings", "t1,t3", "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2
    assert "--samplings: choose from t1, greedy, not ['t3']" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
