"""checkpoint.py's atomic_write: what lands on disk, and what does not."""
import os
from pathlib import Path

import pytest

from checkpoint import atomic_write


def test_atomic_write_gives_the_file_the_users_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "out.json", lambda tmp: Path(tmp).write_text("{}"))
    finally:
        os.umask(umask)
    assert (tmp_path / "out.json").read_text() == "{}"
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == 0o644  # not a private temp file's 0600
    assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_write_leaves_nothing_when_the_writer_fails(tmp_path):
    (tmp_path / "out.json").write_text("old")

    def half_write(tmp):
        Path(tmp).write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(tmp_path / "out.json", half_write)
    assert (tmp_path / "out.json").read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]
