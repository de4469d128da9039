"""scripts/profile_drafter_train.py: one CPU run at tiny sizes (random target), the JSON it writes,
its graceful trace summary without a GPU, and its refusals of bad options."""

import json

import pytest

from script_loader import load_script


pdt = load_script("profile_drafter_train")

TINY = ["--random-target", "--vocab", "512", "--hidden", "32", "--layers", "4", "--heads", "2",
        "--kv-heads", "1", "--head-dim", "16", "--ffn", "64", "--markov-rank", "4",
        "--draft-layers", "1", "--seq-len", "64", "--anchors", "4", "--steps", "2",
        "--host-sequences", "48", "--attn", "dense"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile_drafter_train")
    out = d / "profile.json"
    returned = pdt.main(TINY + ["--batches", "1,2", "--out", str(out), "--trace", str(d / "trace"),
                                "--trace-steps", "2"])
    return returned, json.loads(out.read_text())


def test_one_record_per_batch_with_consistent_rates(run):
    _, rec = run
    assert rec["synthetic_data"] is True and "synthetic" in rec["data"]["note"]
    assert [r["batch"] for r in rec["records"]] == [1, 2]
    for r in rec["records"]:
        assert "error" not in r
        assert r["compile_s"] > 0 and r["step_ms_median"] > 0 and r["pipelined_step_ms"] > 0
        assert len(r["step_ms_all"]) == 2 and all(t > 0 for t in r["step_ms_all"])
        assert r["steps_per_s"] == pytest.approx(1e3 / r["step_ms_median"])
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 64 * r["steps_per_s"])
        assert r["anchors_per_s"] == pytest.approx(r["batch"] * 4 * r["steps_per_s"])
        assert r["tflops_per_s"] == pytest.approx(r["flops"]["total"] / r["step_ms_median"] / 1e9)
        assert 0 < r["anchor_fill"] <= 1
    # the loss forward and the target forward alone: at the first batch size only (default)
    first, second = rec["records"]
    assert first["loss_forward"]["ms_median"] > 0 and first["target_forward"]["ms_median"] > 0
    assert "loss_forward" not in second
    assert [h["batch"] for h in rec["host_batch"]] == [1, 2]
    assert all(h["total_ms"] > 0 for h in rec["host_batch"])


def test_flops_grow_with_the_batch(run):
    _, rec = run
    one, two = (r["flops"] for r in rec["records"])
    assert two["total"] == pytest.approx(2 * one["total"], rel=1e-6)
    parts = {k: v for k, v in one.items() if k != "total"}
    assert sum(parts.values()) == pytest.approx(one["total"])
    assert all(v > 0 for v in parts.values())
    for r in rec["records"]:  # the count against XLA's own (elementwise ops add a little)
        assert 0.8 < r["xla_flops"] / r["flops"]["total"] < 1.5


def test_trace_without_gpu_says_so(run):
    returned, rec = run
    assert "_trainer" not in returned["records"][0]
    tr = rec["trace"]
    assert tr["batch"] == 1 and len(tr["profiled_step_ms"]) == 2
    if rec["backend"] == "cpu":
        assert tr["top_ops"] == [] and any("needs a GPU" in n for n in tr["notes"])


def test_flops_by_count():
    s = pdt.StepShape(rows=2, seq_len=8, anchors=2, block=3, hidden=4, heads=2, kv_heads=1, head_dim=2,
                      ffn=6, vocab=10, target_layers=3, draft_layers=1, taps=2, markov_rank=0,
                      attn_impl="dense", remat=False)
    f = pdt.step_flops(s)
    layer = 4 * (2 * 4 + 2 * 2) + 3 * 4 * 6  # q, o, k, v, mlp
    assert f["target_layers_fwd"] == 2 * 16 * layer * 3
    assert f["target_attention_fwd"] == 4 * 16 * 8 * 4 * 3
    assert f["vocab_target_fwd"] == 2 * 12 * 4 * 10
    cudnn = pdt.step_flops(pdt.StepShape(**{**s.__dict__, "attn_impl": "cudnn"}))
    assert cudnn["target_attention_fwd"] == pytest.approx(f["target_attention_fwd"] * 4.5 / 8)
    remat = pdt.step_flops(pdt.StepShape(**{**s.__dict__, "remat": True}))
    assert remat["total"] > f["total"]
    # the block attention's keys per block query: its own block (split), every block of the row
    # (masked), its chunk's blocks (chunked; 1,024 anchors in chunks of 128)
    big = {**s.__dict__, "seq_len": 4096, "anchors": 1024, "block": 7}
    per_key = {impl: pdt.step_flops(pdt.StepShape(**{**big, "block_attn": impl}))[
        "drafter_block_attention_fwd"] / (4096 + 7 * n)
        for impl, n in (("split", 1), ("cudnn", 1024), ("cudnn_chunks", 128))}
    assert len({round(v, 6) for v in per_key.values()}) == 1  # the same cost per key


@pytest.mark.parametrize("bad, option", [
    (["--batches", "0"], "--batches"),
    (["--batches", "4,x"], "--batches"),
    (["--batches", ""], "--batches"),
    (["--steps", "0"], "--steps"),
    (["--anchors", "64"], "--anchors"),
    (["--no-packed", "--joined-rows", "0.5"], "--joined-rows"),
])
def test_bad_options_exit_naming_the_option(bad, option, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        pdt.main(TINY + ["--batches", "1", "--out", str(tmp_path / "x.json")] + bad)
    assert exc.value.code == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_device_op_summary_on_a_gpu_shaped_trace(tmp_path):
    """The GPU path of the summary, on a synthetic Perfetto trace: kernels on a stream track of
    /device:GPU:0 summed by name; host events left out."""
    import gzip
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kernels = [("nvjet_gemm_bf16", 0, 300), ("loop_exp_fusion", 300, 100), ("nvjet_gemm_bf16", 400, 300),
               ("cudnn_flash_attention_fwd", 800, 200)]
    ev += [{"ph": "X", "pid": 1, "tid": 7, "name": n, "ts": ts, "dur": d, "args": {"hlo_op": n + ".1"}}
           for n, ts, d in kernels]
    ev.append({"ph": "X", "pid": 2, "tid": 1, "name": "drafter_step_0", "ts": 0, "dur": 1500})
    run_dir = tmp_path / "plugins" / "profile" / "run"
    run_dir.mkdir(parents=True)
    with gzip.open(run_dir / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = pdt.device_op_summary(tmp_path, steps=2, top=2)
    assert s["events_kind"] == "gpu" and s["device_events"] == 4
    assert [o["op"] for o in s["top_ops"]] == ["nvjet_gemm_bf16", "cudnn_flash_attention_fwd"]
    gemm = s["top_ops"][0]
    assert gemm["count"] == 2 and gemm["us_per_step"] == 300 and gemm["share"] == pytest.approx(600 / 900)
    assert gemm["kind"] == "matmul" and gemm["hlo_op"] == "nvjet_gemm_bf16.1"
    assert s["device_us_per_step"] == 450 and s["device_busy_us_per_step"] == 450
    assert s["share_by_kind"]["attention"] == pytest.approx(200 / 900)
