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
