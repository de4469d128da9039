"""`jspec convert SRC DST`: a Hugging Face Qwen3 directory -> a jspec directory (Orbax weights).

Atomic: everything is written into a hidden sibling of DST and renamed into place only when
complete, so a failed or interrupted conversion leaves no DST behind (and, with --force, the old
DST stays intact until the new one is whole).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from jspec.loading import JSPEC_MARKER, ORBAX_SUBDIR, check_model_dir, load_model, save_orbax

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
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        cfg, model = load_model(src, dtype=dtype, progress=progress)
        tmp.mkdir()
        if progress:
            print(f"writing Orbax checkpoint ({cfg.dtype}) ...", flush=True)
        save_orbax(model, tmp / ORBAX_SUBDIR)
        for name in SIDE_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        hf_config = json.loads((src / "config.json").read_text())
        for key in ("dtype", "torch_dtype"):  # transformers 5 / 4 spellings
            hf_config[key] = cfg.dtype
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        # The marker is written last: a directory without it is never taken for a jspec one.
        (tmp / JSPEC_MARKER).write_text(json.dumps(
            {"format": "jspec-orbax", "version": 1, "kind": "qwen3", "dtype": cfg.dtype,
             "source": str(src.resolve())}, indent=2))
        if dst.exists():
            os.replace(dst, old)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not dst.exists():
            os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return dst
