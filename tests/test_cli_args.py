"""cli_args: the shared argument types, and every command line refusing a bad sampling value or
budget while parsing, before it loads anything: exit code 2, the flag named on stderr's last line."""
import argparse
import re
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import cli_args


@pytest.mark.parametrize("kind, text, value", [
    (cli_args.positive_int, "3", 3), (cli_args.non_negative_int, "0", 0),
    (cli_args.temperature, "0", 0.0), (cli_args.temperature, "1.3", 1.3), (cli_args.top_p, "1", 1.0),
    (cli_args.top_p, "0.01", 0.01), (cli_args.top_k, "1", 1), (cli_args.top_k, "off", None), (cli_args.top_k, "None", None),
])
def test_types_accept_good_values(kind, text, value):
    assert kind(text) == value


@pytest.mark.parametrize("kind, text, message", [
    (cli_args.positive_int, "0", "positive integer"), (cli_args.positive_int, "2.5", "expected an integer"),
    (cli_args.non_negative_int, "-1", "0 or more"),
    (cli_args.temperature, "inf", "finite"), (cli_args.temperature, "-1", ">= 0"),
    (cli_args.temperature, "nan", "finite"), (cli_args.temperature, "warm", "expected a number"),
    (cli_args.top_p, "0", "(0, 1]"), (cli_args.top_p, "1.01", "(0, 1]"), (cli_args.top_p, "nan", "finite"),
    (cli_args.top_k, "0", ">= 1 or 'off'"), (cli_args.top_k, "-5", ">= 1 or 'off'"),
])
def test_types_refuse_bad_values_with_a_reason(kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace("]", r"\]")):
        kind(text)


@pytest.mark.parametrize("text, message", [("gpu", "expected cpu, cuda or cuda:N"), ("cuda:x", "expected cpu"),
                                           ("cuda", "no CUDA device"), ("cuda:7", "no CUDA device")])
def test_device_is_refused_unless_this_machine_has_it(text, message, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_args.device("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        cli_args.device(text)


def test_device_index_beyond_the_machines_gpus_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli_args.device("cuda:1") == "cuda:1"
    with pytest.raises(argparse.ArgumentTypeError, match="has 2 CUDA device"):
        cli_args.device("cuda:2")


def test_parser_usage_error_is_one_line_and_exit_code_2(capsys):
    parser = cli_args.ArgumentParser(prog="tool")
    parser.add_argument("--top_k", type=cli_args.top_k)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--top_k", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["tool: error: argument --top_k: must be >= 1 or 'off', got 0 (see --help)"]


# (module, the arguments it needs to get past its own required flags, a bad flag and value)
EVALUATION = [
    ("evaluation.perplexity", ["--checkpoint", "m.pth"], "--seq_len", "0"),
    ("evaluation.perplexity", ["--checkpoint", "m.pth"], "--max_tokens", "-1"),
    ("evaluation.fidelity", ["--dense", "d.pth", "--pruned", "p.pth"], "--limit", "0"),
    ("evaluation.fidelity", ["--dense", "d.pth", "--pruned", "p.pth"], "--max_new_tokens", "0"),
    ("evaluation.fidelity", ["--dense", "d.pth", "--pruned", "p.pth"], "--batch_size", "0"),
    ("evaluation.longbench_write", ["--checkpoint", "m.pth"], "--max_new_tokens", "-3"),
    ("evaluation.longbench_write", ["--checkpoint", "m.pth"], "--limit", "0"),
    ("evaluation.code_tasks", ["--task", "humaneval", "--checkpoint", "m.pth"], "--batch_size", "0"),
    ("evaluation.code_tasks", ["--task", "humaneval", "--checkpoint", "m.pth"], "--max_new_tokens", "zero"),
    ("evaluation.code_tasks", ["--task", "humaneval", "--checkpoint", "m.pth"], "--timeout", "0"),
    ("evaluation.code_tasks", ["--task", "humaneval", "--checkpoint", "m.pth"], "--memory_mb", "-1"),
    ("evaluation.perplexity", ["--checkpoint", "m.pth"], "--device", "gpu"),
    ("evaluation.compare", ["--checkpoint", "d.pth", "--workdir", "w", "--out", "o.json"], "--device", "tpu"),
    ("evaluation.writingbench", ["--judge_url", "http://127.0.0.1:9", "--judge_model", "j", "--checkpoint", "m.pth"],
     "--batch_size", "-1"),
    ("evaluation.compare", ["--checkpoint", "d.pth", "--workdir", "w", "--out", "o.json"], "--tokens", "0"),
    ("evaluation.compare", ["--checkpoint", "d.pth", "--workdir", "w", "--out", "o.json"], "--calib_batch_size", "0"),
    ("evaluation.compare", ["--checkpoint", "d.pth", "--workdir", "w", "--out", "o.json"], "--c4_ppl_tokens", "-1"),
    ("evaluation.compare", ["--checkpoint", "d.pth", "--workdir", "w", "--out", "o.json", "--prune_args"],
     "--batch_tokens", "0"),
    ("evaluation.diagnostics", ["activation", "--pruned", "p.pth", "--dense", "d.pth", "--out_dir", "o"],
     "--max_new_tokens", "0"),
]
BENCHMARKS = [
    ("scripts.bench_decode", [], "--temperature", "-1"),
    ("scripts.bench_decode", [], "--top_k", "0"),
    ("scripts.bench_decode", [], "--top_p", "0"),
    ("scripts.bench_decode", [], "--batch_sizes", "1,0"),
    ("scripts.bench_decode", [], "--new_tokens", "0"),
    ("scripts.bench_prune", ["--no_write"], "--tokens", "0"),
    ("scripts.bench_prune", ["--no_write"], "--max_new_tokens", "-1"),
    ("scripts.bench_prune", ["--no_write"], "--device", "cuda:x"),
]


@pytest.mark.parametrize("module, required, flag, value", EVALUATION + BENCHMARKS)
def test_every_cli_refuses_a_bad_budget_or_sampling_value_before_loading(module, required, flag, value, monkeypatch,
                                                                         capsys):
    import evaluation.generation
    import generate

    def loaded(*args, **kwargs):
        pytest.fail("loaded a model before checking its arguments")

    for owner, name in ((evaluation.generation, "load_model"), (evaluation.generation, "load_model_and_tokenizer"),
                        (generate, "load_model")):
        monkeypatch.setattr(owner, name, loaded)
    main = importlib.import_module(module).main
    argv = [*required, flag, value]
    monkeypatch.setattr("sys.argv", [module, *argv])
    with pytest.raises(SystemExit) as exit_info:
        main(argv) if module.startswith("scripts.") else main()
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}:" in last, last


def test_evaluation_bad_input_found_while_running_is_one_line_and_exit_code_2(tmp_path):
    """A bad file found after parsing (here random bytes named .pth) is still one line and exit code 2."""
    (tmp_path / "random.pth").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "text.txt").write_text("some text to score\n")
    done = subprocess.run([sys.executable, "-m", "evaluation.perplexity", "--checkpoint", str(tmp_path / "random.pth"),
                           "--data", str(tmp_path / "text.txt")], capture_output=True, text=True,
                          cwd=Path(cli_args.__file__).parent)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: not a checkpoint: {tmp_path / 'random.pth'} (not a torch zip archive, or a truncated one)"]


