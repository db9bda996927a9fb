"""scripts/bench_decode.py: the parent's bookkeeping around its per-model child processes (CPU; the
timing itself needs a GPU and runs on the H200, docs/BENCHMARKS.md)."""
import json
from pathlib import Path

import pytest

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


def test_the_tuned_spmv_configs_of_one_batch_size_are_reported(monkeypatch):
    import torch
    from sparse import kernels
    tuned = {(4096, 128, 4, torch.bfloat16, False, "residual", "cuda:0"): (32, 4, 1),
             (28672, 128, 8, torch.bfloat16, True, "norm", "cuda:0"): (16, 8, 1),
             (4096, 448, 1, torch.bfloat16, False, "", "cuda:0"): (32, 14, 1)}
    monkeypatch.setattr(kernels, "_tuned_configs", tuned)
    assert bench_decode.tuned_spmv_configs(3) == {"4096x4096 residual": [32, 4, 1]}  # 3 rows run as 4
    assert bench_decode.tuned_spmv_configs(8) == {"28672x4096 packed x norm": [16, 8, 1]}
    assert bench_decode.tuned_spmv_configs(1) == {"4096x14336": [32, 14, 1]}


def test_the_tuned_spmm_configs_of_one_batch_size_are_reported(monkeypatch):
    import torch
    from sparse import spmm
    tuned = {(28672, 128, 8, torch.bfloat16, torch.device("cuda:0"), True, True): (128, 16, 2, 4, 8),
             (4096, 448, 8, torch.bfloat16, torch.device("cuda:0"), False, False): (256, 16, 1, 8, 14),
             (4096, 128, 16, torch.bfloat16, torch.device("cuda:0"), True, False): (128, 16, 1, 4, 4)}
    monkeypatch.setattr(spmm, "_tuned_configs", tuned)
    assert bench_decode.tuned_spmm_configs(8) == {"28672x4096 2:4 prefetched": [128, 16, 2, 4, 8],
                                                  "4096x14336": [256, 16, 1, 8, 14]}
    assert bench_decode.tuned_spmm_configs(4) == {}


def test_the_spmm_candidates_fastest_time_is_reported_for_each_k_loop_depth(monkeypatch):
    import torch
    from sparse import spmm
    key = (28672, 128, 8, torch.bfloat16, torch.device("cuda:0"), True, False)
    times = {(128, 16, 1, 4, 10, 1): 31.24, (256, 16, 1, 8, 10, 1): 30.117, (128, 16, 1, 4, 10, 3): 33.9,
             (256, 16, 1, 8, 10, 3): 32.5}
    monkeypatch.setattr(spmm, "candidate_times", {key: times, (*key[:2], 16, *key[3:]): {(1,) * 6: 1.0}})
    assert bench_decode.spmm_fastest_by_stages(8) == {"28672x4096 2:4": {1: 30.12, 3: 32.5}}
    assert bench_decode.spmm_fastest_by_stages(4) == {}


def test_the_measured_routes_of_one_batch_size_are_reported(monkeypatch):
    import torch
    from sparse import linear
    cuda = torch.device("cuda:0")
    key = linear.RouteKey(4096, 128, 8, torch.bfloat16, True, True, False, "", cuda)
    monkeypatch.setattr(linear, "_routes", {key: "spmv",
                                            key._replace(out_features=28672): "mma_sp",
                                            key._replace(residual=True): "spmv",
                                            key._replace(rows=16): "spmm",
                                            key._replace(out_features=6144, prologue="norm"): "mma_sp"})
    assert bench_decode.measured_routes(8) == {"4096x4096 2:4": "spmv", "28672x4096 2:4": "mma_sp",
                                               "4096x4096 2:4 +residual": "spmv", "6144x4096 2:4 +norm": "mma_sp"}
    assert bench_decode.measured_routes(4) == {}
