"""The comparison runner: seed aggregation, the paper-style table, verdicts, plot, and cells pruned with cached decode calibrations."""
import dataclasses
import json
import shutil
from argparse import Namespace

import pytest
import torch

from checkpoint import load_checkpoint, save_checkpoint
from evaluation.compare import (aggregate, c4_heldout, markdown_table, plot, prune, prune_argv, prune_options,
                                run_name, verdicts)
from model import Transformer
from prune.calibration import text_windows
from prune.run import main as prune_cli
from tests.conftest import STORIES260K_DIR
from tests.evaluation_tiny_models import TINY


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
    one_seed = verdicts(aggregate([run for run in fake_runs() if run["seed"] == 0]))
    assert all(v["beyond_spread"] is None for v in one_seed)  # no spread to compare with


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


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    """The tiny evaluation model with stories260K's 512-token vocabulary, saved beside that tokenizer
    (decode calibration needs one)."""
    tokenizer = STORIES260K_DIR / "tok512.bin"
    if not tokenizer.is_file():
        pytest.skip(f"stories260K's tokenizer is not at {tokenizer}")
    folder = tmp_path_factory.mktemp("with_tokenizer")
    shutil.copy(tokenizer, folder)
    config = dataclasses.replace(TINY, vocab_size=512)
    torch.manual_seed(0)
    save_checkpoint(folder / "model.pth", Transformer(config).state_dict(), config)
    return folder / "model.pth"


