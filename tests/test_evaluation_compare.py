"""The comparison runner: seed aggregation, the paper-style table (per domain, with the calibration mix),
verdicts, plot, cells of every source pruned from one cached decode calibration, and the prompt split."""
import dataclasses
import json
import shutil
from argparse import Namespace

import pytest
import torch

from checkpoint import load_checkpoint, save_checkpoint
from evaluation.compare import (SOURCES, aggregate, c4_heldout, markdown_table, mix_labels, plot, prune, prune_argv,
                                prune_options, run_name, verdicts)
from model import Transformer
from prune.calibration import text_windows
from prune.run import main as prune_cli
from tests.conftest import STORIES260K_DIR
from tests.evaluation_tiny_models import TINY


def fake_runs():
    runs = []
    for seed, (kl_c4, kl_dec, ppl_c4, ppl_dec) in enumerate([(0.30, 0.20, 30.0, 31.0), (0.34, 0.22, 32.0, 33.0)]):
        runs.append({"method": "sparsegpt", "pattern": "2:4", "calib": "c4", "seed": seed,
                     "metrics": {"kl": kl_c4, "wikitext2_ppl": ppl_c4, "humaneval_pass@1": 0.1}})
        runs.append({"method": "sparsegpt", "pattern": "2:4", "calib": "decode", "seed": seed,
                     "metrics": {"kl": kl_dec, "wikitext2_ppl": ppl_dec, "humaneval_pass@1": 0.1}})
    return runs


def test_aggregate_gives_mean_std_and_count_over_seeds():
    table = aggregate(fake_runs())
    mean, std, n = table["sparsegpt", "2:4", "c4"]["kl"]
    assert mean == pytest.approx(0.32) and std == pytest.approx(0.02 * 2 ** 0.5) and n == 2


def test_verdicts_say_which_calibration_wins_per_metric():
    by_metric = {v["metric"]: v for v in verdicts(aggregate(fake_runs()))}
    assert all(v["source"] == "decode" for v in by_metric.values())
    assert by_metric["KL(dense||pruned)"]["better"] and by_metric["KL(dense||pruned)"]["beyond_spread"]
    assert not by_metric["WikiText-2 PPL"]["better"]  # higher perplexity loses
    assert not by_metric["humaneval_pass@1"]["better"] and by_metric["humaneval_pass@1"]["tie"]
    one_seed = verdicts(aggregate([run for run in fake_runs() if run["seed"] == 0]))
    assert all(v["beyond_spread"] is None for v in one_seed)  # no spread to compare with


def test_table_and_plot(tmp_path):
    table = aggregate(fake_runs())
    text = markdown_table(table, {"wikitext2_ppl": 20.0, "humaneval_pass@1": 0.2})
    lines = text.strip().splitlines()
    assert len(lines) == 2 + 1 + 2  # header, rule, dense, C4 and decode-only rows
    assert "| sparsegpt | 2:4 | C4 | - | 2 | 0.32 ± 0.02828 |" in text
    plot(table, {"wikitext2_ppl": 20.0}, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_run_names_are_file_safe():
    assert run_name("wanda", "50%", "decode", 2) == "wanda-50pct-decode-seed2"
    assert run_name("sparsegpt", "2:4", "decode_first", 0) == "sparsegpt-2of4-decode_first-seed0"


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


def test_cells_of_every_source_equal_the_prune_cli_and_share_one_generation(checkpoint_with_tokenizer, tmp_path,
                                                                            monkeypatch):
    """Every source's cell equals what `python -m prune` writes for the same flags (mix included); the
    first decode-based cell of a seed generates and caches, the others reuse it, a new seed generates
    afresh, each cell reads the dense checkpoint once, and every source counts the same budget."""
    from evaluation.compare import cached_calibration
    from prune import read_source

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon a time", "domain": "writing"}\n{"prompt": "The dog ran", "domain": "writing"}\n'
                       '{"prompt": "Lily saw", "domain": "code", "reference": "Lily saw a big red ball in the park. She ran to get it and kicked it high."}\n')
    args = Namespace(checkpoint=checkpoint_with_tokenizer, calib_max_new_tokens=9, calib_batch_size=2, calib_seq_len=20,
                     tokens=40, device="cpu", workdir=tmp_path / "grid", calibration_cache=None, prune_args=["--one_shot"])
    args.workdir.mkdir()
    cells = [("sparsegpt", source, 0) for source in SOURCES] + [("wanda", "decode", 0), ("wanda", "decode", 1)]
    for method, source, seed in cells:
        cell = args.workdir / f"{method}-{source}-{seed}.pth"
        reads, real_load = [], torch.load
        with monkeypatch.context() as patch:
            patch.setattr(torch, "load", lambda f, *a, **k: reads.append(str(f)) or real_load(f, *a, **k))
            prune(args, method, "2:4", source, seed, prompts, cell)
        assert reads.count(str(checkpoint_with_tokenizer)) == 1
        reference = tmp_path / f"cli-{method}-{source}-{seed}.pth"
        prune_cli(prune_argv(args, method, "2:4", source, seed, prompts, reference))
        (ours, _, meta), (theirs, _, meta_cli) = load_checkpoint(cell), load_checkpoint(reference)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert meta["calibration"]["mix"] == meta_cli["calibration"]["mix"] == json.loads(
            cell.with_suffix(".mix.json").read_text())
        n_sequences = meta["calibration"]["sequences"]
        assert meta["calibration"]["counted_tokens"] == 40 + (n_sequences if source == "decode_first" else 0)
        first_decode_cell = (method, source, seed) in (("sparsegpt", "decode", 0), ("wanda", "decode", 1))
        assert ("reused_from" in meta["calibration"]) == (source in ("decode", "decode_first", "generated")
                                                          and not first_decode_cell)
        assert meta["calibration"]["collection"] == "one-shot"
    assert len(list(args.workdir.glob("calibration-decode-40tok-seed*.pt"))) == 2
    source_model = read_source(checkpoint_with_tokenizer)
    decode, first, generated = (cached_calibration(args, source_model, s, 0, prompts)
                                for s in ("decode", "decode_first", "generated"))
    for calibration in (first, generated):  # the very sequences of the decode set (generated: those the budget holds)
        assert all(torch.equal(a, b[:len(a)]) for a, b in zip(calibration.sequences, decode.sequences))
    assert len(first.sequences) == len(decode.sequences) and generated.counted_tokens == 40


