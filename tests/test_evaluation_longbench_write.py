"""LongBench-Write length score S_l against values worked out by hand from LongWriter's formula."""
import pytest

from evaluation.longbench_write import count_length, evaluate, length_score


@pytest.mark.parametrize("required, produced, expected", [
    (100, 100, 100.0),
    (100, 200, 100 * (1 - 1 / 3)),  # twice as long: (2 - 1) / 3 off
    (100, 400, 0.0),  # four times as long: nothing left
    (100, 1000, 0.0),
    (100, 50, 50.0),  # half as long: (2 - 1) / 2 off
    (300, 100, 0.0),  # a third as long: nothing left
    (100, 0, 0.0),
])
def test_length_score(required, produced, expected):
    assert length_score(required, produced) == pytest.approx(expected)


def test_length_counts_words_and_chinese_characters():
    assert count_length("The cat's hat is well-made, 42 times.") == 7
    assert count_length("你好世界") == 4
    assert count_length("我爱 Python 和 AI") == 5


def test_evaluate_with_a_fake_model():
    rows = [{"prompt": "write 10 words", "length": 10}, {"prompt": "write 20 words", "length": 20}]
    result = evaluate(rows, lambda prompts: ["word " * 10, "word " * 10])
    assert [p["produced"] for p in result["prompts"]] == [10, 10]
    assert result["S_l"] == pytest.approx((100 + 50) / 2)