def test_cells_reuse_the_decode_calibration_and_equal_the_prune_cli(checkpoint_with_tokenizer, tmp_path, monkeypatch):
    """The first decode cell generates and caches; a second backend reuses the cache; both checkpoints
    equal what `python -m prune` writes for the same flags, a new seed generates afresh, and each cell
    reads the dense checkpoint once."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n{"prompt": "The dog ran"}\n{"prompt": "Lily saw"}\n')
    args = Namespace(checkpoint=checkpoint_with_tokenizer, calib_max_new_tokens=9, calib_batch_size=2, calib_seq_len=32, tokens=40,
                     device="cpu", workdir=tmp_path / "grid", calibration_cache=None, prune_args=["--one_shot"])
    args.workdir.mkdir()
    for method, seed in (("sparsegpt", 0), ("wanda", 0), ("wanda", 1)):
        cell = args.workdir / f"{method}-{seed}.pth"
        reads, real_load = [], torch.load
        with monkeypatch.context() as patch:
            patch.setattr(torch, "load", lambda f, *a, **k: reads.append(str(f)) or real_load(f, *a, **k))
            prune(args, method, "2:4", "decode", seed, prompts, cell)
        assert reads.count(str(checkpoint_with_tokenizer)) == 1
        reference = tmp_path / f"cli-{method}-{seed}.pth"
        prune_cli(prune_argv(args, method, "2:4", "decode", seed, prompts, reference))
        (ours, _, meta), (theirs, _, meta_cli) = load_checkpoint(cell), load_checkpoint(reference)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert meta["calibration"]["counted_tokens"] == meta_cli["calibration"]["counted_tokens"] == 40
        assert ("reused_from" in meta["calibration"]) == (method == "wanda" and seed == 0)
        assert meta["calibration"]["collection"] == "one-shot"
    assert len(list(args.workdir.glob("calibration-decode-40tok-seed*.pt"))) == 2


def test_prune_args_pass_on_what_a_grid_may_vary():
    assert prune_options(["--one_shot", "--count_first_token"]) == {"one_shot": True, "count_first_token": True}
    assert prune_options(["--exclude", "*.w2"]) == {"exclude": ["*.w2"], "count_first_token": False}
    with pytest.raises(ValueError, match="cannot pass on --greedy"):
        prune_options(["--greedy"])


def test_grid_caches_each_task_apart_and_existing_only_measures_nothing(tmp_path, monkeypatch):
    """Adding a task to a finished grid measures only that task; --existing_only reads, never measures."""
    import evaluation.compare as compare
    import evaluation.fidelity
    import evaluation.generation
    import evaluation.perplexity

    class Tokenizer:  # the context encodes WikiText with it
        encode = staticmethod(lambda text: [0])

    measured = []
    monkeypatch.setattr(compare, "prompt_split", lambda *a: (["calibrate"], ["held out"]))
    monkeypatch.setattr(compare, "data_path", lambda name: tmp_path / name)
    monkeypatch.setattr(compare, "prune", lambda args, method, pattern, calib, seed, prompts, out: out.touch())
    monkeypatch.setattr(evaluation.generation, "load_model_and_tokenizer", lambda *a: ("dense", Tokenizer()))
    monkeypatch.setattr(evaluation.generation, "load_model", lambda checkpoint, device: checkpoint.stem)
    monkeypatch.setattr(evaluation.fidelity, "dense_references", lambda *a: [[[1], [2]]])
    monkeypatch.setattr(evaluation.fidelity, "decode_step_logits", lambda *a: None)
    monkeypatch.setattr(evaluation.perplexity, "read_text", lambda *a, **k: "text")
    monkeypatch.setattr(compare, "evaluate_checkpoint", lambda args, model, context: measured.append(model) or {"kl": 1.0})
    monkeypatch.setattr(compare, "task_score", lambda args, task, model, tokenizer, detail: measured.append(
        (task, model)) or {f"{task}_pass@1": 0.5})
    monkeypatch.setattr(compare, "c4_heldout", lambda *a: ([0] * 8, {"tokens": 8}))
    monkeypatch.setattr(evaluation.perplexity, "perplexity", lambda model, ids, seq_len: measured.append(
        ("c4", model)) or {"perplexity": 9.0})

    def grid(*extra):
        argv = ["--checkpoint", "dense.pth", "--workdir", str(tmp_path / "grid"), "--methods", "wanda", "--patterns",
                "2:4", "--seeds", "0", "--out", str(tmp_path / "results.json"), *extra]
        monkeypatch.setattr("sys.argv", ["compare", *argv])
        measured.clear()
        compare.main()
        return measured[:]

    assert grid() == ["dense", "wanda-2of4-text-seed0", "wanda-2of4-decode-seed0"]
    assert grid("--tasks", "humaneval") == [("humaneval", "dense"), ("humaneval", "wanda-2of4-text-seed0"),
                                            ("humaneval", "wanda-2of4-decode-seed0")]
    assert grid("--tasks", "humaneval", "mbpp", "--existing_only") == []
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert all(run["metrics"] == {"kl": 1.0, "humaneval_pass@1": 0.5} for run in runs)
    assert grid("--c4_ppl_tokens", "8", "--existing_only") == []
    assert grid("--c4_ppl_tokens", "8") == [("c4", "dense"), ("c4", "wanda-2of4-text-seed0"),
                                            ("c4", "wanda-2of4-decode-seed0")]
    assert grid("--c4_ppl_tokens", "8", "--tasks", "humaneval") == []
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert all(run["metrics"] == {"kl": 1.0, "c4_ppl": 9.0, "humaneval_pass@1": 0.5} for run in runs)


def test_heldout_c4_documents_never_reach_a_text_calibration(tmp_path):
    """Held-out C4 is the documents text_windows does not read at seeds 0-2 and the largest budget:
    rewriting every held-out document leaves each such calibration (and a smaller budget's) unchanged."""
    from tokenizer import load_tokenizer

    tokenizer_path = STORIES260K_DIR / "tok512.bin"
    if not tokenizer_path.is_file():
        pytest.skip(f"stories260K's tokenizer is not at {tokenizer_path}")
    tokenizer = load_tokenizer(tokenizer_path)
    words = "the cat sat on a mat and Lily ran to see her dog in the big park".split()
    documents = [" ".join(words[(i + j) % len(words)] for j in range(3 + 5 * (i % 7))) for i in range(60)]
    corpus = tmp_path / "c4.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    ids, info = c4_heldout(tokenizer, corpus, 20, (0, 1, 2), 64, 16)
    excluded = set(info["excluded_documents"])
    kept = [d for i, d in enumerate(documents) if i not in excluded]
    assert 0 < len(excluded) < len(documents) and info["heldout_documents"] == len(kept)
    assert ids == tokenizer.encode("\n\n".join(kept))[:20]
    rewritten = tmp_path / "rewritten.jsonl"
    rewritten.write_text("".join(json.dumps({"text": d if i in excluded else "Tom and Sue ate " * (i + 1)}) + "\n"
                                 for i, d in enumerate(documents)))
    for seed in (0, 1, 2):
        for tokens in (32, 64):
            a, b = text_windows(tokenizer, corpus, tokens, 16, seed), text_windows(tokenizer, rewritten, tokens, 16, seed)
            assert all(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences, strict=True))
    with pytest.raises(ValueError, match="fewer than"):
        c4_heldout(tokenizer, corpus, 10 ** 6, (0, 1, 2), 64, 16)


def test_a_metric_on_fewer_seeds_than_its_row_says_so():
    runs = fake_runs() + [{"method": "sparsegpt", "pattern": "2:4", "calib": "text", "seed": 2, "metrics": {"kl": 0.32}}]
    text = markdown_table(aggregate(runs), {})
    assert "| sparsegpt | 2:4 | C4 | 3 | 0.32 ± 0.02 | 31 ± 1.414 (n=2) | 0.1 ± 0 (n=2) |" in text
