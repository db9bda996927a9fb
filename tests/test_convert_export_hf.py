"""convert/export_hf.py and scripts/export_hf.py: the exported folder loads in transformers unchanged
and gives our model's logits (the import tests' tolerance, test_model.TOLERANCE), packed layers
come back as exact zeros, and export -> convert_hf reproduces the checkpoint bit for bit."""
import json

import pytest
import torch

import sparse
from checkpoint import load_checkpoint, save_checkpoint
from conftest import TINY_HF_CONFIGS
from convert import convert_hf_folder, export_to_hf
from generate import load_model
from script_testing import assert_one_line_error, run_script
from test_model import assert_logits_match

transformers = pytest.importorskip("transformers")


def pack_checkpoint(dense_path, out_path, pattern="2:4"):
    """Every block linear of a dense checkpoint packed to `pattern` (largest |w| kept), the way
    prune/ writes a packed checkpoint (a stand-in pruned model)."""
    state_dict, config, metadata = load_checkpoint(dense_path, mmap=False)
    layers = [k[:-len(".weight")] for k in state_dict if k.startswith("layers.") and k.endswith(("wqkv.weight",
              "wo.weight", "w13.weight", "w2.weight"))]
    for layer in layers:
        values, mask = sparse.pack(state_dict.pop(f"{layer}.weight"), pattern)
        state_dict[f"{layer}.values"], state_dict[f"{layer}.mask"] = values, mask
    metadata = dict(metadata, sparsity=dict(pattern=pattern, format="bitmask-v2", layers=layers),
                    tokenizer_dir=str(dense_path.parent))
    save_checkpoint(out_path, state_dict, config, metadata)
    return out_path


def load_exported(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def ours_with_cache(checkpoint, seq_len):
    model = load_model(checkpoint, "cpu", torch.float32)
    model.setup_caches(1, seq_len)
    return model


@pytest.mark.parametrize("name", list(TINY_HF_CONFIGS))
def test_exported_folder_gives_our_logits_in_transformers(tiny_hf_folder, tmp_path, name):
    folder, _ = tiny_hf_folder(name)
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.float32)
    export_to_hf(tmp_path / "ours" / "model.pth", tmp_path / "hf")
    exported = load_exported(tmp_path / "hf")
    assert type(exported).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert exported.config.tie_word_embeddings == TINY_HF_CONFIGS[name][1]["tie_word_embeddings"]
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours_with_cache(tmp_path / "ours" / "model.pth", 64), exported, tokens)


def test_dense_round_trip_is_bit_identical_through_shards(tiny_hf_folder, tmp_path, monkeypatch):
    monkeypatch.setattr("convert.export_hf.MAX_SHARD_SIZE", "40KB")
    folder, _ = tiny_hf_folder("llama31")
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.bfloat16)
    export_to_hf(tmp_path / "ours" / "model.pth", tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    convert_hf_folder(tmp_path / "hf", tmp_path / "again", dtype=torch.bfloat16)
    before, config, _ = load_checkpoint(tmp_path / "ours" / "model.pth")
    after, config_after, _ = load_checkpoint(tmp_path / "again" / "model.pth")
    assert config_after == config and before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_packed_checkpoint_exports_exact_zeros_and_our_logits(tiny_hf_folder, tmp_path):
    from safetensors.torch import load_file

    folder, _ = tiny_hf_folder("qwen3")
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.float32)
    packed = pack_checkpoint(tmp_path / "ours" / "model.pth", tmp_path / "packed.pth")
    export_to_hf(packed, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    for name, weight in tensors.items():
        if name.endswith("_proj.weight"):  # every kept group of 4 along the input holds exactly 2 zeros
            assert ((weight.reshape(weight.shape[0], -1, 4) == 0).sum(-1) == 2).all(), name
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours_with_cache(packed, 64), load_exported(tmp_path / "hf"), tokens)


def test_smollm2_export_matches_ours_and_keeps_the_tokenizer(smollm2_checkpoint, tmp_path):
    from tokenizer import load_tokenizer

    export_to_hf(smollm2_checkpoint, tmp_path / "hf")
    exported = load_exported(tmp_path / "hf")
    ours_tokenizer = load_tokenizer(smollm2_checkpoint.parent)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The capital of France is Paris. 12345 tokens, <|im_start|>user\nHi<|im_end|>"
    assert hf_tokenizer(text)["input_ids"] == ours_tokenizer.encode(text)
    assert exported.generation_config.eos_token_id in ours_tokenizer.eos_ids
    tokens = torch.tensor([ours_tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])])
    assert_logits_match(ours_with_cache(smollm2_checkpoint, tokens.shape[1]), exported, tokens)


def test_cli_writes_the_folder(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.float32)
    (tmp_path / "empty").mkdir()  # an empty --out is taken, as `mkdir` then export would expect
    done = run_script("export_hf.py", "--checkpoint", tmp_path / "ours" / "model.pth", "--out", tmp_path / "empty",
                      "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "empty" / "config.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left


def test_cli_bad_input_is_one_line_before_any_work(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.float32)
    checkpoint = tmp_path / "ours" / "model.pth"
    done = run_script("export_hf.py", "--checkpoint", tmp_path / "nope.pth", "--out", tmp_path / "x")
    assert_one_line_error(done, "checkpoint not found")
    done = run_script("export_hf.py", "--checkpoint", checkpoint, "--out", tmp_path / "ours")
    assert_one_line_error(done, "already exists and is not an empty folder")
    done = run_script("export_hf.py", "--checkpoint", checkpoint, "--out", checkpoint)
    assert_one_line_error(done, "is the input checkpoint")
    assert done.returncode == 2 and load_checkpoint(checkpoint)[0]  # the input is intact
    assert not (tmp_path / "x").exists()


def test_failed_export_leaves_nothing(tiny_hf_folder, tmp_path, monkeypatch):
    folder, _ = tiny_hf_folder("llama")
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.float32)

    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", broken_save)
    with pytest.raises(OSError):
        export_to_hf(tmp_path / "ours" / "model.pth", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours"]


@pytest.mark.parametrize("pattern", ["2:4", "8:16"])
def test_packed_round_trip_export_convert_pack_is_bit_identical(tiny_hf_folder, tmp_path, pattern):
    folder, _ = tiny_hf_folder("llama-tied")
    convert_hf_folder(folder, tmp_path / "ours", dtype=torch.bfloat16)
    packed = pack_checkpoint(tmp_path / "ours" / "model.pth", tmp_path / "packed.pth", pattern)
    export_to_hf(packed, tmp_path / "hf")
    convert_hf_folder(tmp_path / "hf", tmp_path / "again", dtype=torch.bfloat16, sparse="auto")
    before, config, metadata = load_checkpoint(packed)
    after, config_after, metadata_after = load_checkpoint(tmp_path / "again" / "model.pth")
    assert config_after == config and before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    assert metadata_after["sparsity"]["pattern"] == pattern
    assert sorted(metadata_after["sparsity"]["layers"]) == sorted(metadata["sparsity"]["layers"])
