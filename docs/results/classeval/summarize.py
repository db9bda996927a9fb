"""Per-class status of the ClassEval runs (first 16 classes, greedy, 1024 new tokens), from the
runner's detail files in the grid workdir: pass/fail, the last error line, the reply's length in
tokens (re-encoded, so +-1), whether it ran into the 1024-token cap, and two descriptive checks (not
scores): does the extracted code define a class, and is it non-empty code that parses.

Run: PYTHONPATH=. .venv/bin/python docs/results/classeval/summarize.py /work/evalrun/grid > docs/results/classeval/status.json
"""
import ast
import json
import re
import sys
from pathlib import Path

from evaluation.code_tasks import extract_code
from tokenizer import find_tokenizer, load_tokenizer

MODELS = ["dense", "sparsegpt-2of4-text-seed0", "sparsegpt-2of4-decode-seed0", "wanda-2of4-text-seed0",
          "wanda-2of4-decode-seed0"]
CAP = 1024

workdir = Path(sys.argv[1])
tokenizer = load_tokenizer(find_tokenizer(workdir.parent / "smollm2" / "model.pth"))
out = {}
for name in MODELS:
    path = workdir / f"{name}.classeval16x{CAP}.detail.json"
    if not path.exists():
        continue
    detail = json.loads(path.read_text())
    rows = []
    for task in detail["tasks"]:
        error = (task["error"] or [""])[-1]
        n_tokens = len(tokenizer.encode(task["reply"]))
        kind = ("passed" if task["status"] == "passed" else "empty reply" if not task["reply"].strip()
                else "does not parse" if error.startswith(("SyntaxError", "IndentationError")) else
                "tests fail" if error.startswith("FAILED") else task["status"] + ": " + error.split(":")[0])
        code = extract_code(task["reply"])
        try:
            ast.parse(code)
            parses = bool(code.strip())  # an empty reply does not count
        except (SyntaxError, ValueError):
            parses = False
        rows.append({"task_id": task["task_id"], "outcome": kind, "error": error[:120], "reply_tokens": n_tokens,
                     "hit_cap": n_tokens >= CAP - 2, "defines_class": bool(re.search(r"^\s*class\s+\w", code, re.M)),
                     "parses": parses})
    counts = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    out[name] = {"passed": detail["passed"], "total": detail["total"], "pass@1": detail["pass@1"],
                 "outcomes": counts, "replies_at_cap": sum(r["hit_cap"] for r in rows),
                 "defines_class": sum(r["defines_class"] for r in rows), "parses": sum(r["parses"] for r in rows),
                 "classes": rows}
print(json.dumps(out, indent=1))
