"""The comparison runner: dense vs pruned models calibrated on five sources, per backend and pattern,
over seeds, on decode fidelity (writing, code and overall), perplexity and (optionally) task scores; a
paper-style table and a plot.

Sources (--sources; every one counts the same --tokens budget, prune/calibration.py says how):
  c4            teacher-forced C4 windows, every position (python -m prune --calib text);
  decode        the dense model's own continuations of the calibration prompts, decode positions
                only (the paper's rule);
  decode_first  the same, plus each sequence's first position (the attention sink);
  generated     the same generated sequences, every position counted, prompt included;
  reference     teacher-forced calibration prompts with their human reference answers (MBPP's
                solutions; the writing prompts have none, so their prompts alone).
decode vs generated isolates the prompt-exclusion rule, decode vs reference self-generated vs human
text, reference vs c4 the domain. Every table prints each cell's calibration mix (share of counted
tokens per domain, and how many are prompt positions), also recorded in each checkpoint's metadata.

For every (method, pattern, source, seed) it prunes the dense checkpoint with prune's public
functions, as `python -m prune` would, then evaluates it. Each metric is cached as JSON next to the
checkpoint and a cell is pruned only when one of its metrics is missing and its checkpoint is absent, so
a run can be resumed or extended, and a measured cell's checkpoint deleted to save disk. Each
decode calibration (the dense model's generations, shared by decode, decode_first and generated and by
every backend and pattern at one seed) is cached in the workdir.

Prompt split (nothing is evaluated on prompts it was calibrated on; checked before any work):
  calibration:         LongBench-Write-en rows whose index is not a multiple of 3 (domain writing)
                       and MBPP problems 601-974 (outside MBPP's test split; domain code, with
                       their reference solutions), alternating while the writing rows last;
  held-out (fidelity): LongBench-Write-en rows 0, 3, 6, ... (writing) and the first HumanEval
                       prompts (code); fidelity is reported per domain and overall.
Perplexity is measured on WikiText-2 test and, with --c4_ppl_tokens, on held-out C4: the documents of
c4_sample.jsonl (the C4 calibration source) that no text calibration of seeds 0-2 (and --seeds) at up
to 32768 tokens (or --tokens) reads - in-distribution for the C4-calibrated cells, so it favours them.
Task scores (greedy): pass@1 on the first --task_limit HumanEval / MBPP-test / ClassEval problems, and
LongBench-Write S_l on the first --task_limit held-out writing prompts.

CLI: python -m evaluation.compare --checkpoint dense.pth --workdir runs/grid --seeds 0 1 2 --tokens 16384
         [--methods sparsegpt wanda] [--patterns 2:4 8:16 50%] [--sources c4 decode decode_first generated reference]
         [--tasks humaneval mbpp longbench_write --task_limit 20]
         --out docs/results.json --plot docs/results.png --table docs/results_table.md
"""
import argparse
import functools
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import cli_args
from checkpoint import atomic_write
from evaluation.data import data_path, prompt_rows, refuse_overlap, write_json_atomic, writing_rows
from evaluation.generation import USER_ERRORS
from prune import (CalibrationError, CalibrationSet, calibrate_by_decoding, prune_model, read_source,
                   text_windows)
from prune.calibration import (from_decode, mix_label, prompt_digest, prompt_file_record, read_documents,
                               read_prompt_rows, reference_calibration)
from prune.run import add_pruning_args

SOURCES = ("c4", "decode", "decode_first", "generated", "reference")
BASELINE = "c4"
# "text" is the C4 source's name in results files written before the sources had their own names.
SOURCE_LABEL = {"c4": "C4", "text": "C4", "decode": "decode-only", "decode_first": "decode + first",
                "generated": "generated, all positions", "reference": "human reference"}
