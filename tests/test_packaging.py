"""The repo's top-level kernels/ directory ships as jspec.kernels; run from the repo root it must not
shadow Hugging Face's `kernels` package, which transformers imports at start-up."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_in_repo_root(code: str) -> subprocess.CompletedProcess:
    # `python -c` puts the current directory (here the repo root) first on sys.path, as `python -m` does.
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_top_level_kernels_is_not_the_repo_directory():
    code = ("import sys, kernels, jspec.kernels as jk\n"
            "print(kernels.__file__); print(jk.__file__)\n"
            "assert sys.modules['kernels'] is kernels\n")
    out = _run_in_repo_root(code)
    if out.returncode != 0:
        # Without Hugging Face's package installed, the import fails and says what to import instead.
        assert "jspec.kernels" in out.stderr, out.stderr
        return
    top, ours = out.stdout.split()
    assert Path(ours).parent == REPO / "kernels"
    assert Path(top).parent != REPO / "kernels"


def test_without_hub_kernels_the_error_names_jspec_kernels():
    # Only the repo root and the standard library on the path: no other `kernels` can be found.
    code = ("import sys, sysconfig\n"
            f"sys.path[:] = [{str(REPO)!r}, sysconfig.get_paths()['stdlib']]\n"
            "import kernels\n")
    out = _run_in_repo_root(code)
    assert out.returncode != 0
    assert "import it as jspec.kernels" in out.stderr, out.stderr


def test_transformers_qwen3_imports_from_the_repo_root():
    out = _run_in_repo_root("from transformers import Qwen3ForCausalLM")
    assert out.returncode == 0, out.stderr[-2000:]
