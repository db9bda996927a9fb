"""convert/hf.py through scripts/convert_hf.py: what a Hugging Face folder converts to, and how bad
folders are refused (one clear line, exit code != 0, nothing written)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint import load_checkpoint
from convert import ConversionError, convert_hf_folder
from convert.hf import model_args_from_hf_config
from model import ModelArgs
from script_testing import assert_one_line_error, run_script


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


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Llama-2-7b", "Qwen2.5-Coder-0.5B", "Qwen3-0.6B", "Qwen3-8B",
                                  "SmolLM2-135M"])
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
        "Qwen2.5-Coder-0.5B": dict(architectures=["Qwen2ForCausalLM"], hidden_act="silu", hidden_size=896,
                                   intermediate_size=4864, max_position_embeddings=32768, max_window_layers=24,
                                   model_type="qwen2", num_attention_heads=14, num_hidden_layers=24,
                                   num_key_value_heads=2, rms_norm_eps=1e-06, rope_theta=1000000.0,
                                   sliding_window=32768, tie_word_embeddings=True, use_sliding_window=False,
                                   vocab_size=151936),
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


@pytest.mark.parametrize("changes", [dict(use_sliding_window=True),
                                     dict(layer_types=["full_attention", "sliding_attention"])])
def test_sliding_window_attention_is_refused(changes):
    config = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_hidden_layers=2, vocab_size=256, **changes)
    with pytest.raises(ConversionError, match="sliding-window attention is not supported"):
        model_args_from_hf_config(config)


def test_unsupported_rope_scaling_is_named():
    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_hidden_layers=2, vocab_size=256, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConversionError, match="rope scaling type 'yarn'"):
        model_args_from_hf_config(config)


def test_corrupt_weights_file(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "config.json", bad)
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    done = run_script("convert_hf.py", bad, "--out", tmp_path / "out")
    assert_one_line_error(done, "cannot read", "model.safetensors")
    assert not (tmp_path / "out").exists()


def folder_with_config(folder: Path, target: Path, **changes) -> Path:
    """A copy of `folder` whose config.json has `changes` (a value of None removes the key)."""
    target.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    (target / "model.safetensors").symlink_to(folder / "model.safetensors")
    return target


@pytest.mark.parametrize("changes, message", [
    (dict(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (dict(num_hidden_layers="2"), "num_hidden_layers must be a positive integer, got '2'"),
    (dict(num_hidden_layers=2.5), "num_hidden_layers must be a positive integer, got 2.5"),
    (dict(hidden_size=-64), "hidden_size must be a positive integer, got -64"),
    (dict(vocab_size=None), "it has no 'vocab_size'"),
])
def test_bad_config_values_are_refused_by_name(changes, message, tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = folder_with_config(folder, tmp_path / "bad", **changes)
    with pytest.raises(ConversionError, match=message.replace("(", r"\(")) as error:
        convert_hf_folder(bad, tmp_path / "out")
    assert "config.json" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_bad_config_exits_with_code_2_and_one_line(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = folder_with_config(folder, tmp_path / "bad", num_attention_heads=0)
    done = run_script("convert_hf.py", bad, "--out", tmp_path / "out")
    assert_one_line_error(done, "num_attention_heads must be a positive integer")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


class Payload:
    """A pickled object that is not a tensor: what a malicious pytorch_model.bin would carry."""


@pytest.mark.parametrize("content, message", [
    (lambda path: torch.save({"model.embed_tokens.weight": Payload()}, path), "Python objects besides tensors"),
    (lambda path: path.write_bytes(b"\x00garbage" * 100), "cannot read"),
    (lambda path: torch.save([torch.zeros(2)], path), "not a dict of tensors"),
])
def test_bad_pytorch_model_bin_is_one_line(content, message, tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "config.json", bad)
    content(bad / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=message) as error:
        convert_hf_folder(bad, tmp_path / "out")
    assert "pytorch_model.bin" in str(error.value)
    assert not (tmp_path / "out").exists()


def test_refused_pickle_exits_with_code_2(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "config.json", bad)
    torch.save({"model.embed_tokens.weight": Payload()}, bad / "pytorch_model.bin")
    done = run_script("convert_hf.py", bad, "--out", tmp_path / "out")
    assert_one_line_error(done, "pytorch_model.bin", "Python objects besides tensors")
    assert done.returncode == 2


@pytest.mark.parametrize("flag", [None, "--gguf", "--llama2c"])
def test_a_file_that_is_no_model_exits_with_code_2(flag, tmp_path):
    (tmp_path / "random.pth").write_bytes(bytes(range(256)) * 64)
    done = run_script("convert_hf.py", *([flag] if flag else []), tmp_path / "random.pth", "--out", tmp_path / "out")
    assert_one_line_error(done, "random.pth")
    assert done.returncode == 2
    assert not (tmp_path / "out").exists()
