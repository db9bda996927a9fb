"""convert/compressed_tensors.py against checkpoints written by compressed-tensors 0.14.x itself (the
last version with its sparse compressors; a test-only dependency, installed with --no-deps because
it pins transformers<5): the decompressed weights equal the dense model's bit for bit, --sparse auto
packs them, and our logits match transformers' on the dense original."""
import json

import numpy as np
import pytest
import torch

from checkpoint import load_checkpoint
from conftest import make_tiny_hf_model
from convert import ConversionError, convert_hf_folder
from convert.compressed_tensors import decompress, unpack_bitmask
from generate import load_model
from script_testing import assert_one_line_error, run_script
from test_convert_packing import prune_hf_linears
from test_model import assert_logits_match



def save_compressed(model, folder, kind, structure):
    """The model's folder as compressed-tensors writes it: its compressor's state dict in
    model.safetensors and its ModelCompressor's quantization_config in config.json."""
    from safetensors.torch import save_file

    compressors = pytest.importorskip("compressed_tensors.compressors",
                                      reason="compressed-tensors==0.14.0.1 (test-only) is not installed")
    from compressed_tensors.config import SparsityCompressionConfig

    model.save_pretrained(folder)
    config = SparsityCompressionConfig.load_from_registry(kind, sparsity_structure=structure)
    compressor = compressors.BaseCompressor.load_from_registry(kind, config=config)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    targets = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    compressed = compressor.compress(state, compression_targets=targets)
    assert sum(k.endswith(".compressed") for k in compressed) == len(targets)
    save_file({k: v.contiguous() for k, v in compressed.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    compressors.ModelCompressor(sparsity_config=config).update_config(str(folder))
    return folder


@pytest.mark.parametrize("kind, structure, pattern", [("sparse-24-bitmask", "2:4", "2:4"),
                                                      ("sparse-bitmask", "unstructured", "4:8")])
def test_reference_library_checkpoint_imports_exactly(tmp_path, kind, structure, pattern):
    model = prune_hf_linears(make_tiny_hf_model("llama31"), pattern)
    folder = save_compressed(model, tmp_path / "ct", kind, structure)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["sparsity_config"]["format"] == kind
    convert_hf_folder(folder, tmp_path / "packed", dtype=torch.float32, sparse="auto")
    state_dict, _, metadata = load_checkpoint(tmp_path / "packed" / "model.pth")
    assert metadata["sparsity"]["pattern"] == pattern and len(metadata["sparsity"]["layers"]) == 8
    convert_hf_folder(folder, tmp_path / "dense", dtype=torch.float32)  # decompressed, not packed
    dense, _, _ = load_checkpoint(tmp_path / "dense" / "model.pth")
    assert torch.equal(dense["layers.0.attention.wqkv.weight"],
                       torch.cat([model.model.layers[0].self_attn.q_proj.weight,
                                  model.model.layers[0].self_attn.k_proj.weight,
                                  model.model.layers[0].self_attn.v_proj.weight]))
    ours = load_model(tmp_path / "packed" / "model.pth", "cpu", torch.float32)
    ours.setup_caches(1, 40)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours, model, tokens)


def test_damaged_or_quantized_checkpoints_are_one_line(tmp_path):
    model = prune_hf_linears(make_tiny_hf_model("llama"), "2:4")
    folder = save_compressed(model, tmp_path / "ct", "sparse-24-bitmask", "2:4")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"] = {"group_0": {"weights": {"num_bits": 8}}}
    (folder / "config.json").write_text(json.dumps(config))
    done = run_script("convert_hf.py", folder, "--out", tmp_path / "out")
    assert_one_line_error(done, "quantized")
    assert done.returncode == 2

    from safetensors.torch import load_file, save_file
    del config["quantization_config"]["config_groups"]
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.bitmask"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ConversionError, match="model.layers.0.mlp.up_proj has no model.layers.0.mlp.up_proj.bitmask"):
        convert_hf_folder(folder, tmp_path / "out")


def test_bitmask_bits_are_numpy_packbits_little_endian():
    kept = torch.rand(5, 13, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = torch.from_numpy(np.packbits(kept.numpy(), axis=-1, bitorder="little"))
    assert torch.equal(unpack_bitmask(packed, 5, 13), kept)


def test_parts_that_disagree_are_named():
    kept = torch.tensor([[True, False, True, False] * 2])
    parts = {"shape": torch.tensor([1, 8]), "bitmask": torch.from_numpy(np.packbits(kept.numpy(), axis=-1,
                                                                                     bitorder="little")),
             "compressed": torch.ones(3), "row_offsets": torch.tensor([0])}
    with pytest.raises(ConversionError, match="the bitmask keeps 4 weights but x.compressed holds 3"):
        decompress("x", parts, "sparse-bitmask")
    parts["compressed"] = torch.ones(4)
    assert torch.equal(decompress("x", parts, "sparse-bitmask"), kept.float())
    parts["row_offsets"] = torch.tensor([1])
    with pytest.raises(ConversionError, match="x.row_offsets disagree with its bitmask"):
        decompress("x", parts, "sparse-bitmask")