DOMAINS = ("writing", "code")  # of the held-out prompts; fidelity is reported per domain and overall
SPREAD_NOTE = {True: "", False: ", within seed spread", None: ", one seed (no spread)"}
# (metric key, label, True if higher is better); each fidelity metric also per domain (key_<domain>)
FIDELITY_METRICS = [("kl", "KL(dense||pruned)", False), ("top1_agreement", "top-1 agree", True),
                    ("tokens_to_divergence_mean", "tokens to diverge", True)]
METRICS = [(f"{key}{suffix}", f"{label}{name}", higher) for key, label, higher in FIDELITY_METRICS
           for suffix, name in [("", ""), *((f"_{d}", f" {d}") for d in DOMAINS)]] + \
          [("wikitext2_ppl", "WikiText-2 PPL", False), ("c4_ppl", "C4 PPL (held-out docs)", False)]
# Held-out C4 excludes every document that a text calibration at these seeds and budget could read.
C4_EXCLUDED_SEEDS, C4_EXCLUDED_TOKENS = (0, 1, 2), 32768


def c4_calibration_documents(tokenizer, documents: list[str], seeds, tokens: int, window_len: int) -> set[int]:
    """Indices of the documents prune.calibration.text_windows reads at these seeds and budget: the
    windows are cut from these only. Per seed it reads a prefix of its seeded shuffle, until it holds
    twice the tokens it needs, so a larger budget reads a superset of a smaller one."""
    need = 2 * math.ceil(tokens / window_len) * window_len
    read = set()
    for seed in seeds:
        held = 0
        for i in torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist():
            read.add(i)
            held += len(tokenizer.encode(documents[i], bos=True))
            if held >= need:
                break
    return read


def c4_heldout(tokenizer, path, n_tokens: int, seeds, tokens: int, window_len: int) -> tuple[list[int], dict]:
    """The first n_tokens of the documents of a C4 calibration file that no text calibration at these
    seeds and budget reads (in file order, joined by blank lines as evaluation.perplexity reads jsonl),
    and a record of the split."""
    documents = read_documents(path)
    excluded = c4_calibration_documents(tokenizer, documents, seeds, tokens, window_len)
    kept = [i for i in range(len(documents)) if i not in excluded]
    ids = tokenizer.encode("\n\n".join(documents[i] for i in kept))[:n_tokens]
    if len(ids) < n_tokens:
        raise ValueError(f"held-out C4 has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    info = {"file": str(path), "documents": len(documents), "excluded_documents": sorted(excluded),
            "excluded_by": {"seeds": list(seeds), "tokens": tokens, "window_len": window_len},
            "heldout_documents": len(kept), "tokens": len(ids)}
    return ids, info


def run_name(method: str, pattern: str, calib: str, seed: int) -> str:
    return f"{method}-{pattern.replace(':', 'of').replace('%', 'pct')}-{calib}-seed{seed}"


# compare's own sampling for decoding-aware calibration: python -m prune's defaults, the paper's.
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.8)


def prune_argv(args, method, pattern, calib, seed, calib_prompts: Path, out: Path) -> list[str]:
    """The `python -m prune` arguments that make the same checkpoint as one cell (written to its log)."""
    if calib == BASELINE:
        source = ["--calib", "text", "--text", str(data_path("c4_sample.jsonl")), "--seq_len", str(args.calib_seq_len)]
    elif calib == "reference":
        source = ["--calib", calib, "--prompts", str(calib_prompts)]
    else:
        source = ["--calib", calib, "--prompts", str(calib_prompts), "--max_new_tokens", str(args.calib_max_new_tokens),
                  "--batch_size", str(args.calib_batch_size)]
    return ["--checkpoint", str(args.checkpoint), "--method", method, "--pattern", pattern, *source,
            "--tokens", str(args.tokens), "--seed", str(seed), "--device", args.device, "--out", str(out),
            *args.prune_args]


