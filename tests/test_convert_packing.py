"""convert/packing.py and convert_hf.py --sparse: the N:M pattern of a model's zeros is found per
layer, those layers are packed without changing a weight, and the report names the others and why."""
import torch

import sparse
from checkpoint import load_checkpoint
from conftest import make_tiny_hf_model
from convert import convert_hf_folder
from convert.packing import keep_nonzeros, pack_state_dict, why_not
from script_testing import assert_one_line_error, run_script


def prune_hf_linears(model, pattern, skip=()):
    """Zero all but the N largest |w| of every M inputs in each block linear of a transformers model."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head" and not name.endswith(skip):
                module.weight.mul_(sparse.format.keep_largest(module.weight, pattern))
    return model


def test_groups_with_fewer_non_zeros_keep_zeros_from_the_lowest_column():
    weight = torch.tensor([[0.0, 0.0, 0.0, 5.0, 1.0, 2.0, 0.0, 0.0] * 4])
    assert why_not(weight, "2:4") is None
    keep = keep_nonzeros(weight, "2:4")
    assert keep[0, :8].tolist() == [True, False, False, True, True, True, False, False]
    values, mask = sparse.pack(weight, "2:4", keep)
    assert torch.equal(sparse.unpack(values, mask), weight)


def test_auto_takes_the_finest_pattern_every_sparse_layer_follows():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    two_four = w * sparse.format.keep_largest(w, "2:4")
    four_eight = w * sparse.format.keep_largest(w, "4:8")
    state = {"layers.0.attention.wqkv.weight": two_four, "layers.0.attention.wo.weight": four_eight,
             "layers.0.feed_forward.w13.weight": w, "tok_embeddings.weight": two_four}
    packed = dict(state)
    report = pack_state_dict(packed, "auto")
    assert report.pattern == "4:8"
    assert report.packed == ["layers.0.attention.wqkv", "layers.0.attention.wo"]
    assert "4:8 allows 4" in report.dense["layers.0.feed_forward.w13"]
    assert "tok_embeddings.weight" in packed and "layers.0.feed_forward.w13.weight" in packed
    report = pack_state_dict(dict(state), "2:4")
    assert report.packed == ["layers.0.attention.wqkv"]


def test_a_pruned_hf_model_converts_to_a_packed_checkpoint_with_its_weights(tmp_path):
    model = prune_hf_linears(make_tiny_hf_model("qwen3"), "2:4", skip=("down_proj",))
    model.save_pretrained(tmp_path / "hf")
    done = run_script("convert_hf.py", tmp_path / "hf", "--out", tmp_path / "ours", "--dtype", "float32",
                      "--sparse", "auto")
    assert done.returncode == 0, done.stderr
    assert "packed 6 layers as 2:4, 2 stayed dense" in done.stdout
    assert "layers.1.feed_forward.w2: dense (" in done.stdout
    state_dict, _, metadata = load_checkpoint(tmp_path / "ours" / "model.pth")
    assert metadata["sparsity"]["pattern"] == "2:4" and len(metadata["sparsity"]["layers"]) == 6
    convert_hf_folder(tmp_path / "hf", tmp_path / "dense", dtype=torch.float32)
    dense, _, _ = load_checkpoint(tmp_path / "dense" / "model.pth")
    for layer in metadata["sparsity"]["layers"]:
        assert torch.equal(sparse.unpack(state_dict[f"{layer}.values"], state_dict[f"{layer}.mask"]),
                           dense[f"{layer}.weight"])


def test_a_named_pattern_no_layer_follows_is_one_line(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    done = run_script("convert_hf.py", folder, "--out", tmp_path / "ours", "--sparse", "2:4")
    assert_one_line_error(done, "no block linear's zeros follow 2:4")
    assert done.returncode == 2 and not (tmp_path / "ours" / "model.pth").exists()


def test_auto_on_a_dense_model_writes_it_dense(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder("llama")
    convert_hf_folder(folder, tmp_path, dtype=torch.float32, sparse="auto")
    assert "sparsity" not in load_checkpoint(tmp_path / "model.pth")[2]
