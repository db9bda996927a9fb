"""HumanEval, MBPP and ClassEval pass@1 with greedy decoding; ClassEval is scored class-level.

A harness needs only `generate_fn(prompts: list[str]) -> list[str]` (the model's replies), so it runs
against any model, or a fake one in tests. Each reply becomes a program (code extracted from a
```python block when there is one, else the raw reply as a completion), the benchmark's tests are
appended, and the program runs in evaluation.sandbox - never in this process. After the tests the
program prints a random token made for that run (the success marker); a task passes only when the
marker is stdout's last line and the program exits 0, so a reply that exits early (sys.exit(0),
os._exit(0), raise SystemExit) before the tests ran fails.

CLI:
  python -m evaluation.code_tasks --task humaneval --checkpoint model.pth --limit 20 --out he.json
  python -m evaluation.code_tasks --task classeval --canonical   # check the harness on the reference solutions
"""
import ast
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

import cli_args
from evaluation.data import data_path, read_jsonl
from evaluation.generation import add_generation_args, load_generate_fn, run_cli
from evaluation.sandbox import run_program

# MBPP's conventional test split (task ids 11-510); 1-10 are few-shot examples, 511+ validation/train.
MBPP_TEST_IDS = range(11, 511)


@dataclass
class CodeTask:
    task_id: str
    prompt: str  # what the model is asked
    canonical: str  # the reference solution, in the form a model reply would take
    build_program: Callable[[str], str]  # code extracted from a reply -> program that runs the tests and
    # raises (exits non-zero) when one fails; score_replies appends the success marker after it


FENCED_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(reply: str) -> str:
    """The code in a model reply: the longest fenced block (an unclosed one counts, a reply may hit the
    token limit mid-block), else the reply itself cut before text that would run at import time."""
    blocks = FENCED_BLOCK.findall(reply)
    if blocks:
        return max(blocks, key=len)
    for stop in ("\nif __name__", "\nprint(", "\nassert "):
        reply = reply.split(stop)[0]
    return reply


# ---- HumanEval ----

def humaneval_tasks(path=None) -> list[CodeTask]:
    tasks = []
    for row in read_jsonl(path or data_path("HumanEval.jsonl.gz")):
        prompt, entry_point = row["prompt"], row["entry_point"]
        tests = f"\n\n{row['test']}\n\ncheck({entry_point})\n"

        def build(code, prompt=prompt, entry_point=entry_point, tests=tests):
            # A reply that redefines the function replaces the stub (the prompt stays for its imports);
            # otherwise the reply is the body that continues the prompt.
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
                return prompt + "\n    pass\n\n" + code + tests
            return prompt + code + tests

        ask = ("Complete the following Python function. Reply with the whole function in a ```python "
               f"code block.\n\n```python\n{prompt}```")
        tasks.append(CodeTask(row["task_id"], ask, row["canonical_solution"], build))
    return tasks


# ---- MBPP ----

def mbpp_tasks(path=None, task_ids=MBPP_TEST_IDS) -> list[CodeTask]:
    wanted = set(task_ids)
    tasks = []
    for row in read_jsonl(path or data_path("mbpp.jsonl")):
        if row["task_id"] not in wanted:
            continue
        asserts = "\n".join(row["test_list"])
        tests = f"\n\n{row.get('test_setup_code', '')}\n{asserts}\n"
        ask = (f"You are an expert Python programmer, and here is your task: {row['text']} "
               f"Your code should pass these tests:\n\n{asserts}\n\nReply with the code in a ```python code block.")
        tasks.append(CodeTask(f"MBPP/{row['task_id']}", ask, row["code"].replace("\r\n", "\n"),
                              lambda code, tests=tests: code + tests))
    return tasks


# ---- ClassEval (class-level: a class passes only if every one of its test cases passes) ----

