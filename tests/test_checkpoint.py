"""checkpoint.py: what atomic_write lands on disk and what it does not; damaged checkpoints refused."""
import os
import signal
import subprocess
import sys
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
    with pytest.raises(CheckpointError, match="not a checkpoint: .*model.pth"):
        load_checkpoint(tmp_path / "model.pth")


REPO = Path(__file__).resolve().parent.parent

# A writer killed mid-write: the temp file is on disk, the rename never happens.
KILLED_WRITER = """
import sys, time
sys.path.insert(0, {repo!r})
from checkpoint import atomic_write

def write_forever(tmp):
    with open(tmp, "wb") as f:
        f.write(b"partial")
        f.flush()
        print("writing", flush=True)
        time.sleep(60)

atomic_write({target!r}, write_forever)
"""


def test_temp_file_of_a_killed_write_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "model.pth"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER.format(repo=str(REPO), target=str(target))],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    orphan = tmp_path / f".model.pth.{child.pid}.tmp"
    assert sorted(os.listdir(tmp_path)) == [orphan.name]  # what SIGKILL leaves behind
    # A live process's temp file (pid 1 is always alive) and files that are not ours stay.
    keep = [tmp_path / ".model.pth.1.tmp", tmp_path / ".model.pth.backup.tmp", tmp_path / ".other.pth.999999999.tmp"]
    for path in keep:
        path.write_bytes(b"keep")
    atomic_write(target, lambda tmp: Path(tmp).write_bytes(b"complete"))
    assert target.read_bytes() == b"complete"
    assert sorted(os.listdir(tmp_path)) == sorted([target.name] + [p.name for p in keep])


def test_truncated_converted_checkpoint(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama-tied")
    convert_hf_folder(folder, tmp_path)
    data = (tmp_path / "model.pth").read_bytes()
    (tmp_path / "model.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.pth"):
        load_checkpoint(tmp_path / "model.pth")
