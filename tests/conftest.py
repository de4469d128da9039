import os
import zlib
import sys
from pathlib import Path

import pytest

# Tests compare against fp32 references: keep XLA on exact fp32 matmuls on CPU.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def hf_tiny_dirs(tmp_path_factory):
    """Random transformers Qwen3 checkpoints, tied (0.6B-style) and untied (8B-style)."""
    from hf_models import make_hf_qwen3
    from jspec.config import PRESETS

    dirs = {}
    for name in ("tiny-tied", "tiny-untied"):
        d = tmp_path_factory.mktemp(name)
        make_hf_qwen3(PRESETS[name], d, seed=zlib.crc32(name.encode()) % 1000)
        dirs[name] = d
    return dirs


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every test module's compiled programs when it ends. One pytest process compiles
    hundreds of programs; kept for the whole run they pile up (a late XLA compile once crashed
    in CI after 30 minutes of them), and no test reuses another module's programs."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
