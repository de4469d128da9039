"""The transformers peer runs end to end (on CPU: a run check; its speed is measured on the GPU)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_peer_script_generates_the_requested_tokens(hf_tiny_dirs, tmp_path):
    out = tmp_path / "peer.json"
    subprocess.run([sys.executable, str(ROOT / "scripts/bench_peer_transformers.py"), "--model",
                    str(hf_tiny_dirs["tiny-untied"]), "--out", str(out), "--device", "cpu",
                    "--prompt-len", "12", "--new-tokens", "6"], check=True, capture_output=True)
    rec = json.loads(out.read_text())
    assert rec["new_tokens_out"] == 6 and rec["tokens_per_s_end_to_end"] > 0
    assert "not compiled" in rec["mode"]


def test_bench_peer_job_honours_prompts_and_passes(hf_tiny_dirs, tmp_path):
    job = {"model": str(hf_tiny_dirs["tiny-untied"]), "prompts": [[1, 2, 3], [4, 5, 6, 7]],
           "max_new_tokens": 5, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
           "seeds": [[1, 2], [3, 4]], "eos_ids": [], "passes": 2}
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "peer.json"
    subprocess.run([sys.executable, "-m", "jspec.bench.peer", "--job", str(tmp_path / "job.json"),
                    "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    rec = json.loads(out.read_text())
    assert rec["tokens"] == [10, 10] and len(rec["passes"]) == 2 and rec["tokens_per_s"] > 0