def classeval_tasks(path=None) -> list[CodeTask]:
    import json

    with open(path or data_path("ClassEval_data.json"), encoding="utf-8") as f:
        rows = json.load(f)
    tasks = []
    for row in rows:
        statements = row["import_statement"]
        if isinstance(statements, str):
            statements = ast.literal_eval(statements)
        imports = "\n".join(statements)  # a reply may drop the skeleton's imports
        tests = (f"\n\n{row['test']}\n\nif not unittest.main(exit=False).result.wasSuccessful():\n"
                 "    raise SystemExit(1)\n")
        ask = (f"Please complete the class {row['class_name']} in the following code. Reply with the whole "
               f"class in a ```python code block.\n\n```python\n{row['skeleton']}\n```")
        tasks.append(CodeTask(row["task_id"], ask, row["solution_code"],
                              lambda code, imports=imports, tests=tests: f"{imports}\nimport unittest\n{code}{tests}"))
    return tasks


TASKS = {"humaneval": humaneval_tasks, "mbpp": mbpp_tasks, "classeval": classeval_tasks}


def success_line(marker: str) -> str:
    """Appended after the tests: prints `marker` as stdout's last line (buffered output first; os.write,
    so a reply that rebinds print or sys.stdout cannot swallow it)."""
    return ("\n\nimport os as _sandbox_os, sys as _sandbox_sys\n"
            "for _sandbox_stream in (_sandbox_sys.stdout, _sandbox_sys.__stdout__):\n"
            "    try:\n        _sandbox_stream.flush()\n    except Exception:\n        pass\n"
            f"_sandbox_os.write(1, b'\\n{marker}\\n')\n")


def score_replies(tasks: list[CodeTask], replies: list[str], timeout: float = 10.0, memory_mb: int = 1024,
                  workers: int = 2) -> dict:
    """Run each reply's program in the sandbox; returns pass@1 and per-task statuses."""
    markers = [secrets.token_hex(16) for _ in tasks]
    programs = [task.build_program(extract_code(reply)) + success_line(marker)
                for task, reply, marker in zip(tasks, replies, markers, strict=True)]
    with ThreadPoolExecutor(max_workers=workers) as pool:  # each worker only waits on its subprocess
        runs = pool.map(lambda p, m: run_program(p, timeout, memory_mb, success_marker=m), programs, markers)
        results = list(tqdm(runs, total=len(programs), desc="running tests", leave=False))
    per_task = [{"task_id": t.task_id, "status": r.status, "error": r.stderr.strip().splitlines()[-1:]}
                for t, r in zip(tasks, results)]
    passed = sum(r.passed for r in results)
    return {"pass@1": passed / max(len(tasks), 1), "passed": passed, "total": len(tasks), "tasks": per_task}


def evaluate(task_name: str, generate_fn: Callable[[list[str]], list[str]], limit: int | None = None, **run_options) -> dict:
    tasks = TASKS[task_name]()[:limit]
    replies = generate_fn([t.prompt for t in tasks])
    result = score_replies(tasks, replies, **run_options)
    for row, reply in zip(result["tasks"], replies):
        row["reply"] = reply
    return result


def main():
    parser = cli_args.ArgumentParser(description="pass@1 (greedy) on HumanEval, MBPP or ClassEval.")
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--canonical", action="store_true", help="score the reference solutions instead of a model")
    parser.add_argument("--timeout", type=cli_args.positive_float, default=10.0, help="seconds per program")
    parser.add_argument("--memory_mb", type=cli_args.positive_int, default=1024, help="memory limit per program")
    add_generation_args(parser, max_new_tokens=512, batch_size=8)
    args = parser.parse_args()
    if args.canonical == bool(args.checkpoint):
        parser.error("give exactly one of --checkpoint and --canonical")

    def run():
        if args.canonical:
            generate_fn = lambda prompts: [t.canonical for t in TASKS[args.task]()[: len(prompts)]]  # noqa: E731
        else:
            generate_fn = load_generate_fn(args.checkpoint, args.device, args.max_new_tokens, args.batch_size)
        return evaluate(args.task, generate_fn, args.limit, timeout=args.timeout, memory_mb=args.memory_mb)

    run_cli(run, lambda r: f"{args.task} pass@1 = {r['pass@1']:.4f} ({r['passed']}/{r['total']})", args.out)


if __name__ == "__main__":
    main()
