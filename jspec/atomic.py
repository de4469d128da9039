"""Directories written all at once: built beside their destination and renamed into place."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(dst: str | Path):
    """Yields an empty temporary sibling of `dst` to build in. On success it becomes `dst` (an old
    `dst` is moved aside first and removed only after the rename); on any error it is removed and
    `dst` is left as it was."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            os.replace(dst, old)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not dst.exists():
            os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
