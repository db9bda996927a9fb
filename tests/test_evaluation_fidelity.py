"""Decode-fidelity metrics on crafted logits, and on tiny models against a cache-free greedy loop."""
import math

import pytest
import torch

from evaluation.fidelity import decode_fidelity, step_metrics, summarize
from tests.evaluation_tiny_models import greedy_without_cache, half_pruned, tiny_model


def test_identical_logits_have_zero_kl_and_never_diverge():
    logits = torch.randn(6, 10)
    m = step_metrics(logits, logits.clone(), logits.argmax(-1))
    assert m["kl"].abs().max() < 1e-12 and m["top1_agree"].all()
    assert m["tokens_to_divergence"] == 6 and not m["diverged"]


def test_known_kl_value():
    p, q = torch.tensor([[0.5, 0.5]], dtype=torch.float64), torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    m = step_metrics(p.log(), q.log(), torch.tensor([0]))
    assert m["kl"].item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-9)


def test_divergence_is_the_first_step_where_the_pruned_choice_differs():
    dense = torch.zeros(5, 4)
    dense[:, 2] = 1.0  # dense always picks token 2
    pruned = dense.clone()
    pruned[3, 0] = 5.0  # pruned picks token 0 at step 3 ...
    pruned[4, 1] = 5.0  # ... and token 1 at step 4
    m = step_metrics(dense, pruned, torch.full((5,), 2))
    assert m["tokens_to_divergence"] == 3 and m["diverged"]
    assert m["top1_agree"].tolist() == [True, True, True, False, False]
    summary = summarize([m, step_metrics(dense, dense, torch.full((5,), 2))])
    assert summary["top1_agreement"] == pytest.approx(8 / 10)
    assert summary["tokens_to_divergence_mean"] == 4.0 and summary["never_diverged"] == 0.5
    assert len(summary["kl_by_step"]) == 5


def test_on_tiny_models_divergence_matches_free_running_greedy():
    dense, pruned = tiny_model(), half_pruned(tiny_model())
    prompts = [[1, 5, 9], [3, 3, 7, 11, 2]]
    references = [(p, greedy_without_cache(dense, p, 12)) for p in prompts]
    same = decode_fidelity(dense, dense, references)
    assert same["kl"] < 1e-9 and same["top1_agreement"] == 1.0 and same["never_diverged"] == 1.0
    result = decode_fidelity(dense, pruned, references)
    assert result["kl"] > 0 and result["decode_tokens"] == 24
    expected = []
    for prompt, dense_tokens in references:
        own = greedy_without_cache(pruned, prompt, 12)
        expected.append(next((t for t, (a, b) in enumerate(zip(own, dense_tokens)) if a != b), 12))
    assert result["tokens_to_divergence_mean"] == pytest.approx(sum(expected) / 2)


def test_each_domain_is_summarized_on_its_own_references():
    dense, pruned = tiny_model(), half_pruned(tiny_model())
    prompts = {"writing": [[1, 5, 9], [4, 8]], "code": [[3, 3, 7, 11, 2]]}
    references = {d: [(p, greedy_without_cache(dense, p, 10)) for p in ps] for d, ps in prompts.items()}
    mixed = references["writing"][:1] + references["code"] + references["writing"][1:]
    result = decode_fidelity(dense, pruned, mixed, domains=["writing", "code", "writing"])
    for domain, own in references.items():
        alone = decode_fidelity(dense, pruned, own)
        for metric in ("kl", "top1_agreement", "tokens_to_divergence_mean", "decode_tokens", "sequences"):
            assert result[f"{metric}_{domain}"] == pytest.approx(alone[metric])
    overall = decode_fidelity(dense, pruned, mixed)  # without domains: the same overall metrics, nothing per domain
    assert {k: v for k, v in result.items() if not k.endswith(("_writing", "_code"))} == overall


@pytest.fixture
def pruned_on_a_prompt(tmp_path):
    """A 'pruned' checkpoint (the tiny model) whose metadata says it was calibrated on one prompt."""
    from checkpoint import save_checkpoint
    from prune.calibration import prompt_digest
    from tests.evaluation_tiny_models import TINY

    path = tmp_path / "pruned.pth"
    save_checkpoint(path, tiny_model().state_dict(), TINY,
                    {"calibration": {"kind": "decode", "prompt_sha256": [prompt_digest("Write a poem about rain.")]}})
    return path


def run_fidelity_cli(monkeypatch, argv):
    """python -m evaluation.fidelity with model loading replaced by a marker: returns once loading starts."""
    import sys
    import evaluation.fidelity as fidelity

    class Loaded(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Loaded
    monkeypatch.setattr(fidelity, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(sys, "argv", ["fidelity", *argv])
    with pytest.raises((Loaded, SystemExit)) as raised:
        fidelity.main()
    return raised


def test_cli_refuses_prompts_the_pruned_model_was_calibrated_on(pruned_on_a_prompt, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"prompt": "Name a prime."}\n{"prompt": "Write a poem about rain."}\n')
    raised = run_fidelity_cli(monkeypatch, ["--dense", "d.pth", "--pruned", str(pruned_on_a_prompt), "--prompts", str(prompts)])
    assert raised.type is SystemExit and raised.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: 1 of the 2 evaluation prompts are among the prompts ") and "Write a poem" in line
    prompts.write_text('{"prompt": "Name a prime."}\n')
    assert run_fidelity_cli(monkeypatch, ["--dense", "d.pth", "--pruned", str(pruned_on_a_prompt), "--prompts",
                                          str(prompts)]).type is not SystemExit  # held out: it goes on to load


def test_cli_evaluates_the_whole_file_unless_a_limit_is_given_and_says_so(pruned_on_a_prompt, tmp_path, monkeypatch,
                                                                          capsys):
    prompts = tmp_path / "eval.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(25)))
    base = ["--dense", "d.pth", "--pruned", str(pruned_on_a_prompt), "--prompts", str(prompts)]
    run_fidelity_cli(monkeypatch, base)
    assert f"evaluating all 25 prompts of {prompts}" in capsys.readouterr().out
    run_fidelity_cli(monkeypatch, base + ["--limit", "20"])
    assert f"evaluating the first 20 of the 25 prompts of {prompts} (--limit)" in capsys.readouterr().out


def test_cli_default_prompts_are_the_held_out_split(pruned_on_a_prompt, monkeypatch, capsys):
    from evaluation.data import prompt_rows

    pytest.importorskip("evaluation.data").data_path("longbench_write_en.jsonl")  # the shared data is needed
    run_fidelity_cli(monkeypatch, ["--dense", "d.pth", "--pruned", str(pruned_on_a_prompt)])
    heldout = prompt_rows()[1]
    assert f"evaluating all {len(heldout)} prompts of evaluation.compare's held-out prompts" in capsys.readouterr().out
    assert {row["domain"] for row in heldout} == {"writing", "code"}
