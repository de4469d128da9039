"""scripts/bench_prefill.py: the FLOP count of a prefill chunk and a CPU run of the harness."""

import json

import pytest

from script_loader import load_script


def test_prefill_flops_at_qwen3_8b():
    from jspec.config import PRESETS
    bp = load_script("bench_prefill")
    cfg = PRESETS["qwen3-8b"]
    f = bp.prefill_flops(cfg, 512, 3072)
    # q 4096x4096, k and v 4096x1024 each, o 4096x4096, gate/up/down 4096x12288: 192,937,984 a layer
    assert f["matmul"] == 2 * 512 * 36 * 192_937_984 + 2 * 4096 * 151936
    assert f["attention"] == pytest.approx(4 * 512 * (3072 + 256.5) * 32 * 128 * 36)


def test_harness_on_cpu(tmp_path):
    bp = load_script("bench_prefill")
    out = tmp_path / "pf.json"
    rec = bp.main(["--out", str(out), "--preset", "tiny-untied", "--chunks", "32", "--starts",
                   "0,64", "--reps", "1", "--repeats", "1", "--attn-impl", "xla"])
    saved = json.loads(out.read_text())
    assert [(r["chunk"], r["start"]) for r in saved["rows"]] == [(32, 0), (32, 64)]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in rec["rows"])
    assert "ms_beyond_start_0" in saved["rows"][1] and "ms_beyond_start_0" not in saved["rows"][0]
