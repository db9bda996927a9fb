import pytest

from evaluation.data import alternate, prompt_rows, shared_dir


def test_alternate_takes_one_of_each_then_the_rest():
    assert alternate([1, 2, 3], ["a"]) == [1, "a", 2, 3]
    assert alternate([1], ["a", "b", "c"]) == [1, "a", "b", "c"]
    assert alternate([], ["a"]) == ["a"]


@pytest.mark.skipif(not (shared_dir() / "data" / "mbpp.jsonl").is_file(), reason="needs ../shared/data (MBPP, LongBench-Write)")
def test_calibration_prompts_mix_both_domains_from_the_first_and_never_meet_the_held_out_ones():
    calibration, heldout = prompt_rows(8, 4)
    # a small token budget takes a prefix: it must not be all writing
    assert [row["domain"] for row in calibration[:4]] == ["writing", "code", "writing", "code"]
    writing = sum(row["domain"] == "writing" for row in calibration)
    prefix = [row["domain"] for row in calibration[: 2 * writing]]
    assert prefix.count("writing") == prefix.count("code") == writing
    assert all(row["reference"] for row in calibration if row["domain"] == "code")
    assert not {row["prompt"] for row in calibration} & {row["prompt"] for row in heldout}
    assert [row["domain"] for row in heldout] == ["writing"] * 8 + ["code"] * 4