def prune_options(prune_args: list[str]) -> dict:
    """compare's --prune_args (python -m prune's pruning flags, prune.run.add_pruning_args) as
    prune_model's keywords; any other flag is refused (a grid varies its calibration by --sources)."""
    parser = cli_args.ArgumentParser(prog="--prune_args", add_help=False)
    add_pruning_args(parser)
    options, unknown = parser.parse_known_args(prune_args)
    if unknown:
        flags = [a.option_strings[-1] for a in parser._actions if a.option_strings]
        raise ValueError(f"--prune_args: cannot pass on {' '.join(unknown)} (only {', '.join(flags)})")
    return vars(options)


def prune(args, method, pattern, calib, seed, calib_prompts: Path, out: Path):
    """Prune one cell (skipped when its checkpoint exists) with prune's public functions, as `python -m
    prune <prune_argv>` would, except that the decode calibration comes from the cache (see
    cached_calibration). The command and timings go to <out>.log."""
    if out.exists():
        return
    options = prune_options(args.prune_args)
    started = time.perf_counter()
    source = read_source(args.checkpoint)  # the cell's one read of the checkpoint
    calibration = cached_calibration(args, source, calib, seed, calib_prompts)
    calibration_seconds = time.perf_counter() - started
    pruned = prune_model(source.model, calibration, method, pattern, device=args.device, seed=seed,
                         metadata=source.provenance(), **options)
    pruned.save(out)
    metadata = pruned.metadata
    summary = (f"python -m prune {' '.join(prune_argv(args, method, pattern, calib, seed, calib_prompts, out))}\n"
               f"{metadata['calibration']['counted_tokens']} calibration tokens "
               f"({metadata['calibration'].get('reused_from', 'made for this cell')}); calibration "
               f"{calibration_seconds:.1f} s, pruning {metadata['timing']['prune_seconds']:.1f} s\n")
    out.with_suffix(".log").write_text(summary)
    write_json_atomic(out.with_suffix(".mix.json"), metadata["calibration"]["mix"])
    tqdm.write(summary)


def calibration_mix(checkpoint: Path) -> dict | None:
    """The calibration mix a cell's checkpoint records (prune() keeps a copy beside it, so a
    re-tabulation does not open the checkpoint); None for checkpoints pruned without one."""
    copy = checkpoint.with_suffix(".mix.json")
    if copy.exists():
        return json.loads(copy.read_text())
    if not checkpoint.exists():
        return None
    from checkpoint import load_checkpoint
    return load_checkpoint(checkpoint, mmap=True)[2].get("calibration", {}).get("mix")


def cached_calibration(args, source, calib: str, seed: int, calib_prompts: Path):
    """The calibration set of one cell. decode, decode_first and generated come from one seeded
    generation by the dense model: the same for every backend and pattern at one seed and budget, and
    on a CPU the slowest part of a cell, so it is made once and kept in --calibration_cache (default:
    the workdir) under a name derived from what decides the generation and the prompts; C4 windows
    and reference text are cut afresh (seconds)."""
    from tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source.tokenizer_dir())
    if calib == BASELINE:
        return text_windows(tokenizer, data_path("c4_sample.jsonl"), args.tokens, args.calib_seq_len, seed)
    if calib == "reference":
        rows = read_prompt_rows(calib_prompts)
        calibration = reference_calibration(tokenizer, rows, args.tokens)
        calibration.info.update(prompt_file_record(calib_prompts, rows))
        return calibration
    return from_decode(cached_decode_calibration(args, source, tokenizer, seed, calib_prompts), calib, args.tokens)


