"""Plots of measured speed, for the reader who would rather see than read docs/BENCHMARKS.md.

From the JSON files the benchmarks write on the GPU (kept under docs/results/speed/ with their
date in the name), three figures:

- decode: one panel per model and batch size, tokens/s of every process measured (a dot each; the
  bar is the fastest), dense engines first, then each N:M pattern with its byte bound (fastest
  dense x the pattern's bound_speedup) drawn over its bar and issue 41's goal as a dashed line
  (1.6x the fastest dense for Llama-3.1-8B at batch 1, 95 % of the bound for the Qwen3 models).
  Input: scripts/bench_decode.py's bench_decode.json, any number of them.
- kernel: one panel per batch size, each shape's speedup over cuBLAS with issue 41's goal line.
  Input: scripts/bench_kernel.py's --out-json files; a shape and batch in a later file replaces the
  earlier file's row (a re-measured batch size keeps the other batch sizes of an older run).
- dense spread: our dense engine's step time in every fresh process, in named groups, against
  issue 2's 80 %-of-copy line. Input: --spread 'GROUP=FILE,FILE...' (bench_decode.json files; their
  dense rows of our engine at batch 1; gpu_benchmarks.sh dense_spread writes three).

    python scripts/plot_speed.py --decode runs/gpu_benchmarks/decode_*/bench_decode.json \\
        --kernel runs/gpu_benchmarks/kernel_b1/table.json --label "H200" --out docs/results/speed \\
        --spread "fresh processes=$(echo runs/gpu_benchmarks/dense_spread/run*/bench_decode.json | tr ' ' ,)"
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import cli_args  # noqa: E402

KERNEL_GOALS = {1: 1.6, 4: 1.4, 16: 1.0, 2048: 0.95}  # issue 41; batch 8 has none


def decode_processes(paths) -> dict:
    """{(model, batch): {bar label: [tok/s of each process]}} from bench_decode.json files, plus the
    byte bound of each sparse bar ({(model, batch, label): bound_speedup})."""
    processes, bounds = defaultdict(lambda: defaultdict(list)), {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("tok_s") is None:  # not measured (an error or past the run's deadline)
                continue
            # Tensor-parallel rows (bench_decode under torchrun) are bars of their own: ours-tp2 2:4.
            engine = "GPT-Fast" if row["engine"] == "gpt-fast" else "ours" + (f"-tp{row['tp']}" if row.get("tp", 1) > 1 else "")
            label = f"{engine} {row['pattern']}"
            processes[row["model"], row["batch"]][label].append(row["tok_s"])
            if row["pattern"] != "dense":
                bounds[row["model"], row["batch"], label] = row["bound_speedup"]
    return processes, bounds


def decode_goal(model: str, batch: int, fastest_dense: float, bound: float):
    """Issue 41's goal in tokens/s for a sparse bar, or None where it sets none."""
    if model.startswith("Qwen3") and batch == 1:
        return 0.95 * bound * fastest_dense
    return {1: 1.6, 4: 1.4, 8: 1.35, 16: 1.2}.get(batch, 0) * fastest_dense or None


def spread_groups(specs) -> dict:
    """{group: {model: [(step ms, % of copy) of each process]}} from 'GROUP=FILE,FILE...' specs: our
    engine's dense rows at batch 1 (the baseline issue 2's 80 % goal is about)."""
    groups = {}
    for spec in specs:
        group, sep, files = spec.partition("=")
        if not sep or not group or not files:
            sys.exit(f"plot_speed: --spread takes 'GROUP=FILE,FILE...', not {spec!r}")
        groups[group] = defaultdict(list)
        for path in files.split(","):
            for row in json.loads(Path(path).read_text())["rows"]:
                if row["engine"] == "ours" and row["pattern"] == "dense" and row["batch"] == 1:
                    groups[group][row["model"]].append((row["median_step_ms"], row["pct_of_copy"]))
    return groups


def bar_order(label: str):
    """GPT-Fast first, then our dense, then the patterns by M (2:4, 4:8, 8:16, 16:32); one GPU before
    tensor parallel within each."""
    engine, pattern = label.split(" ")
    return (engine != "GPT-Fast", pattern != "dense", int(pattern.split(":")[1]) if ":" in pattern else 0, engine)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plot_decode(paths, out: Path, label: str) -> Path:
    plt = pyplot()
    processes, bounds = decode_processes(paths)
    panels = sorted(processes)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (model, batch) in zip(axes[0], panels):
        bars = sorted(processes[model, batch], key=bar_order)
        dense = processes[model, batch].get("ours dense", [])
        fastest_dense = max(dense) if dense else None
        for i, bar in enumerate(bars):
            runs = processes[model, batch][bar]
            ax.bar(i, max(runs), color="tab:gray" if bar.endswith("dense") else "tab:blue", alpha=0.6)
            ax.plot([i] * len(runs), runs, "k.", ms=5)
            ax.annotate(f"{max(runs):.0f}", (i, max(runs)), ha="center", va="bottom", fontsize=8)
            if fastest_dense and (model, batch, bar) in bounds:
                bound = bounds[model, batch, bar]
                ax.hlines(fastest_dense * bound, i - 0.4, i + 0.4, colors="tab:green",
                          label="byte bound" if i == len(bars) - 1 else None)
                goal = decode_goal(model, batch, fastest_dense, bound)
                if goal:
                    ax.hlines(goal, i - 0.4, i + 0.4, colors="tab:red", linestyles="dashed",
                              label="goal (issue 41)" if i == len(bars) - 1 else None)
        ax.set_xticks(range(len(bars)), [b.replace("ours ", "") for b in bars], rotation=30)
        ax.set_title(f"{model}, batch {batch}", fontsize=10)
        ax.set_ylabel("tokens/s per sequence")
        ax.legend(fontsize=7, loc="lower right")
    return save(fig, out / "decode_speed.png", f"Decode speed, one dot per fresh process ({label})")