def test_help_shows_defaults_also_without_a_help_text(capsys):
    parser = cli_args.ArgumentParser(prog="tool")
    parser.add_argument("--steps", type=int, default=0)  # 0 is a default worth showing
    parser.add_argument("--rate", type=float, default=0.5, help="how fast")
    parser.add_argument("--mode", default="a", help="a or b (default: a, unless b is set)")  # says it already
    parser.add_argument("--globs", nargs="+", default=["x.*", "y"])
    parser.add_argument("--flag", action="store_true", help="on or off")
    parser.add_argument("--name", help="no default")
    entries = help_entries(parser.format_help())
    assert entries["--steps"].endswith("default: 0")
    assert entries["--rate"].endswith("how fast (default: 0.5)")
    assert entries["--mode"].endswith("a or b (default: a, unless b is set)")
    assert entries["--globs"].endswith("default: x.* y")
    assert entries["--flag"].endswith("on or off") and entries["--name"].endswith("no default")


def help_entries(text: str) -> dict:
    """--help output -> {first option string: its entry with whitespace collapsed}."""
    entries = {}
    for entry in re.split(r"\n(?=  -)", text):
        words = entry.split()
        if words and words[0].startswith("--"):
            entries[words[0].rstrip(",")] = " ".join(words)
    return entries


# (module, how its main takes argv, flag, its default as --help must show it)
DEFAULTS = [
    ("generate", True, "--temperature", "0.8"), ("generate", True, "--top_k", "200"),
    ("generate", True, "--max_new_tokens", "200"), ("generate", True, "--prompt", "Hello, my name is"),
    ("prune.run", True, "--method", "sparsegpt"), ("prune.run", True, "--pattern", "2:4"),
    ("prune.run", True, "--tokens", "1000000"), ("prune.run", True, "--seed", "0"),
    ("prune.run", True, "--include", "layers.*"),
    ("scripts.convert_hf", True, "--dtype", "bfloat16"), ("scripts.demo_summary", True, "--limit", "4"),
    ("scripts.bench_kernel", False, "--batches", "1,4,8,16,"), ("evaluation.fidelity", False, "--limit", "all"),
    ("evaluation.compare", False, "--max_new_tokens", "128"),
]


@pytest.mark.parametrize("module, takes_argv, flag, default", DEFAULTS)
def test_every_cli_help_shows_its_defaults(module, takes_argv, flag, default, monkeypatch, capsys):
    main = importlib.import_module(module).main
    monkeypatch.setattr("sys.argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"]) if takes_argv else main()
    assert exit_info.value.code == 0
    entry = help_entries(capsys.readouterr().out)[flag]
    assert f"default: {default}" in entry, entry
