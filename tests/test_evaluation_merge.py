"""evaluation/merge.py: results files of single seeds pooled into the table compare would have
written for the whole grid; files of different evaluations or pruning rules refused."""
import json
import re
import statistics
import sys

import pytest

from evaluation import merge


def seed_file(seed, kl_c4, kl_decode, prune_args=None, evaluation="ppl2048x512-refs12x96", dense_ppl=30.2):
    """One seed's results as compare writes them (its own table and verdicts are not read back)."""
    mix = {"counted_tokens": 100, "domains": {"code": {"tokens": 70, "prompt_tokens": 0},
                                              "writing": {"tokens": 30, "prompt_tokens": 0}}}
    runs = [{"method": "sparsegpt", "pattern": "8:16", "calib": calib, "seed": seed, "calibration_mix": mix,
             "metrics": {"kl": kl}} for calib, kl in (("c4", kl_c4), ("decode", kl_decode))]
    result = {"checkpoint": "dense.pth", "calibration_tokens": 131072, "evaluation": evaluation,
              "dense": {"wikitext2_ppl": dense_ppl}, "runs": runs, "table_markdown": "(one seed)", "verdicts": []}
    if prune_args is not None:
        result["prune_args"] = prune_args
    return result


SEEDS = [seed_file(0, 1.094, 1.014), seed_file(1, 1.101, 1.028), seed_file(2, 1.061, 1.047)]


def test_three_seed_files_give_the_three_seed_table(tmp_path):
    merged = merge.merge(SEEDS, ["s0.json", "s1.json", "s2.json"])
    assert [(r["calib"], r["seed"]) for r in merged["runs"]] == [("c4", 0), ("c4", 1), ("c4", 2),
                                                                 ("decode", 0), ("decode", 1), ("decode", 2)]
    results = merge.write_outputs(merged, tmp_path / "merged.json", tmp_path / "merged.md", tmp_path / "merged.png")
    decode = [1.014, 1.028, 1.047]
    row = (f"| sparsegpt | 8:16 | decode-only | code 70% · writing 30%; prompt 0% | 3 | {statistics.mean(decode):.4g} "
           f"± {statistics.stdev(decode):.4g} |")
    assert row in results["table_markdown"]
    (verdict,) = results["verdicts"]
    # 1.030 against 1.085: better, and the gap (0.055) is beyond std_C4 + std_decode (0.038)
    assert verdict["source"] == "decode" and verdict["better"] and verdict["beyond_spread"]
    assert json.loads((tmp_path / "merged.json").read_text())["merged_from"] == ["s0.json", "s1.json", "s2.json"]
    assert (tmp_path / "merged.md").read_text() == results["table_markdown"]
    assert (tmp_path / "merged.png").stat().st_size > 0


def test_the_same_cell_in_two_files_is_kept_once():
    merged = merge.merge([SEEDS[0], SEEDS[0], SEEDS[1]], ["a.json", "b.json", "c.json"])
    assert len(merged["runs"]) == 4


def test_dense_re_measured_on_another_machine_still_merges():
    # 40.65980212011814 and 40.659802995141284: the same checkpoint's WikiText-2 perplexity on two CPUs
    files = [seed_file(0, 1.094, 1.014, dense_ppl=40.65980212011814), seed_file(1, 1.1, 1.0, dense_ppl=40.659802995141284)]
    assert merge.merge(files, ["a.json", "b.json"])["dense"] == {"wikitext2_ppl": 40.65980212011814}


@pytest.mark.parametrize("files,message", [
    # one cell name, two results: two pruning rules under one name
    ([seed_file(0, 1.094, 1.014), seed_file(0, 1.094, 0.843)], "hold different cells for sparsegpt 8:16 decode seed 0"),
    ([SEEDS[0], seed_file(1, 1.1, 1.0, evaluation="ppl4096x512-refs12x96")], "has evaluation 'ppl4096x512-refs12x96'"),
    ([SEEDS[0], seed_file(1, 1.1, 1.0, dense_ppl=30.21)], "has dense {'wikitext2_ppl': 30.21}"),
    ([seed_file(0, 1.1, 1.0, prune_args=[]), seed_file(1, 1.1, 1.0, prune_args=["--one_shot"])],
     "was pruned with ['--one_shot']"),
])
def test_files_of_different_evaluations_or_rules_are_refused(files, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        merge.merge(files, ["one.json", "two.json"])


def test_cli_writes_the_merged_files_and_names_a_bad_input(tmp_path, monkeypatch, capsys):
    paths = []
    for i, result in enumerate(SEEDS):
        paths.append(tmp_path / f"seed{i}.json")
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "merged.json"
    monkeypatch.setattr(sys, "argv", ["merge", *map(str, paths), "--out", str(out), "--table", str(tmp_path / "t.md")])
    merge.main()
    assert "decode-only beats C4" in capsys.readouterr().out and out.exists()
    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setattr(sys, "argv", ["merge", str(paths[0]), str(tmp_path / "broken.json"), "--out",
                                      str(tmp_path / "never.json")])
    with pytest.raises(SystemExit) as exit_info:
        merge.main()
    assert exit_info.value.code == 2
    assert re.fullmatch(r"error: cannot read results file .*broken\.json: .*", capsys.readouterr().err.strip())
    assert not (tmp_path / "never.json").exists()
