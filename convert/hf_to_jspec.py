"""`jspec convert SRC DST`: a Hugging Face Qwen3 directory -> a jspec directory (Orbax weights).

Atomic: everything is written into a hidden sibling of DST and renamed into place only when
complete, so a failed or interrupted conversion leaves no DST behind (and, with --force, the old
DST stays intact until the new one is whole).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jspec.atomic import atomic_dir
from jspec.loading import (JSPEC_MARKER, ORBAX_SUBDIR, check_model_dir, drafter_shared_fingerprints,
                           is_drafter_dir, load_model, save_orbax)

# Files that travel with the weights so the jspec directory is a complete model directory.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt")


def convert_checkpoint(src: str | Path, dst: str | Path, *, force: bool = False,
                       dtype: str | None = None, progress: bool = True) -> Path:
    src = check_model_dir(src)
    dst = Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError("convert: DST must differ from SRC")
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists; pass --force to overwrite it")
    with atomic_dir(dst) as tmp:
        marker = {"format": "jspec-orbax", "version": 1, "source": str(src.resolve())}
        if is_drafter_dir(src):
            cfg, model = _load_drafter_alone(src, dtype, progress)
            # The embedding / lm_head copies are dropped (the target's arrays are used); their
            # fingerprints let loading check once that they are the target's.
            marker.update(kind="dspark", shared_fingerprints=drafter_shared_fingerprints(src))
            dtype_out = cfg.layers.dtype
        else:
            cfg, model = load_model(src, dtype=dtype, progress=progress)
            marker.update(kind="qwen3")
            dtype_out = cfg.dtype
        marker["dtype"] = dtype_out
        if progress:
            print(f"writing Orbax checkpoint ({dtype_out}) ...", flush=True)
        save_orbax(model, tmp / ORBAX_SUBDIR)
        for name in SIDE_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        hf_config = json.loads((src / "config.json").read_text())
        for key in ("dtype", "torch_dtype"):  # transformers 5 / 4 spellings
            hf_config[key] = dtype_out
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        # The marker is written last: a directory without it is never taken for a jspec one.
        (tmp / JSPEC_MARKER).write_text(json.dumps(marker, indent=2))
    return dst


def _load_drafter_alone(src: Path, dtype: str | None, progress: bool):
    from jspec.dspark import DSparkConfig, SHARED_WITH_TARGET, abstract_drafter, drafter_checkpoint_shapes
    from jspec.loading import stream_safetensors
    cfg = DSparkConfig.from_dir(src, dtype=dtype)
    drafter, _ = stream_safetensors(src, abstract_drafter(cfg), drafter_checkpoint_shapes(cfg),
                                    optional=frozenset(SHARED_WITH_TARGET), progress=progress)
    return cfg, drafter
