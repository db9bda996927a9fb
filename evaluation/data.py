"""Where the evaluation data lives, and the two file formats it comes in (jsonl, plain text).

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
