"""scripts/bench_prune.py end to end on a tiny Llama-shaped config on the CPU: every phase runs
through prune/'s real functions, the budget is exact, and the packed checkpoint it writes loads
through generate.py with every linear exactly 2:4."""
import json

import pytest
import torch

import model as model_module
from checkpoint import load_checkpoint
from sparse import unpack

TINY = dict(block_size=128, vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128)


@pytest.fixture
def bench_prune(monkeypatch):
    monkeypatch.setitem(model_module.transformer_configs, "tiny-llama", TINY)
    from scripts import bench_prune
    return bench_prune


def run(bench_prune, *extra):
    return bench_prune.main(["--model", "tiny-llama", "--tokens", "120", "--batch_size", "4", "--max_new_tokens", "12",
                             "--prompt_lengths", "3:9", "--prompts", "6", "--device", "cpu", *extra])


def test_bench_writes_a_packed_checkpoint_and_reports_every_phase(bench_prune, tmp_path, capsys):
    out, report = tmp_path / "pruned.pth", tmp_path / "report.json"
    record = run(bench_prune, "--out", str(out), "--json", str(report))
    printed = capsys.readouterr().out.splitlines()
    assert json.loads(printed[0]) == json.loads(report.read_text()) == json.loads(json.dumps(record))
    assert "| phase | seconds | peak GiB |" in printed
    assert list(record["seconds"]) == ["compile", "generation", "offload", "replay", "solve", "write"]
    assert all(s >= 0 for s in record["seconds"].values())
    assert record["decode_tokens"] == 120 and record["pruned_linears"] == 8
    assert record["replayed_tokens"] > 120  # the prompts are replayed as attention context, not counted

    import generate
    state_dict, _, metadata = load_checkpoint(out)
    assert metadata["method"] == "sparsegpt" and metadata["calibration"]["counted_tokens"] == 120
    assert metadata["calibration"]["kind"] == "decode" and metadata["calibration"]["collection"] == "sequential"
    for name in metadata["sparsity"]["layers"]:
        keep = unpack(state_dict[f"{name}.values"], state_dict[f"{name}.mask"]) != 0
        assert (keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2).all(), name
    loaded = generate.load_model(out, "cpu", torch.float32)
    assert len(generate.generate(loaded, [torch.tensor([1, 2, 3])], 3).new_tokens[0]) == 3


def test_bench_without_writing(bench_prune, tmp_path):
    record = run(bench_prune, "--no_write", "--one-shot")
    assert "write" not in record["seconds"] and record["collection"] == "one-shot"
    assert record["decode_tokens"] == 120 and not any(tmp_path.iterdir())


def test_bench_split_in_two_calls(bench_prune, tmp_path):
    saved = tmp_path / "calibration.pt"
    first = run(bench_prune, "--no_write", "--calibration", str(saved))
    assert list(first["seconds"]) == ["compile", "generation"] and first["calibration_saved"] == str(saved)
    second = run(bench_prune, "--no_write", "--calibration", str(saved))
    assert list(second["seconds"]) == ["compile", "generation", "offload", "replay", "solve"]
    assert {k: second["seconds"][k] for k in first["seconds"]} == first["seconds"]  # the first call's times, summed in
    assert second["decode_tokens"] == 120 and second["pruned_linears"] == 8
    with pytest.raises(SystemExit, match="other settings"):
        run(bench_prune, "--no_write", "--calibration", str(saved), "--seed", "1")


@pytest.mark.parametrize("argv", [[], ["--no_write", "--prompt_lengths", "9:3"]])
def test_bench_usage_errors(bench_prune, argv):
    with pytest.raises(SystemExit) as exit_info:
        bench_prune.main(["--model", "tiny-llama", "--device", "cpu", *argv])
    assert exit_info.value.code == 2
