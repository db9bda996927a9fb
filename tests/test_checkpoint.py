"""checkpoint.py: what atomic_write lands on disk and what it does not; damaged checkpoints refused."""
import os
from pathlib import Path

import pytest

from checkpoint import CheckpointError, atomic_write, load_checkpoint
from convert import convert_hf_folder


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


def test_corrupt_checkpoint(tmp_path):
    (tmp_path / "model.pth").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt or not a torch checkpoint"):
        load_checkpoint(tmp_path / "model.pth")


def test_truncated_converted_checkpoint(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama-tied")
    convert_hf_folder(folder, tmp_path)
    data = (tmp_path / "model.pth").read_bytes()
    (tmp_path / "model.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.pth"):
        load_checkpoint(tmp_path / "model.pth")