def test_grid_refuses_held_out_prompts_it_calibrates_on_before_any_work(tmp_path, monkeypatch, capsys):
    import evaluation.compare as compare

    monkeypatch.setattr(compare, "prompt_rows", lambda *a: (
        [dict(prompt="Write a poem.", domain="writing", reference=None)],
        [dict(prompt="Write a poem.  ", domain="writing"), dict(prompt="def f():", domain="code")]))
    monkeypatch.setattr(compare, "run_name", lambda *a: pytest.fail("work started"))
    monkeypatch.setattr("sys.argv", ["compare", "--checkpoint", "dense.pth", "--workdir", str(tmp_path / "grid"),
                                     "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as exit_info:
        compare.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: 1 of the 2 evaluation prompts are among the calibration prompts (first: 'Write a poem.'); "
                   "evaluate on held-out prompts"]
    assert not (tmp_path / "grid" / "calibration_prompts.jsonl").exists()


def test_grid_budget_must_be_whole_c4_windows(tmp_path, monkeypatch, capsys):
    import evaluation.compare as compare

    monkeypatch.setattr("sys.argv", ["compare", "--checkpoint", "dense.pth", "--workdir", str(tmp_path / "grid"),
                                     "--tokens", "1000", "--calib_seq_len", "512", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as exit_info:
        compare.main()
    assert exit_info.value.code == 2 and "not a multiple of --calib_seq_len 512" in capsys.readouterr().err


def test_table_reports_each_domain_and_the_mix_of_each_source(tmp_path):
    def run(calib, seed, kl_writing, kl_code, writing_tokens):
        mix = {"counted_tokens": 100, "domains": {"writing": {"tokens": writing_tokens, "prompt_tokens": 0},
                                                  "code": {"tokens": 100 - writing_tokens, "prompt_tokens": 10}}}
        metrics = {"kl": (kl_writing + kl_code) / 2, "kl_writing": kl_writing, "kl_code": kl_code,
                   "top1_agreement_code": 0.5}
        return {"method": "wanda", "pattern": "50%", "calib": calib, "seed": seed, "calibration_mix": mix,
                "metrics": metrics}
    runs = [run("c4", 0, 1.0, 2.0, 100), run("c4", 1, 1.2, 2.2, 100), run("reference", 0, 1.4, 1.0, 30),
            run("reference", 1, 1.4, 1.2, 10)]
    table = aggregate(runs)
    labels = mix_labels(runs)
    assert labels["wanda", "50%", "reference"] == "code 80% · writing 20%; prompt 10%"
    text = markdown_table(table, {}, labels)
    header = text.splitlines()[0]
    assert "| KL(dense||pruned) | KL(dense||pruned) writing | KL(dense||pruned) code | top-1 agree code |" in header
    assert "| wanda | 50% | human reference | code 80% · writing 20%; prompt 10% | 2 | 1.25 ± 0.07071 | 1.4 ± 0 | " \
           "1.1 ± 0.1414 | 0.5 ± 0 |" in text
    by = {(v["source"], v["metric"]): v for v in verdicts(table)}
    assert by["reference", "KL(dense||pruned) code"]["better"] and not by["reference", "KL(dense||pruned) writing"]["better"]
    plot(table, {}, tmp_path / "domains.png")
    assert (tmp_path / "domains.png").stat().st_size > 0


def test_prune_args_pass_on_what_a_grid_may_vary():
    defaults = {"one_shot": False, "include": ["layers.*"], "exclude": [], "batch_tokens": 8192}
    assert prune_options(["--one_shot"]) == dict(defaults, one_shot=True)
    assert prune_options(["--exclude", "*.w2"]) == dict(defaults, exclude=["*.w2"])
    with pytest.raises(ValueError, match="cannot pass on --greedy"):
        prune_options(["--greedy"])
    with pytest.raises(ValueError, match="cannot pass on --count_first_token"):  # a source now: --sources decode_first
        prune_options(["--count_first_token"])


def test_grid_caches_each_task_apart_and_existing_only_measures_nothing(tmp_path, monkeypatch):
    """Adding a task to a finished grid measures only that task; --existing_only reads, never measures;
    a measured cell whose checkpoint was deleted is pruned again only when a metric is missing."""
    import evaluation.compare as compare
    import evaluation.fidelity
    import evaluation.generation
    import evaluation.perplexity

    class Tokenizer:  # the context encodes WikiText with it
        encode = staticmethod(lambda text: [0])

    measured, pruned = [], []
    monkeypatch.setattr(compare, "prompt_rows", lambda *a: ([dict(prompt="calibrate", domain="code", reference=None)],
                                                             [dict(prompt="held out", domain="writing")]))
    monkeypatch.setattr(compare, "data_path", lambda name: tmp_path / name)

    def prune(args, method, pattern, calib, seed, prompts, out):  # as compare.prune: only a missing checkpoint
        if out.exists():
            return
        pruned.append(out.stem)
        out.touch()
        out.with_suffix(".mix.json").write_text('{"counted_tokens": 4, "domains": {"code": {"tokens": 4, "prompt_tokens": 1}}}')
    monkeypatch.setattr(compare, "prune", prune)
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
                "2:4", "--seeds", "0", "--sources", "c4", "decode", "--out", str(tmp_path / "results.json"), *extra]
        monkeypatch.setattr("sys.argv", ["compare", *argv])
        measured.clear()
        compare.main()
        return measured[:]

    assert grid() == ["dense", "wanda-2of4-c4-seed0", "wanda-2of4-decode-seed0"]
    assert grid("--tasks", "humaneval") == [("humaneval", "dense"), ("humaneval", "wanda-2of4-c4-seed0"),
                                            ("humaneval", "wanda-2of4-decode-seed0")]
    assert grid("--tasks", "humaneval", "mbpp", "--existing_only") == []
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(run["metrics"] == {"kl": 1.0, "humaneval_pass@1": 0.5} for run in results["runs"])
    assert all(run["calibration_mix"]["counted_tokens"] == 4 for run in results["runs"])
    assert "| wanda | 2:4 | C4 | code 100%; prompt 25% | 1 |" in results["table_markdown"]
    assert grid("--c4_ppl_tokens", "8", "--existing_only") == []
    assert grid("--c4_ppl_tokens", "8") == [("c4", "dense"), ("c4", "wanda-2of4-c4-seed0"),
                                            ("c4", "wanda-2of4-decode-seed0")]
    assert grid("--c4_ppl_tokens", "8", "--tasks", "humaneval") == []
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert all(run["metrics"] == {"kl": 1.0, "c4_ppl": 9.0, "humaneval_pass@1": 0.5} for run in runs)

    cells = ["wanda-2of4-c4-seed0", "wanda-2of4-decode-seed0"]
    assert pruned == cells
    for name in cells:
        (tmp_path / "grid" / f"{name}.pth").unlink()
    assert grid("--c4_ppl_tokens", "8", "--tasks", "humaneval") == [] and pruned == cells
    assert grid("--c4_ppl_tokens", "8", "--tasks", "humaneval", "--existing_only") == []
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [run["metrics"]["humaneval_pass@1"] for run in runs] == [0.5, 0.5]
    assert all(run["calibration_mix"]["counted_tokens"] == 4 for run in runs)
    assert grid("--tasks", "humaneval", "mbpp") == [("mbpp", "dense"), *(("mbpp", name) for name in cells)]
    assert pruned == cells * 2
    (tmp_path / "grid" / "wanda-50pct-c4-seed0.pth").touch()  # pruned, not yet measured (another run's)
    assert grid("--patterns", "2:4", "50%", "--existing_only") == []
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 2


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
    runs = fake_runs() + [{"method": "sparsegpt", "pattern": "2:4", "calib": "c4", "seed": 2, "metrics": {"kl": 0.32}}]
    text = markdown_table(aggregate(runs), {})
    assert "| sparsegpt | 2:4 | C4 | - | 3 | 0.32 ± 0.02 | 31 ± 1.414 (n=2) | 0.1 ± 0 (n=2) |" in text
