"""scripts/download.py: offline it says what to do in one line; online (the hub replaced by a local
folder) it downloads and converts."""
import os
import shutil

import pytest

from checkpoint import load_checkpoint
from script_testing import assert_one_line_error, run_script


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
