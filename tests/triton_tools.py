"""Shared plumbing of the Triton kernel tests (not a test module): running a test file's
`--interpret-worker` under Triton's CPU interpreter, and ptxas's resource report of sm_90 PTX."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpret_worker(test_file: str, work: Path) -> None:
    """`python test_file --interpret-worker work` with TRITON_INTERPRET=1 (the interpreter is
    chosen when Triton is imported, so it needs a process of its own); fails the calling test
    with the worker's output if it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, test_file, "--interpret-worker", str(work)], env=env,
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(test_file).resolve().parent)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"


def ptxas_report(ptx: str, tag: str) -> str:
    """ptxas -v for sm_90a on `ptx` (its stderr: registers, spills), or "" when Triton ships no
    ptxas."""
    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return ""
    ptx_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{tag}_{os.getpid()}.ptx"
    ptx_path.write_text(ptx)
    return subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx_path), "-o",
                           str(ptx_path.with_suffix(".cubin"))], capture_output=True,
                          text=True).stderr
