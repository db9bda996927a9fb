"""Diagnostics on tiny models: shapes, zero discrepancy / epsilon for identical inputs, hand-checked moments."""
import math

import pytest
import torch

from evaluation.diagnostics import (activation_discrepancy, decode_sequences, hessian_tables, input_second_moments,
                                    linear_layers, plot_activation, plot_hessian, subspace_error)
from tests.evaluation_tiny_models import TINY, greedy_without_cache, half_pruned, tiny_model


def test_activation_discrepancy_shapes_and_zero_for_the_model_itself(tmp_path):
    dense, pruned = tiny_model(), half_pruned(tiny_model())
    prompts = [[1, 2, 3], [4, 5]]
    dense_refs = [(p, greedy_without_cache(dense, p, 6)) for p in prompts]
    pruned_refs = [(p, greedy_without_cache(pruned, p, 6)) for p in prompts]
    result = activation_discrepancy(dense, pruned, dense_refs, pruned_refs)
    for mode in ("teacher_forced", "autoregressive"):
        assert torch.tensor(result[mode]).shape == (TINY.n_layer, 6)
    assert torch.tensor(result["teacher_forced"]).min() > 0
    itself = activation_discrepancy(dense, dense, dense_refs, dense_refs)
    assert torch.tensor(itself["autoregressive"]).abs().max() < 1e-6
    plot_activation(result, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


def test_second_moments_match_a_hand_computation_and_skip_prompt_positions():
    model = tiny_model()
    ids, first = [7, 8, 9, 10, 11, 12], 2
    moments = input_second_moments(model, [(ids, first)], progress=False)
    assert set(moments) == set(linear_layers(model)) and len(moments) == 4 * TINY.n_layer
    with torch.no_grad():
        x = model.layers[0].attention_norm(model.tok_embeddings(torch.tensor(ids)))[first:].double()
    assert torch.allclose(moments["layers.0.attention.wqkv"], x.T @ x / len(x), atol=1e-10)


def test_decode_sequences_keep_only_fed_back_tokens_within_budget():
    refs = [([1, 2, 3], [4, 5, 6]), ([9], [8, 7, 6, 5])]
    assert decode_sequences(refs) == [([1, 2, 3, 4, 5], 3), ([9, 8, 7, 6], 1)]
    assert decode_sequences(refs, max_tokens=3) == [([1, 2, 3, 4, 5], 3), ([9, 8], 1)]


def test_epsilon_of_identical_hessians_is_zero_and_known_values():
    a = torch.randn(16, 16, dtype=torch.float64)
    h = a @ a.T
    assert max(subspace_error(h, h)) < 1e-12
    h_dec, h_cal = torch.diag(torch.tensor([4.0, 1.0], dtype=torch.float64)), torch.diag(torch.tensor([2.0, 1.0], dtype=torch.float64))
    eps = subspace_error(h_cal, h_dec, fractions=(0.5, 1.0))
    assert eps == pytest.approx([2 / 4, 2 / math.sqrt(17)])


def test_hessian_tables_count_and_ratio(tmp_path):
    eye = torch.eye(4, dtype=torch.float64)
    h_dec = {"a": eye, "b": eye}
    h_ar = {"a": eye * 1.1, "b": eye * 1.5}  # eps 0.1 and 0.5
    h_c4 = {"a": eye * 1.2, "b": eye * 1.25}  # eps 0.2 and 0.25
    tables = hessian_tables(h_dec, h_ar, h_c4, fractions=(0.5, 1.0))
    for row in tables["summary"]:
        assert row["modules"] == 2 and row["ar_below_c4"] == 1
        assert row["median_ratio_ar_over_c4"] == pytest.approx((0.5 + 2.0) / 2)
    plot_hessian(tables, tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 0


def run_diagnostics_cli(monkeypatch, argv):
    from evaluation import diagnostics
    monkeypatch.setattr("sys.argv", ["diagnostics"] + argv)
    with pytest.raises(SystemExit) as exit_info:
        diagnostics.main()
    return exit_info.value.code


def test_cli_refuses_held_out_prompts_it_calibrates_on_before_loading_a_model(tmp_path, monkeypatch, capsys):
    calib, heldout = tmp_path / "calib.txt", tmp_path / "heldout.txt"
    calib.write_text("write a poem\nsort a list\n")
    heldout.write_text("tell a joke\nsort a list\nname a river\n")
    code = run_diagnostics_cli(monkeypatch, ["hessian", "--dense", str(tmp_path / "absent.pth"), "--out_dir",
                                             str(tmp_path / "out"), "--calib_prompts", str(calib),
                                             "--heldout_prompts", str(heldout), "--limit", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and f"evaluating the first 2 of the 3 prompts of {heldout} (--limit)" in out
    assert err.strip().splitlines()[-1].endswith(
        "1 of the 2 evaluation prompts are among the calibration prompts (--calib_prompts) (first: 'sort a list'); "
        "evaluate on held-out prompts")
    assert not (tmp_path / "out").exists()
