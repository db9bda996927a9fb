"""HumanEval, MBPP and ClassEval harnesses: reference solutions pass, wrong ones fail, every program
runs through the sandbox (a generate_fn stands in for the model)."""
import re

import pytest

from evaluation import code_tasks
from evaluation.code_tasks import evaluate, extract_code, score_replies
from evaluation.data import shared_dir

pytestmark = pytest.mark.skipif(not (shared_dir() / "data").is_dir(),
                                reason=f"shared data folder {shared_dir() / 'data'} not found (set SPARSEDECODING_SHARED)")

# ClassEval tasks whose reference solutions need only the standard library and no clock or network.
CLASSEVAL_SAMPLE = ["ClassEval_0", "ClassEval_1", "ClassEval_2"]


def class_name(task):
    return re.search(r"^class (\w+)", task.canonical, re.MULTILINE).group(1)


def first_method(task):
    return re.search(r"^    def ((?!__)\w+)\(", task.canonical, re.MULTILINE).group(1)


def first_tasks(name, n=3):
    return code_tasks.TASKS[name]()[:n]


@pytest.mark.parametrize("name", ["humaneval", "mbpp"])
def test_reference_solutions_pass_and_wrong_ones_fail(name):
    tasks = first_tasks(name)
    good = score_replies(tasks, [t.canonical for t in tasks])
    assert good["pass@1"] == 1.0, good["tasks"]
    wrong = score_replies(tasks, ["```python\ndef nothing():\n    return None\n```"] * len(tasks))
    assert wrong["pass@1"] == 0.0


def test_classeval_is_scored_per_class():
    tasks = [t for t in code_tasks.classeval_tasks() if t.task_id in CLASSEVAL_SAMPLE]
    assert len(tasks) == len(CLASSEVAL_SAMPLE)
    assert score_replies(tasks, [t.canonical for t in tasks])["pass@1"] == 1.0
    # Break one method of each class: the class fails as a whole even though other methods still work.
    broken = [t.canonical + f"\n{class_name(t)}.{first_method(t)} = lambda self, *args, **kwargs: None\n" for t in tasks]
    assert score_replies(tasks, broken)["pass@1"] == 0.0


def test_humaneval_accepts_a_fenced_whole_function_reply():
    task = first_tasks("humaneval", 1)[0]
    reply = ("Here is the function:\n```python\nfrom typing import List\n\n"
             "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
             "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```\n"
             "It compares every pair.")
    assert score_replies([task], [reply])["pass@1"] == 1.0


def test_evaluate_feeds_prompts_to_generate_fn():
    seen = []

    def fake_model(prompts):
        seen.extend(prompts)
        return [t.canonical for t in first_tasks("mbpp", len(prompts))]

    result = evaluate("mbpp", fake_model, limit=2)
    assert len(seen) == 2 and "Your code should pass these tests" in seen[0]
    assert result["passed"] == 2


def test_extract_code_prefers_the_longest_fenced_block_and_tolerates_an_unclosed_one():
    assert extract_code("x\n```python\na = 1\n```\ny\n```\nlonger = 2\n```") == "longer = 2\n"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("    return 1\nprint(f())") == "    return 1"


EARLY_EXITS = ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"]


@pytest.mark.parametrize("exit_call", EARLY_EXITS)
@pytest.mark.parametrize("name", ["humaneval", "mbpp", "classeval"])
def test_a_reply_that_exits_before_the_tests_fails(name, exit_call):
    task = first_tasks(name, 1)[0]
    # The reference solution followed by an exit: the tests never run, so the task must not pass.
    reply = f"```python\n{task.canonical}\n{exit_call}\n```"
    result = score_replies([task], [reply])
    assert result["passed"] == 0, result["tasks"]
    assert score_replies([task], [f"```python\n{task.canonical}\n```"])["passed"] == 1


def test_a_reply_that_rebinds_print_still_reaches_the_marker():
    task = first_tasks("mbpp", 1)[0]
    reply = f"```python\n{task.canonical}\nprint = None\nimport sys\nprint_later = sys.stdout.write('no newline')\n```"
    assert score_replies([task], [reply])["passed"] == 1