def kernel_rows(paths) -> list:
    """The rows of bench_kernel.py's JSON files, one per model, layer and batch; the last file's wins."""
    rows = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            rows[row["model"], row["layer"], row["batch"]] = row
    return list(rows.values())


def plot_kernel(paths, out: Path, label: str) -> Path:
    plt = pyplot()
    rows = kernel_rows(paths)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(batches), 1, figsize=(10, 2.2 * len(batches) + 1), squeeze=False, sharex=True)
    for ax, batch in zip(axes[:, 0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        names = [f"{r['model']} {r['layer']}\n{r['out']}x{r['inp']}" for r in mine]
        speedups = [r["speedup"] for r in mine]
        # Rows with the sparse tensor cores' column (sparse/mma_sp.py) get a second bar beside the SpMV/SpMM's.
        tensor_cores = [r.get("tensor_core_speedup") for r in mine]
        has_tc = any(tensor_cores)
        width = 0.4 if has_tc else 0.8
        goal = KERNEL_GOALS.get(batch)
        colors = ["tab:blue" if goal is None or s >= goal else "tab:orange" for s in speedups]
        ax.bar([i - width / 2 * has_tc for i in range(len(mine))], speedups, width, color=colors,
               label="SpMV/SpMM" if has_tc else None)
        if has_tc:
            ax.bar([i + width / 2 for i in range(len(mine))], [s or 0 for s in tensor_cores], width,
                   color=["tab:green" if goal is None or (s or 0) >= goal else "tab:olive" for s in tensor_cores],
                   label="sparse tensor cores (mma.sp)")
        if goal:
            ax.axhline(goal, color="tab:red", linestyle="dashed", label=f"goal {goal}x (issue 41)")
        if goal or has_tc:
            ax.legend(fontsize=7, loc="lower right")
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(mine)), names, fontsize=7, rotation=60, ha="right")
        ax.set_ylabel("x cuBLAS")
        # bench_kernel.py times the SpMV up to 16 rows; the prefill expands to dense for cuBLAS
        ax.set_title(f"prefill of {batch} tokens (expand + cuBLAS)" if batch > 16 else
                     f"batch {batch} ({'SpMV/SpMM beside the sparse tensor cores' if has_tc else 'SpMV'})",
                     fontsize=9)
    return save(fig, out / "kernel_speedup.png",
                f"2:4 kernels over cuBLAS bf16, per linear shape; orange/olive: under issue 41's goal ({label})")


def plot_spread(specs, out: Path, label: str) -> Path:
    plt = pyplot()
    groups = spread_groups(specs)
    models = sorted({model for processes in groups.values() for model in processes})
    fig, axes = plt.subplots(1, len(models), figsize=(2.2 * len(groups) + 2.5, 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        goal_ms = []
        for i, group in enumerate(groups):
            runs = groups[group].get(model, [])
            ax.plot([i] * len(runs), [ms for ms, _ in runs], "k.", ms=7, alpha=0.7)
            if runs:
                ax.annotate(f"{min(ms for ms, _ in runs):.2f}-{max(ms for ms, _ in runs):.2f} ms\n{len(runs)} processes",
                            (i, max(ms for ms, _ in runs)), xytext=(0, 6), textcoords="offset points",
                            ha="center", fontsize=7)
            # the step at 80 % of copy: this process's step time x its % of copy / 80
            goal_ms += [ms * pct / 80 for ms, pct in runs]
        if goal_ms:
            ax.axhline(sum(goal_ms) / len(goal_ms), color="tab:red", linestyle="dashed", label="80 % of copy (issue 2)")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xticks(range(len(groups)), list(groups), fontsize=8, rotation=15)
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_title(f"{model} dense, batch 1", fontsize=10)
        ax.set_ylabel("decode step, ms (lower is faster)")
    return save(fig, out / "dense_spread.png", f"Our dense decode step, one dot per fresh process ({label})")


def main():
    p = cli_args.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decode", nargs="*", default=[], help="bench_decode.json files")
    p.add_argument("--kernel", nargs="*", default=[],
                   help="bench_kernel.py --out-json files, oldest first (a later file's rows replace the same shape and batch)")
    p.add_argument("--spread", nargs="*", default=[], metavar="GROUP=FILE,FILE...",
                   help="groups of bench_decode.json files: our dense step in each process, side by side")
    p.add_argument("--label", required=True, help="where and when it was measured, for the titles")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    spread_files = [f for spec in args.spread for f in spec.partition("=")[2].split(",") if f]
    missing = [f for f in [*args.decode, *args.kernel, *spread_files] if f and not Path(f).is_file()]
    if missing:
        sys.exit(f"plot_speed: no such file: {', '.join(missing)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.decode:
        print(plot_decode(args.decode, args.out, args.label))
    if args.kernel:
        print(plot_kernel(args.kernel, args.out, args.label))
    if args.spread:
        print(plot_spread(args.spread, args.out, args.label))


if __name__ == "__main__":
    main()
