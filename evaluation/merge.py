"""Merge results files of evaluation.compare into one table, plot and verdicts over all their cells.

Long grids run a seed or a backend at a time (one results file each); this pools their cells, so
the mean ± std over seeds, the calibration mix of each source and the verdicts (does each source
beat C4, beyond the seeds' spread?) come out as compare would have written them for the whole grid.
Nothing is pruned or evaluated.

    python -m evaluation.merge docs/results/budget_protocol/sequential_128k*.json \
        --out runs/merged.json --table runs/merged.md --plot runs/merged.png

The files must share the evaluation (held-out set, lengths), the calibration budget, the dense
model's metrics (to a relative 1e-6) and, where a file records them, the pruning flags. A cell
(backend, pattern, calibration, seed) found in two files must hold the same metrics in both: two
different cells under one name mean two pruning rules were mixed.
"""
import json
import math
from pathlib import Path

import cli_args
from evaluation.compare import print_summary, write_outputs

SHARED = ("evaluation", "calibration_tokens", "dense")  # what every merged file must agree on
DENSE_REL_TOL = 1e-6  # the dense model re-measured on another machine differs in float summation order only


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=DENSE_REL_TOL)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def merge(results: list, names: list) -> dict:
    """The results dicts (as compare writes them; names: where each came from, for the errors) as one
    results dict without its table and verdicts (write_outputs adds them)."""
    if not results:
        raise ValueError("no results files to merge")
    first = results[0]
    for result, name in zip(results, names):
        for key in SHARED:
            if not same_value(result.get(key), first.get(key)):
                raise ValueError(f"{name} has {key} {result.get(key)!r}, {names[0]} has {first.get(key)!r}: "
                                 "not the same evaluation")
    recorded = [(result["prune_args"], name) for result, name in zip(results, names) if "prune_args" in result]
    for prune_args, name in recorded:
        if prune_args != recorded[0][0]:
            raise ValueError(f"{name} was pruned with {prune_args}, {recorded[0][1]} with {recorded[0][0]}")
    cells, sources = {}, {}
    for result, name in zip(results, names):
        for run in result["runs"]:
            key = (run["method"], run["pattern"], run["calib"], run["seed"])
            if key in cells and cells[key]["metrics"] != run["metrics"]:
                raise ValueError(f"{name} and {sources[key]} hold different cells for {key[0]} {key[1]} {key[2]} "
                                 f"seed {key[3]}: two pruning rules mixed?")
            cells[key], sources[key] = run, sources.get(key, name)
    return {"checkpoint": first.get("checkpoint"), **{key: first.get(key) for key in SHARED},
            **({"prune_args": recorded[0][0]} if recorded else {}), "merged_from": [str(name) for name in names],
            "runs": [cells[key] for key in sorted(cells)]}


def main():
    parser = cli_args.ArgumentParser(description="Pool evaluation.compare results files into one table and plot.")
    parser.add_argument("files", nargs="+", type=Path, help="results JSONs written by evaluation.compare")
    parser.add_argument("--out", type=Path, required=True, help="merged results JSON")
    parser.add_argument("--table", type=Path, help="markdown table")
    parser.add_argument("--plot", type=Path, help="PNG")
    args = parser.parse_args()
    results = []
    for path in args.files:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            cli_args.exit_with_error(f"cannot read results file {path}: {e}")
        if not isinstance(results[-1], dict) or "runs" not in results[-1]:
            cli_args.exit_with_error(f"{path} is not a results file of evaluation.compare (no 'runs')")
    try:
        merged = merge(results, args.files)
    except ValueError as e:
        cli_args.exit_with_error(f"{e}")
    except KeyError as e:
        cli_args.exit_with_error(f"a run in these results files has no field {e}")
    print_summary(write_outputs(merged, args.out, args.table, args.plot))


if __name__ == "__main__":
    main()
