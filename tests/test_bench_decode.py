"""scripts/bench_decode.py: the parent's bookkeeping around its per-model child processes (CPU; the
timing itself needs a GPU and runs on the H200, docs/BENCHMARKS.md)."""
import json
from pathlib import Path

import pytest
import torch

from scripts import bench_decode


class FakeChildren:
    """Stands in for subprocess.run: answers each child command with canned median step times, as
    the real child would write them to its --rows_out file; patterns in `dies_on` are not reported."""

    def __init__(self, step_s: dict, dies_on=()):
        self.step_s, self.dies_on, self.commands = step_s, set(dies_on), []

    def __call__(self, command, **_):
        self.commands.append(command)
        flag = lambda name: command[command.index(name) + 1]  # noqa: E731
        rows = [dict(model=flag("--models"), pattern=p, batch=int(b), engine="ours",
                     median_step_s=self.step_s[p], **({"speedup": 1.0} if p == "dense" else {}))
                for p in flag("--patterns").split(",") if p not in self.dies_on
                for b in flag("--batch_sizes").split(",")]
        Path(flag("--rows_out")).write_text(json.dumps(rows))
        return type("Done", (), {"returncode": 1 if self.dies_on else 0})()


def parsed(*argv):
    return bench_decode.parse_args(["--models", "Llama-3.1-8B", "--batch_sizes", "1,4", *argv])


def test_dense_and_sparse_run_in_separate_children_and_the_parent_computes_speedups(monkeypatch, tmp_path):
    children = FakeChildren({"dense": 0.004, "2:4": 0.003, "16:32": 0.0025})
    monkeypatch.setattr(bench_decode.subprocess, "run", children)
    rows = []
    bench_decode.bench(parsed("--patterns", "dense,2:4,16:32", "--out", str(tmp_path)), rows)

    assert len(children.commands) == 2  # one process for dense, one for the sparse patterns
    assert all("--same_process" in c for c in children.commands)
    assert [c[c.index("--patterns") + 1] for c in children.commands] == ["dense", "2:4,16:32"]
    speedups = {(r["pattern"], r["batch"]): r["speedup"] for r in rows}
    assert speedups == {("dense", 1): 1.0, ("dense", 4): 1.0, ("2:4", 1): pytest.approx(4 / 3, abs=1e-3),
                        ("2:4", 4): pytest.approx(4 / 3, abs=1e-3), ("16:32", 1): 1.6, ("16:32", 4): 1.6}


def test_a_child_that_dies_leaves_error_rows_for_what_it_did_not_report(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_decode.subprocess, "run", FakeChildren({"2:4": 0.003}, dies_on={"16:32"}))
    rows = []
    bench_decode.bench(parsed("--patterns", "2:4,16:32", "--out", str(tmp_path)), rows)
    assert [(r["pattern"], "error" in r) for r in rows] == [("2:4", False), ("2:4", False), ("16:32", True)]
    assert "exited with 1" in rows[-1]["error"]
    assert all("speedup" not in r for r in rows)  # no dense run to compare with


def test_the_child_forwards_every_protocol_flag(monkeypatch, tmp_path):
    children = FakeChildren({"dense": 0.004})
    monkeypatch.setattr(bench_decode.subprocess, "run", children)
    args = parsed("--patterns", "dense", "--prompt_length", "64", "--new_tokens", "120", "--warmup_steps", "10",
                  "--temperature", "0.7", "--top_k", "20", "--top_p", "0.8", "--profile", "--out", str(tmp_path))
    bench_decode.bench(args, [])
    child_args = bench_decode.parse_args(children.commands[0][2:])
    for name in ("patterns", "batch_sizes", "prompt_length", "new_tokens", "warmup_steps", "temperature", "top_k",
                 "top_p", "profile", "copy_bandwidth", "out"):
        assert getattr(child_args, name) == getattr(args, name), name


def test_a_sparse_model_is_built_packed_with_valid_masks():
    import sparse

    model = bench_decode.random_model("SmolLM2-135M", "cpu", n_layer=1, pattern="2:4")
    packed = [m for m in model.modules() if isinstance(m, sparse.SparseLinear)]
    assert len(packed) == 4 and isinstance(model.output, torch.nn.Linear)
    for module in packed:
        sparse.validate(module.values, module.mask, "2:4")
        assert module.values.abs().sum() > 0


def test_under_torchrun_a_rank_builds_and_counts_its_shard(monkeypatch):
    one_gpu = bench_decode.dense_bytes("Llama-3.3-70B", 1, parsed())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    shard = bench_decode.meta_model("Llama-3.3-70B", "2:4", n_layer=1)
    assert shard.layers[0].attention.wqkv.out_features == (32 + 2 * 4) * 128
    assert shard.layers[0].feed_forward.w2.linear.in_features == 28672 // 2
    # Half of every layer and of the lm_head, the embedding rows looked up and the norms whole.
    assert bench_decode.dense_bytes("Llama-3.3-70B", 1, parsed()) == pytest.approx(one_gpu / 2, rel=0.01)


@pytest.mark.parametrize("argv, world_size, message", [
    (["--models", "Llama-3.3-70B", "--patterns", "2:4"], "3", "8 key/value heads"),
    (["--models", "Llama-3.3-70B", "--gptfast", "gf"], "2", "--gptfast"),
    (["--models", "No-Such-Model"], "1", "unknown model name"),
    (["--patterns", "3:4"], "1", "power-of-two"),
])
def test_bad_configurations_exit_2_with_one_line_before_any_work(monkeypatch, capsys, argv, world_size, message):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as exited:
        bench_decode.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and message in lines[0]
