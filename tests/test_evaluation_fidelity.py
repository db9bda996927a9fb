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
