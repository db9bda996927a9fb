"""Perplexity against a float64 hand computation on a tiny random model."""
import math

import pytest
import torch

from evaluation.perplexity import perplexity, read_text
from tests.evaluation_tiny_models import tiny_model


def hand_perplexity(model, tokens, seq_len):
    """exp(mean NLL) over non-overlapping windows, the first token of each window unpredicted, in float64."""
    model64 = model.double()
    total, count = 0.0, 0
    for start in range(0, len(tokens) - seq_len + 1, seq_len):
        window = tokens[start:start + seq_len]
        model64.setup_caches(1, seq_len)
        with torch.no_grad():
            logits = model64(torch.tensor([window]), torch.arange(seq_len))[0].tolist()
        for position in range(seq_len - 1):
            row = logits[position]
            top = max(row)
            log_normalizer = top + math.log(sum(math.exp(v - top) for v in row))
            total += log_normalizer - row[window[position + 1]]
            count += 1
    return math.exp(total / count), count


def test_matches_float64_hand_computation():
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (100,)).tolist()  # 3 windows of 32; the last 4 tokens are left out
    result = perplexity(tiny_model(), tokens, seq_len=32, progress=False)
    expected, count = hand_perplexity(tiny_model(), tokens, seq_len=32)
    assert result["tokens"] == count == 3 * 31 and result["windows"] == 3
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)


def test_max_windows_and_too_short_text():
    tokens = list(range(64)) * 2
    assert perplexity(tiny_model(), tokens, seq_len=32, max_windows=2, progress=False)["windows"] == 2
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity(tiny_model(), tokens[:10], seq_len=32, progress=False)


def test_read_text_joins_jsonl_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first doc"}\n{"text": "second doc"}\n')
    assert read_text(path) == "first doc\n\nsecond doc"
    assert read_text(path, max_chars=3) == "first doc"