def cached_decode_calibration(args, source, tokenizer, seed: int, calib_prompts: Path) -> CalibrationSet:
    """The decode calibration of one seed, from the cache or generated and cached."""
    # Named as python -m prune names these settings, so the cache files keep their names.
    key = dict(checkpoint=str(args.checkpoint), generator="None", tokens=str(args.tokens),
               max_new_tokens=str(args.calib_max_new_tokens), seed=str(seed), batch_size=str(args.calib_batch_size),
               **{name: str(value) for name, value in SAMPLING.items()}, greedy="False", device=str(args.device))
    key["prompts_sha256"] = hashlib.sha256(Path(calib_prompts).read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(args.calibration_cache or args.workdir) / f"calibration-decode-{args.tokens}tok-seed{seed}-{digest}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return CalibrationSet(saved["sequences"], saved["counted"], dict(saved["info"], reused_from=str(path)),
                              saved.get("domains"), saved.get("prompt_lengths"))
    device = torch.device(args.device)
    calibration = calibrate_by_decoding(source, tokenizer, calib_prompts, args.tokens, args.calib_max_new_tokens,
                                        device=device, seed=seed, batch_size=args.calib_batch_size, **SAMPLING,
                                        compile=device.type == "cuda")
    atomic_write(path, lambda tmp: torch.save(dict(key=key, sequences=calibration.sequences,
                                                   counted=calibration.counted, info=calibration.info,
                                                   domains=calibration.domains,
                                                   prompt_lengths=calibration.prompt_lengths), tmp))
    return calibration


def evaluate_checkpoint(args, model, context: dict) -> dict:
    """Decode fidelity against the dense model (skipped for the dense model itself) and perplexity."""
    from evaluation.fidelity import decode_fidelity
    from evaluation.perplexity import perplexity

    is_dense = model is context["dense"]
    metrics = {} if is_dense else decode_fidelity(context["dense"], model, context["references"], context["dense_logits"],
                                                  context["domains"])
    metrics["wikitext2_ppl"] = perplexity(model, context["wikitext_ids"], args.seq_len)["perplexity"]
    return metrics


def task_score(args, task: str, model, tokenizer, detail_path: Path) -> dict:
    """One task on greedy replies, its first --task_limit items: pass@1 for the code benchmarks, S_l
    for LongBench-Write on the held-out writing prompts. Replies and per-item scores go to detail_path."""
    from evaluation import code_tasks, longbench_write
    from evaluation.generation import make_generate_fn

    generate_fn = make_generate_fn(model, tokenizer, args.task_max_new_tokens, args.batch_size)
    if task == "longbench_write":
        result = longbench_write.evaluate(writing_rows(heldout=True)[: args.task_limit], generate_fn)
        score = {"longbench_write_S_l": result["S_l"]}
    else:
        result = code_tasks.evaluate(task, generate_fn, args.task_limit)
        score = {f"{task}_pass@1": result["pass@1"]}
    write_json_atomic(detail_path, result)
    return score


def aggregate(runs: list[dict]) -> dict:
    """{(method, pattern, calib): {metric: (mean, std, n)}} over seeds."""
    groups = {}
    for run in runs:
        groups.setdefault((run["method"], run["pattern"], run["calib"]), []).append(run["metrics"])
    table = {}
    for key, metric_list in groups.items():
        table[key] = {}
        for metric in dict.fromkeys(m for metrics in metric_list for m in metrics):  # a task may lack some seeds
            values = [m[metric] for m in metric_list if isinstance(m.get(metric), (int, float))]
            if values:
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                table[key][metric] = (statistics.mean(values), spread, len(values))
    return table


def mix_labels(runs: list[dict]) -> dict:
    """{(method, pattern, calib): prune.calibration.mix_label of the seeds that recorded a mix}."""
    groups = {}
    for run in runs:
        if run.get("calibration_mix"):
            groups.setdefault((run["method"], run["pattern"], run["calib"]), []).append(run["calibration_mix"])
    return {key: mix_label(mixes) for key, mixes in groups.items()}


def sources_in(table: dict) -> list[str]:
    """The calibration sources of a table: SOURCES' order first, then any other name in the results."""
    present = {k[2] for k in table}
    return [s for s in SOURCES if s in present] + sorted(present - set(SOURCES))


def metric_columns(table: dict) -> list[tuple[str, str, bool]]:
    present = {m for row in table.values() for m in row}
    task_metrics = sorted(m for m in present if m.endswith(("pass@1", "_S_l")))
    return [c for c in METRICS if c[0] in present] + [(m, m, True) for m in task_metrics]


