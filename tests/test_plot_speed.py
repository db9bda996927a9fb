"""scripts/plot_speed.py: the measured JSON files grouped into bars (one per engine and pattern,
every process a dot), issue 41's goal lines, and both figures written as PNGs; a missing input is
one clear error line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import plot_speed  # noqa: E402


def decode_file(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"environment": {"date": "2026-12-04 16:45 UTC"}, "rows": rows}))
    return path


def row(model, pattern, tok_s, engine="ours", bound=1.0, batch=1):
    step_ms = 1000 / tok_s
    return dict(model=model, pattern=pattern, batch=batch, engine=engine, tok_s=tok_s, bound_speedup=bound,
                median_step_ms=step_ms, pct_of_copy=round(100 * 15.111 / step_ms / 4.27, 1))


@pytest.fixture
def decode_files(tmp_path):
    return [decode_file(tmp_path, "a.json", [row("Llama-3.1-8B", "dense", 212.8), row("Llama-3.1-8B", "8:16", 353.1,
                                                                                           bound=1.678)]),
            decode_file(tmp_path, "b.json", [row("Llama-3.1-8B", "dense", 223.5),
                                             row("Llama-3.1-8B", "dense", 174.9, engine="gpt-fast"),
                                             row("Qwen3-14B", "dense", 124.9), row("Qwen3-14B", "2:4", 201.8, bound=1.699)])]


def test_processes_are_grouped_per_model_and_bar(decode_files):
    processes, bounds = plot_speed.decode_processes(decode_files)
    assert processes["Llama-3.1-8B", 1] == {"ours dense": [212.8, 223.5], "ours 8:16": [353.1],
                                            "GPT-Fast dense": [174.9]}
    assert bounds == {("Llama-3.1-8B", 1, "ours 8:16"): 1.678, ("Qwen3-14B", 1, "ours 2:4"): 1.699}
    order = sorted(processes["Llama-3.1-8B", 1], key=plot_speed.bar_order)
    assert order == ["GPT-Fast dense", "ours dense", "ours 8:16"]


def test_tensor_parallel_rows_are_bars_of_their_own(tmp_path):
    tp2 = lambda pattern, tok_s: dict(row("Llama-3.3-70B", pattern, tok_s), tp=2)  # noqa: E731
    files = [decode_file(tmp_path, "tp.json", [tp2("dense", 40.0), tp2("2:4", 61.0), row("Llama-3.3-70B", "2:4", 38.0)])]
    processes, _ = plot_speed.decode_processes(files)
    assert sorted(processes["Llama-3.3-70B", 1], key=plot_speed.bar_order) == ["ours-tp2 dense", "ours 2:4", "ours-tp2 2:4"]


def test_goals_follow_issue_41():
    assert plot_speed.decode_goal("Llama-3.1-8B", 1, 200.0, 1.68) == pytest.approx(320.0)  # 1.6x the fastest dense
    assert plot_speed.decode_goal("Llama-3.1-8B", 4, 200.0, 1.68) == pytest.approx(280.0)  # 1.4x
    assert plot_speed.decode_goal("Llama-3.1-8B", 16, 200.0, 1.68) == pytest.approx(240.0)  # 1.2x
    assert plot_speed.decode_goal("Qwen3-14B", 1, 100.0, 1.7) == pytest.approx(161.5)  # 95 % of the bound
    assert plot_speed.decode_goal("Llama-3.1-8B", 32, 200.0, 1.68) is None


def test_rows_a_run_did_not_measure_are_left_out(tmp_path):
    skipped = dict(model="Llama-3.1-8B", pattern="16:32", batch=1, engine="ours", tok_s=None,
                   error="skipped: past --deadline_s")
    files = [decode_file(tmp_path, "cut.json", [row("Llama-3.1-8B", "dense", 212.8), skipped])]
    processes, bounds = plot_speed.decode_processes(files)
    assert processes["Llama-3.1-8B", 1] == {"ours dense": [212.8]} and bounds == {}


def test_both_figures_are_written(decode_files, tmp_path):
    kernel = tmp_path / "kernel.json"
    kernel.write_text(json.dumps([dict(model="Llama-3.1-8B", layer=layer, out=4096, inp=4096, batch=batch, speedup=s)
                                  for batch, s in ((1, 1.65), (4, 1.3), (8, 0.9), (2048, 0.86))
                                  for layer in ("qkv", "o")]))
    out = tmp_path / "plots"
    subprocess.run([sys.executable, str(Path(plot_speed.__file__)), "--decode", *map(str, decode_files),
                    "--kernel", str(kernel), "--label", "test", "--out", str(out)], check=True, capture_output=True)
    for name in ("decode_speed.png", "kernel_speedup.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_later_kernel_table_replaces_the_rows_it_re_measures(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps([dict(model="M", layer=layer, batch=batch, speedup=1.0)
                               for batch in (1, 4) for layer in ("qkv", "o")]))
    new.write_text(json.dumps([dict(model="M", layer="o", batch=4, speedup=1.5)]))
    rows = plot_speed.kernel_rows([old, new])
    assert [(r["layer"], r["batch"], r["speedup"]) for r in rows] == [
        ("qkv", 1, 1.0), ("o", 1, 1.0), ("qkv", 4, 1.0), ("o", 4, 1.5)]


def test_the_spread_groups_hold_our_dense_processes_at_batch_1(decode_files, tmp_path):
    other = decode_file(tmp_path, "c.json", [row("Llama-3.1-8B", "dense", 230.0), row("Llama-3.1-8B", "dense", 150.0,
                                                                                     batch=4)])
    groups = plot_speed.spread_groups([f"events={decode_files[0]},{decode_files[1]}", f"device={other}"])
    assert list(groups) == ["events", "device"]
    assert [ms for ms, _ in groups["events"]["Llama-3.1-8B"]] == pytest.approx([1000 / 212.8, 1000 / 223.5])  # no GPT-Fast
    assert groups["events"]["Qwen3-14B"] == [(pytest.approx(1000 / 124.9), pytest.approx(44.2, abs=0.1))]
    assert [ms for ms, _ in groups["device"]["Llama-3.1-8B"]] == pytest.approx([1000 / 230.0])  # no batch 4
    out = tmp_path / "plots"
    subprocess.run([sys.executable, str(Path(plot_speed.__file__)), "--spread", f"events={decode_files[0]}",
                    f"device={other}", "--label", "test", "--out", str(out)], check=True, capture_output=True)
    assert (out / "dense_spread.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_spread_without_its_group_name_is_one_clear_error(decode_files, tmp_path):
    result = subprocess.run([sys.executable, str(Path(plot_speed.__file__)), "--spread", str(decode_files[0]),
                             "--label", "x", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        f"plot_speed: --spread takes 'GROUP=FILE,FILE...', not {str(decode_files[0])!r}"]


def test_a_missing_input_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, str(Path(plot_speed.__file__)), "--kernel", str(tmp_path / "none.json"),
                             "--label", "x", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        f"plot_speed: no such file: {tmp_path / 'none.json'}"]
