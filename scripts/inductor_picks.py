"""Each kernel Inductor's coordinate descent tuned: the config it picked, the time it measured for
that config while tuning, and (with a profile) the kernel's time a call inside the decode step.

    TORCH_LOGS=+torch._inductor.runtime.coordinate_descent_tuner python3 scripts/bench_decode.py \
        --patterns dense --profile --out runs/d > runs/d.log 2>&1
    python scripts/inductor_picks.py runs/d.log runs/d/profile_Llama-3.1-8B_dense_b1.txt

The tuner's debug log ends each kernel's search with "NAME: Improve from BASELINE T0 -> PICK T1,
Rx" (torch/_inductor/runtime/coordinate_descent_tuner.py; times in ms). dense_spread.sh sets the
two times side by side for every fresh process: a pick that measured fast while tuning and runs
slow in the step says the tuner's measurement misleads it; one that measured slow says the search
stopped early. (Naming the picks from the *.best_config files through Triton's cache named none
of 20-23 on the H200, twice, on 2026-12-04.)
"""
import re
import sys
from pathlib import Path

SEARCH_END = re.compile(r"(?P<name>\w+): Improve from (?P<baseline>.*) (?P<baseline_ms>[\d.]+) -> "
                        r"(?P<pick>.*) (?P<pick_ms>[\d.]+), [\d.]+x\s*$")
PROFILE_ROW = re.compile(r"^\s*(?P<us_step>[\d.]+)\s+(?P<calls>[\d.]+)\s+(?P<name>\S+)")


def tuned_kernels(log_text: str) -> dict:
    """{kernel name: (picked config, µs measured for it, µs measured for the baseline)}, the last
    search of each name (a kernel compiled twice is tuned twice)."""
    picks = {}
    for line in log_text.splitlines():
        found = SEARCH_END.search(line)
        if found:
            picks[found["name"]] = (found["pick"], 1000 * float(found["pick_ms"]), 1000 * float(found["baseline_ms"]))
    return picks


def step_times(profile_text: str) -> dict:
    """{kernel name: µs a call} from a --profile table (its first block of rows)."""
    times = {}
    for line in profile_text.splitlines()[2:]:
        if not line.strip():
            break
        row = PROFILE_ROW.match(line)
        if row and float(row["calls"]) > 0:
            times[row["name"]] = float(row["us_step"]) / float(row["calls"])
    return times


def report(log_text: str, profile_text: str = "") -> list[str]:
    in_step = step_times(profile_text)
    lines = []
    for name, (pick, tuned_us, baseline_us) in tuned_kernels(log_text).items():  # in the order tuned
        step = f"{in_step[name]:.1f}" if name in in_step else "-"
        lines.append(f"{name} | tuned {tuned_us:.1f} us (baseline {baseline_us:.1f}) | in the step {step} us a call"
                     f" | {pick}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or not all(Path(p).is_file() for p in sys.argv[1:]):
        sys.exit("usage: python scripts/inductor_picks.py RUN_LOG [PROFILE_TXT] (existing files; the log of a run "
                 "with TORCH_LOGS=+torch._inductor.runtime.coordinate_descent_tuner)")
    texts = [Path(p).read_text(errors="replace") for p in sys.argv[1:]]
    lines = report(*texts)
    print("\n".join(lines) if lines else "no coordinate-descent searches in the log (was TORCH_LOGS set?)")
