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
    """The peer as `jspec bench` starts it (peer_process): it writes every pass's tokens."""
    from jspec.bench.run import peer_process

    job = {"model": str(hf_tiny_dirs["tiny-untied"]), "prompts": [[1, 2, 3], [4, 5, 6, 7]],
           "max_new_tokens": 5, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
           "seeds": [[1, 2], [3, 4]], "eos_ids": [], "passes": 2}
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "peer.json"
    argv, env = peer_process(tmp_path / "job.json", out)
    run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    rec = json.loads(out.read_text())
    assert rec["tokens"] == [10, 10] and len(rec["passes"]) == 2 and rec["tokens_per_s"] > 0


def test_peer_process_cannot_see_the_repos_kernels_package(tmp_path, monkeypatch):
    """transformers (5.17 on the GPU machine) imports any top-level `kernels` it can find at
    start-up; run from the repo root with the root on PYTHONPATH it found jspec's kernels/ and the
    peer died before loading the model. The peer's process must not see the repo root, whatever
    PYTHONPATH holds, while other PYTHONPATH entries survive."""
    import ast

    from jspec.bench.run import REPO_ROOT, peer_process

    other = tmp_path / "site"
    other.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{REPO_ROOT}:{other}")
    argv, env = peer_process(tmp_path / "job.json", tmp_path / "out.json")
    assert argv[1] == "-P" and argv[2].endswith("jspec/bench/peer.py")
    probe = ("import importlib.util, sys; s = importlib.util.find_spec('kernels'); "
             "print(s.origin if s else None); print(sys.path)")
    out = subprocess.run([argv[0], "-P", "-c", probe], env=env, cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] != str(REPO_ROOT / "kernels" / "__init__.py")  # None, or Hugging Face's package
    path = ast.literal_eval(out[1])
    assert str(other) in path and str(REPO_ROOT) not in path and "" not in path
