"""Where the evaluation data lives, the two file formats it comes in (jsonl, plain text), and the
split of its prompts into calibration and held-out ones (with the check that keeps them apart).

The data sets are read by path from the project's shared folder (../shared/data beside the repo),
never copied into the repo. SPARSEDECODING_SHARED overrides the shared folder's location.
"""
import gzip
import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return Path(os.environ.get("SPARSEDECODING_SHARED", REPO_ROOT / ".." / "shared")).resolve()


def data_path(name: str) -> Path:
    """Path of a file in the shared data folder; one clear error if it is not there."""
    path = shared_dir() / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found (set SPARSEDECODING_SHARED to the folder holding data/)")
    return path


def open_text(path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_jsonl(path) -> list[dict]:
    with open_text(path) as f:
        rows = []
        for line_number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_number} is not valid JSON ({e.msg})") from None
        return rows


def read_prompts(path, field: str = "prompt") -> list[str]:
    """Prompts from a .jsonl (the `field` of each row, or 'query'/'text' if absent) or a .txt (one per line)."""
    path = Path(path)
    if ".jsonl" in path.suffixes:
        prompts = []
        for row in read_jsonl(path):
            text = next((row[k] for k in (field, "prompt", "query", "text") if k in row), None)
            if text is None:
                raise ValueError(f"{path}: a row has none of the fields '{field}', 'prompt', 'query', 'text'")
            prompts.append(text)
        return prompts
    with open_text(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def write_json_atomic(path, obj):
    """Write JSON to a temp file and rename it, so a crash never leaves half a results file."""
    from checkpoint import atomic_write  # the project's temp+rename helper

    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n"))


def count_to_evaluate(available: int, limit, source: str) -> int:
    """How many of the `available` prompts of `source` to evaluate: all, unless --limit asks for
    fewer; printed either way, so a prompt file is never cut short unseen."""
    if limit is not None and limit < available:
        print(f"evaluating the first {limit} of the {available} prompts of {source} (--limit)")
        return limit
    print(f"evaluating all {available} prompts of {source}")
    return available


def refuse_overlap(calibration_digests, evaluation_prompts: list[str], calibrated_on: str = "calibration prompts"):
    """ValueError (one line) if an evaluation prompt is one the model was calibrated on, compared by
    prune.calibration.prompt_digest: a test set must be disjoint from the calibration set."""
    from prune.calibration import prompt_digest

    digests = set(calibration_digests)
    overlap = [p for p in evaluation_prompts if prompt_digest(p) in digests]
    if overlap:
        first = " ".join(overlap[0].split())[:60]
        raise ValueError(f"{len(overlap)} of the {len(evaluation_prompts)} evaluation prompts are among the "
                         f"{calibrated_on} (first: '{first}'); evaluate on held-out prompts")


def writing_rows(heldout: bool) -> list[dict]:
    """LongBench-Write-en rows ({"prompt", "length", ...}): every third one (0, 3, 6, ...) is held out,
    the others are calibration prompts."""
    rows = read_jsonl(data_path("longbench_write_en.jsonl"))
    return [row for i, row in enumerate(rows) if (i % 3 == 0) == heldout]


def prompt_rows(n_writing_heldout: int = 20, n_code_heldout: int = 10) -> tuple[list[dict], list[dict]]:
    """(calibration rows, held-out rows), disjoint, as {"prompt", "domain", "reference"} (the held-out
    rows without a reference). Calibration: the LongBench-Write-en rows writing_rows does not hold out
    (writing) and MBPP problems 601-974, outside MBPP's test split (code, with their reference
    solutions), alternating one of each while both last, so that any prefix a token budget takes
    holds both domains about equally. Held out: the first n_writing_heldout held-out LongBench-Write-en rows (writing) and
    the first n_code_heldout HumanEval prompts (code)."""
    mbpp = [dict(prompt=row["text"], domain="code", reference=row["code"])
            for row in read_jsonl(data_path("mbpp.jsonl")) if row["task_id"] >= 601]
    humaneval = [dict(prompt=row["prompt"], domain="code")
                 for row in read_jsonl(data_path("HumanEval.jsonl.gz"))[:n_code_heldout]]
    # LongBench-Write has no reference answers: a writing prompt's human text is the prompt alone.
    writing = [dict(prompt=row["prompt"], domain="writing", reference=None) for row in writing_rows(heldout=False)]
    heldout = [dict(prompt=row["prompt"], domain="writing") for row in writing_rows(heldout=True)][:n_writing_heldout]
    return alternate(writing, mbpp), heldout + humaneval


def alternate(first: list, second: list) -> list:
    """first[0], second[0], first[1], second[1], ..., then the rest of the longer list."""
    shared = min(len(first), len(second))
    mixed = [row for pair in zip(first[:shared], second[:shared]) for row in pair]
    return mixed + first[shared:] + second[shared:]


def prompt_split(n_writing_heldout: int = 20, n_code_heldout: int = 10) -> tuple[list[str], list[str]]:
    """(calibration prompts, held-out prompts): the texts of prompt_rows."""
    calibration, heldout = prompt_rows(n_writing_heldout, n_code_heldout)
    return [row["prompt"] for row in calibration], [row["prompt"] for row in heldout]
