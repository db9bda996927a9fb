"""The comparison runner's bookkeeping: seed aggregation, the paper-style table, verdicts, plot."""
import pytest

from evaluation.compare import aggregate, markdown_table, plot, run_name, verdicts


def fake_runs():
    runs = []
    for seed, (kl_c4, kl_dec, ppl_c4, ppl_dec) in enumerate([(0.30, 0.20, 30.0, 31.0), (0.34, 0.22, 32.0, 33.0)]):
        runs.append({"method": "sparsegpt", "pattern": "2:4", "calib": "text", "seed": seed,
                     "metrics": {"kl": kl_c4, "wikitext2_ppl": ppl_c4, "humaneval_pass@1": 0.1}})
        runs.append({"method": "sparsegpt", "pattern": "2:4", "calib": "decode", "seed": seed,
                     "metrics": {"kl": kl_dec, "wikitext2_ppl": ppl_dec, "humaneval_pass@1": 0.1}})
    return runs


def test_aggregate_gives_mean_std_and_count_over_seeds():
    table = aggregate(fake_runs())
    mean, std, n = table["sparsegpt", "2:4", "text"]["kl"]
    assert mean == pytest.approx(0.32) and std == pytest.approx(0.02 * 2 ** 0.5) and n == 2


def test_verdicts_say_which_calibration_wins_per_metric():
    by_metric = {v["metric"]: v for v in verdicts(aggregate(fake_runs()))}
    assert by_metric["KL(dense||pruned)"]["decode_better"] and by_metric["KL(dense||pruned)"]["beyond_spread"]
    assert not by_metric["WikiText-2 PPL"]["decode_better"]  # higher perplexity loses
    assert not by_metric["humaneval_pass@1"]["decode_better"] and by_metric["humaneval_pass@1"]["tie"]


def test_table_and_plot(tmp_path):
    table = aggregate(fake_runs())
    text = markdown_table(table, {"wikitext2_ppl": 20.0, "humaneval_pass@1": 0.2})
    lines = text.strip().splitlines()
    assert len(lines) == 2 + 1 + 2  # header, rule, dense, C4 and decode-aware rows
    assert "| sparsegpt | 2:4 | C4 | 2 | 0.32 ± 0.02828 |" in text
    plot(table, {"wikitext2_ppl": 20.0}, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_run_names_are_file_safe():
    assert run_name("wanda", "50%", "decode", 2) == "wanda-50pct-decode-seed2"
    assert run_name("sparsegpt", "2:4", "text", 0) == "sparsegpt-2of4-text-seed0"