def markdown_table(table: dict, dense: dict, mixes: dict | None = None) -> str:
    """One row per backend x pattern x calibration source, mean ± std over seeds, with the source's
    calibration mix (mix_labels)."""
    columns, mixes = metric_columns(table), mixes or {}
    lines = ["| backend | pattern | calibration | calibration mix | seeds | "
             + " | ".join(label for _, label, _ in columns) + " |", "|" + "---|" * (5 + len(columns))]
    lines.append("| dense | - | - | - | - | " + " | ".join(_fmt(dense.get(key)) for key, _, _ in columns) + " |")
    for method, pattern in sorted({(k[0], k[1]) for k in table}):
        for calib in sources_in(table):
            row = table.get((method, pattern, calib))
            if row is None:
                continue
            n = max(v[2] for v in row.values())
            cells = [_fmt_spread(row.get(key), n) for key, _, _ in columns]
            mix = mixes.get((method, pattern, calib), "-")
            lines.append(f"| {method} | {pattern} | {SOURCE_LABEL.get(calib, calib)} | {mix} | {n} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdicts(table: dict) -> list[dict]:
    """Per backend x pattern x source x metric: does the source beat C4, by how much, and is the gap
    larger than the seeds' spread (|difference| > std_C4 + std_source; None when a side has one seed,
    so no spread)?"""
    rows = []
    for method, pattern in sorted({(k[0], k[1]) for k in table}):
        c4 = table.get((method, pattern, BASELINE)) or table.get((method, pattern, "text"))
        for source in sources_in(table):
            other = table.get((method, pattern, source))
            if not (c4 and other) or other is c4:
                continue
            for key, label, higher_better in metric_columns(table):
                if key in c4 and key in other:
                    (m_c4, s_c4, n_c4), (m_src, s_src, n_src) = c4[key], other[key]
                    rows.append({"method": method, "pattern": pattern, "source": source, "metric": label,
                                 "c4": m_c4, "value": m_src, "better": m_src > m_c4 if higher_better else m_src < m_c4,
                                 "tie": m_src == m_c4,
                                 "beyond_spread": abs(m_src - m_c4) > s_c4 + s_src if min(n_c4, n_src) > 1 else None})
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def _fmt_spread(cell, n_row: int) -> str:
    """mean ± std; a metric measured on fewer seeds than its row says on how many."""
    if cell is None:
        return "-"
    mean, std, n = cell
    return f"{_fmt(mean)} ± {_fmt(std)}" if n == n_row else f"{_fmt(mean)} ± {_fmt(std)} (n={n})"


def plot(table: dict, dense: dict, path):
    """One panel per metric, bars per calibration source with the seed spread; the fidelity metrics
    on a row each: overall, writing, code."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = metric_columns(table)
    pairs = sorted({(k[0], k[1]) for k in table})
    sources = sources_in(table)
    per_row = 1 + len(DOMAINS)
    n_rows = math.ceil(len(columns) / per_row)
    fig, axes = plt.subplots(n_rows, per_row, figsize=(5 * per_row, 3.8 * n_rows), squeeze=False)
    width = 0.8 / len(sources)
    for ax, (key, label, higher_better) in zip(axes.flat, columns):
        x = range(len(pairs))
        for k, calib in enumerate(sources):
            cells = [table.get((m, p, calib), {}).get(key, (float("nan"), 0.0, 0)) for m, p in pairs]
            ax.bar([i + (k - (len(sources) - 1) / 2) * width for i in x], [c[0] for c in cells], width=width,
                   yerr=[c[1] for c in cells], capsize=2, label=SOURCE_LABEL.get(calib, calib))
        if key in dense:
            ax.axhline(dense[key], color="black", linestyle=":", label="dense")
        ax.set_xticks(list(x), [f"{m}\n{p}" for m, p in pairs], fontsize=8)
        ax.set_title(f"{label} ({'higher' if higher_better else 'lower'} is better)", fontsize=9)
        if key.startswith("kl") or key in ("wikitext2_ppl", "c4_ppl"):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(columns):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = cli_args.ArgumentParser(description="Pruning calibrated on C4, decode positions, generated or human "
                                     "text of the task domain: prune, evaluate (writing, code, overall), tabulate, plot.")
    parser.add_argument("--checkpoint", type=Path, required=True, help="dense source checkpoint")
    parser.add_argument("--workdir", type=Path, required=True, help="pruned checkpoints and cached metrics")
    parser.add_argument("--methods", nargs="+", default=["sparsegpt", "wanda"])
    parser.add_argument("--patterns", nargs="+", default=["2:4", "8:16", "50%"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                        help="calibration sources (see the module docstring): c4 teacher-forced; decode positions only; "
                             "decode_first also the first position; generated every position of the same sequences; "
                             "reference the prompts with their human reference answers")
    parser.add_argument("--tokens", type=cli_args.positive_int, default=16384,
                        help="calibration budget in counted tokens, the same for every source")
    parser.add_argument("--calib_max_new_tokens", type=cli_args.positive_int, default=256, help="decode calibration: tokens per prompt")
    parser.add_argument("--calib_batch_size", type=cli_args.positive_int, default=16, help="decode calibration: prompts generated at once")
    parser.add_argument("--calib_seq_len", type=cli_args.positive_int, default=512, help="text calibration: window length")
    parser.add_argument("--calibration_cache", type=Path,
                        help="folder of cached decode calibrations (default: --workdir); share it between workdirs")
    parser.add_argument("--prune_args", nargs=argparse.REMAINDER, default=[],
                        help="pruning flags of python -m prune: --one_shot, --include, --exclude, --batch_tokens (put last)")
    parser.add_argument("--heldout_writing", type=cli_args.non_negative_int, default=20, help="LongBench-Write prompts held out (at most 20)")
    parser.add_argument("--heldout_code", type=cli_args.non_negative_int, default=10, help="HumanEval prompts held out")
    parser.add_argument("--max_new_tokens", type=cli_args.positive_int, default=128, help="length of the dense reference generations")
    parser.add_argument("--ppl_tokens", type=cli_args.positive_int, default=32768)
    parser.add_argument("--seq_len", type=cli_args.positive_int, default=512, help="perplexity window")
    parser.add_argument("--c4_ppl_tokens", type=cli_args.non_negative_int, default=0,
                        help="also perplexity on this many held-out C4 tokens (documents no text calibration "
                             "reads; see the module docstring), cached on its own; 0: off")
    parser.add_argument("--tasks", nargs="*", default=[], choices=["humaneval", "mbpp", "classeval", "longbench_write"],
                        help="task scores, each cached on its own (adding a task re-runs nothing else)")
    parser.add_argument("--task_limit", type=cli_args.positive_int, default=20)
    parser.add_argument("--task_max_new_tokens", type=cli_args.positive_int, default=384)
    parser.add_argument("--batch_size", type=cli_args.positive_int, default=8)
    parser.add_argument("--device", type=cli_args.device, default="cpu")
    parser.add_argument("--existing_only", action="store_true",
                        help="tabulate what is measured in --workdir (cells with fidelity and perplexity, task scores), "
                             "never measure")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument("--plot", type=Path, help="PNG")
    parser.add_argument("--table", type=Path, help="markdown table")
    args = parser.parse_args()
    if BASELINE in args.sources and args.tokens % args.calib_seq_len:
        parser.error(f"--tokens {args.tokens} is not a multiple of --calib_seq_len {args.calib_seq_len}: the C4 windows "
                     f"would count more tokens than the other sources")
    try:
        prune_options(args.prune_args)  # a bad flag stops the grid before any work
        results = run_grid(args)
    except (*USER_ERRORS, CalibrationError) as e:
        cli_args.exit_with_error(e)
    print_summary(results)


def run_grid(args) -> dict:
    """Prune and evaluate cell by cell (seed-major, so the first seed of every cell lands first) and
    rewrite the results after each one: an interrupted grid still leaves a table of what finished."""
    from evaluation.fidelity import decode_step_logits, dense_references
    from evaluation.generation import load_model, load_model_and_tokenizer
    from evaluation.perplexity import read_text

    args.workdir.mkdir(parents=True, exist_ok=True)
    calibration, heldout_rows = prompt_rows(args.heldout_writing, args.heldout_code)
    heldout, heldout_domains = [row["prompt"] for row in heldout_rows], [row["domain"] for row in heldout_rows]
    refuse_overlap({prompt_digest(row["prompt"]) for row in calibration}, heldout + [
        row["prompt"] for row in writing_rows(heldout=True)[: args.task_limit] if "longbench_write" in args.tasks])
    calib_prompts = args.workdir / "calibration_prompts.jsonl"
    prompt_lines = "".join(json.dumps(row) + "\n" for row in calibration)
    if not calib_prompts.exists() or calib_prompts.read_text() != prompt_lines:  # another runner may be reading it
        atomic_write(calib_prompts, lambda tmp: Path(tmp).write_text(prompt_lines))

    context = {}

    def evaluation_context() -> dict:
        """The dense model, its reference generations and decode-step logits: built on first need,
        so a grid whose metrics are all cached is re-tabulated without running a model."""
        if context:
            return context
        dense, tokenizer = load_model_and_tokenizer(args.checkpoint, args.device)
        references_path = args.workdir / f"dense_references_{len(heldout)}x{args.max_new_tokens}.json"
        if references_path.exists():
            references = [tuple(r) for r in json.loads(references_path.read_text())]
        else:
            references = dense_references(dense, tokenizer, heldout, args.max_new_tokens, args.batch_size)
            write_json_atomic(references_path, references)
        kept = [(r, d) for r, d in zip(references, heldout_domains, strict=True) if r[1]]
        references, domains = [r for r, _ in kept], [d for _, d in kept]
        wikitext = read_text(data_path("wikitext2_test.raw"), max_chars=8 * args.ppl_tokens)
        context.update(dense=dense, tokenizer=tokenizer, references=references, domains=domains,
                       wikitext_ids=tokenizer.encode(wikitext)[: args.ppl_tokens],
                       dense_logits=decode_step_logits(dense, references))
        return context

    # "-domains": fidelity per domain too (metrics cached without it are measured again)
    eval_key = f"ppl{args.ppl_tokens}x{args.seq_len}-refs{len(heldout)}x{args.max_new_tokens}-domains"
    c4_seeds = sorted(set(C4_EXCLUDED_SEEDS) | set(args.seeds))
    c4_budget = max(C4_EXCLUDED_TOKENS, args.tokens)
    c4_key = (f"c4ppl{args.c4_ppl_tokens}x{args.seq_len}-excl{c4_budget}x{args.calib_seq_len}"
              f"seeds{'_'.join(map(str, c4_seeds))}")

    def c4_ids() -> list[int]:
        if "c4_ids" not in context:
            ids, info = c4_heldout(evaluation_context()["tokenizer"], data_path("c4_sample.jsonl"),
                                   args.c4_ppl_tokens, c4_seeds, c4_budget, args.calib_seq_len)
            write_json_atomic(args.workdir / f"c4_heldout.{c4_key}.json", info)
            context["c4_ids"] = ids
        return context["c4_ids"]

    task_keys = {task: f"{task}{args.task_limit}x{args.task_max_new_tokens}" for task in args.tasks}

    def metrics_of(name: str, load) -> dict:
        """Fidelity and perplexity, then each task score, each from its cache or measured (the model
        is loaded only if something is measured)."""
        metrics = cached_metrics(args.workdir / f"{name}.{eval_key}.json",
                                 lambda: evaluate_checkpoint(args, load(), evaluation_context()))
        c4_path = args.workdir / f"{name}.{c4_key}.json"
        if args.c4_ppl_tokens and (c4_path.exists() or not args.existing_only):
            from evaluation.perplexity import perplexity
            metrics.update(cached_metrics(c4_path, lambda: {
                "c4_ppl": perplexity(load(), c4_ids(), args.seq_len)["perplexity"]}))
        for task, key in task_keys.items():
            path = args.workdir / f"{name}.{key}.json"
            if path.exists() or not args.existing_only:
                metrics.update(cached_metrics(path, lambda: task_score(
                    args, task, load(), evaluation_context()["tokenizer"], path.with_suffix(".detail.json"))))
        return metrics

    evaluation = "+".join([eval_key, *([c4_key] if args.c4_ppl_tokens else []), *task_keys.values()])  # names what the results were measured with
    dense_metrics = metrics_of("dense", lambda: evaluation_context()["dense"])
    grid = [(m, p, c, s) for s in args.seeds for p in args.patterns for m in args.methods for c in args.sources]
    runs = []
    for method, pattern, calib, seed in tqdm(grid, desc="grid"):
        name = run_name(method, pattern, calib, seed)
        checkpoint = args.workdir / f"{name}.pth"
        if args.existing_only and not (args.workdir / f"{name}.{eval_key}.json").exists():
            continue  # not measured (a checkpoint still being pruned or evaluated elsewhere is not read)

        def pruned_model():  # called within this iteration, only when a metric is missing
            prune(args, method, pattern, calib, seed, calib_prompts, checkpoint)
            return load_model(checkpoint, args.device)
        metrics = metrics_of(name, functools.cache(pruned_model))
        runs.append({"method": method, "pattern": pattern, "calib": calib, "seed": seed,
                     "calibration_mix": calibration_mix(checkpoint), "metrics": metrics})
        write_results(args, runs, dense_metrics, evaluation)
    return write_results(args, runs, dense_metrics, evaluation)


def write_results(args, runs, dense_metrics, evaluation: str) -> dict:
    # prune_args records how the cells were pruned (e.g. --one_shot), so that evaluation.merge can
    # refuse to pool cells pruned two ways.
    return write_outputs({"checkpoint": str(args.checkpoint), "calibration_tokens": args.tokens, "evaluation": evaluation,
                          "prune_args": list(args.prune_args), "dense": dense_metrics, "runs": runs},
                         args.out, args.table, args.plot)


def write_outputs(results: dict, out: Path, table_path: Path = None, plot_path: Path = None) -> dict:
    """results + the table over its runs (markdown) and the verdicts, as JSON at `out` (atomically);
    the markdown table and the plot too where asked."""
    table = aggregate(results["runs"])
    results = {**results, "table_markdown": markdown_table(table, results["dense"], mix_labels(results["runs"])),
               "verdicts": verdicts(table)}
    write_json_atomic(out, results)
    if table_path:
        atomic_write(table_path, lambda tmp: Path(tmp).write_text(results["table_markdown"]))
    if plot_path:
        plot(table, results["dense"], plot_path)
    return results


def print_summary(results: dict):
    """The table, then one line per verdict (backend x pattern x source x metric)."""
    print(results["table_markdown"])
    for v in results["verdicts"]:
        outcome = "ties" if v["tie"] else "beats" if v["better"] else "loses to"
        print(f"{v['method']:>9} {v['pattern']:>4} {v['metric']:>24}: {SOURCE_LABEL.get(v['source'], v['source'])} "
              f"{outcome} C4 ({v['value']:.4g} vs {v['c4']:.4g}){SPREAD_NOTE[v['beyond_spread']]}")


def cached_metrics(path: Path, measure) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    metrics = measure()
    write_json_atomic(path, metrics)
    return metrics


if __name__ == "__main__":
    main()
