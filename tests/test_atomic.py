"""atomic_dir: a directory appears whole or not at all, and a failed rewrite keeps the old one."""

import pytest

from jspec.atomic import atomic_dir


def test_success_replaces_and_failure_keeps_the_old_directory(tmp_path):
    dst = tmp_path / "model"
    with atomic_dir(dst) as tmp:
        (tmp / "a.txt").write_text("one")
        assert not dst.exists()  # nothing visible until complete
    assert (dst / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError):
        with atomic_dir(dst) as tmp:
            (tmp / "a.txt").write_text("two")
            raise RuntimeError("interrupted")
    assert (dst / "a.txt").read_text() == "one"
    with atomic_dir(dst) as tmp:
        (tmp / "b.txt").write_text("three")
    assert sorted(p.name for p in dst.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporaries left
