"""The comparison runner: dense vs C4-calibrated vs decoding-aware-calibrated pruning, per backend and
pattern, over seeds, on decode fidelity, perplexity and (optionally) task scores; a paper-style table
and a plot.

For every (method, pattern, calibration, seed) it prunes the dense checkpoint with prune's public
functions, as `python -m prune` would (skipped when the output already exists, so a run can be resumed
or extended), then evaluates it; each checkpoint's metrics are cached as JSON next to it, and each
decode calibration (the dense model's generations, shared by every backend and pattern at one seed)
is cached in the workdir. Both calibrations get the same token budget: --tokens decode-step tokens
for decoding-aware, --tokens text tokens for C4.

Prompt split (nothing is evaluated on prompts it was calibrated on):
  calibration (decode): LongBench-Write-en rows whose index is not a multiple of 3, then MBPP
                        problem statements 601-974 (outside MBPP's test split);
  held-out (fidelity):  LongBench-Write-en rows 0, 3, 6, ... and the first HumanEval prompts.
Perplexity is measured on WikiText-2 test and, with --c4_ppl_tokens, on held-out C4: the documents of
c4_sample.jsonl (the C4 calibration source) that no text calibration of seeds 0-2 (and --seeds) at up
to 32768 tokens (or --tokens) reads - in-distribution for the C4-calibrated cells, so it favours them.
Task scores (greedy): pass@1 on the first --task_limit HumanEval / MBPP-test / ClassEval problems, and
LongBench-Write S_l on the first --task_limit held-out writing prompts.

CLI: python -m evaluation.compare --checkpoint dense.pth --workdir runs/grid --seeds 0 1 2 --tokens 16384
         [--methods sparsegpt wanda] [--patterns 2:4 8:16 50%] [--tasks humaneval mbpp longbench_write --task_limit 20]
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
from evaluation.data import data_path, read_jsonl, write_json_atomic
from evaluation.generation import USER_ERRORS
from prune import (CalibrationError, CalibrationSet, calibrate_by_decoding, prune_model, read_source,
                   text_windows)
from prune.calibration import read_documents

CALIBRATIONS = ("text", "decode")  # the C4 baseline, the paper's method
CALIB_LABEL = {"text": "C4", "decode": "decode-aware"}
SPREAD_NOTE = {True: "", False: ", within seed spread", None: ", one seed (no spread)"}
# (metric key, label, True if higher is better)
METRICS = [("kl", "KL(dense||pruned)", False), ("top1_agreement", "top-1 agree", True),
           ("tokens_to_divergence_mean", "tokens to diverge", True), ("wikitext2_ppl", "WikiText-2 PPL", False),
           ("c4_ppl", "C4 PPL (held-out docs)", False)]
# Held-out C4 excludes every document that a text calibration at these seeds and budget could read.
C4_EXCLUDED_SEEDS, C4_EXCLUDED_TOKENS = (0, 1, 2), 32768


def writing_rows(heldout: bool) -> list[dict]:
    """LongBench-Write-en rows ({"prompt", "length", ...}): every third one (0, 3, 6, ...) is held out,
    the others are calibration prompts."""
    rows = read_jsonl(data_path("longbench_write_en.jsonl"))
    return [row for i, row in enumerate(rows) if (i % 3 == 0) == heldout]


def prompt_split(n_writing_heldout: int = 20, n_code_heldout: int = 10) -> tuple[list[str], list[str]]:
    """(calibration prompts, held-out prompts) as described in the module docstring."""
    mbpp = [row["text"] for row in read_jsonl(data_path("mbpp.jsonl")) if row["task_id"] >= 601]
    humaneval = [row["prompt"] for row in read_jsonl(data_path("HumanEval.jsonl.gz"))[:n_code_heldout]]
    calibration = [row["prompt"] for row in writing_rows(heldout=False)] + mbpp
    heldout = [row["prompt"] for row in writing_rows(heldout=True)][:n_writing_heldout] + humaneval
    return calibration, heldout


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
    source = ["--prompts", str(calib_prompts), "--max_new_tokens", str(args.calib_max_new_tokens),
              "--batch_size", str(args.calib_batch_size)] if calib == "decode" \
        else ["--text", str(data_path("c4_sample.jsonl")), "--seq_len", str(args.calib_seq_len)]
    return ["--checkpoint", str(args.checkpoint), "--method", method, "--pattern", pattern, "--calib", calib, *source,
            "--tokens", str(args.tokens), "--seed", str(seed), "--device", args.device, "--out", str(out),
            *args.prune_args]


def prune_options(prune_args: list[str]) -> dict:
    """compare's --prune_args (flags of python -m prune) as prune_model's keywords, plus
    count_first_token; a flag that a grid cannot vary is refused."""
    parser = cli_args.ArgumentParser(prog="--prune_args", add_help=False, argument_default=argparse.SUPPRESS)
    parser.add_argument("--one-shot", "--one_shot", dest="one_shot", action="store_true")
    parser.add_argument("--count_first_token", action="store_true", default=False)
    parser.add_argument("--include", nargs="+")
    parser.add_argument("--exclude", nargs="+")
    parser.add_argument("--batch_tokens", type=cli_args.positive_int)
    options, unknown = parser.parse_known_args(prune_args)
    if unknown:
        raise ValueError(f"--prune_args: cannot pass on {' '.join(unknown)} (only --one_shot, --count_first_token, "
                         f"--include, --exclude and --batch_tokens)")
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
    if options.pop("count_first_token"):  # as python -m prune does; the cached set stays decode-only
        calibration = calibration.with_first_positions()
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
    tqdm.write(summary)


def cached_calibration(args, source, calib: str, seed: int, calib_prompts: Path):
    """The calibration set of one cell. A decoding-aware one is a seeded generation by the dense model:
    the same for every backend and pattern at one seed and budget, and on a CPU the slowest part of a
    cell, so it is made once and kept in --calibration_cache (default: the workdir) under a name derived
    from what decides the generation and the prompts; text windows are cut afresh (seconds)."""
    from tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source.tokenizer_dir())
    if calib == "text":
        return text_windows(tokenizer, data_path("c4_sample.jsonl"), args.tokens, args.calib_seq_len, seed)
    # Named as python -m prune names these settings, so the cache files keep their names.
    key = dict(checkpoint=str(args.checkpoint), generator="None", tokens=str(args.tokens),
               max_new_tokens=str(args.calib_max_new_tokens), seed=str(seed), batch_size=str(args.calib_batch_size),
               **{name: str(value) for name, value in SAMPLING.items()}, greedy="False", device=str(args.device))
    key["prompts_sha256"] = hashlib.sha256(Path(calib_prompts).read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(args.calibration_cache or args.workdir) / f"calibration-decode-{args.tokens}tok-seed{seed}-{digest}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return CalibrationSet(saved["sequences"], saved["counted"], dict(saved["info"], reused_from=str(path)))
    device = torch.device(args.device)
    calibration = calibrate_by_decoding(source, tokenizer, calib_prompts, args.tokens, args.calib_max_new_tokens,
                                        device=device, seed=seed, batch_size=args.calib_batch_size, **SAMPLING,
                                        compile=device.type == "cuda")
    atomic_write(path, lambda tmp: torch.save(dict(key=key, sequences=calibration.sequences,
                                                   counted=calibration.counted, info=calibration.info), tmp))
    return calibration


def evaluate_checkpoint(args, model, context: dict) -> dict:
    """Decode fidelity against the dense model (skipped for the dense model itself) and perplexity."""
    from evaluation.fidelity import decode_fidelity
    from evaluation.perplexity import perplexity

    is_dense = model is context["dense"]
    metrics = {} if is_dense else decode_fidelity(context["dense"], model, context["references"], context["dense_logits"])
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


def metric_columns(table: dict) -> list[tuple[str, str, bool]]:
    present = {m for row in table.values() for m in row}
    task_metrics = sorted(m for m in present if m.endswith(("pass@1", "_S_l")))
    return [c for c in METRICS if c[0] in present] + [(m, m, True) for m in task_metrics]


def markdown_table(table: dict, dense: dict) -> str:
    """One row per backend x pattern x calibration, mean ± std over seeds; the last column says, per
    metric in order, whether decode-aware beat C4 on that backend x pattern (mean vs mean)."""
    columns = metric_columns(table)
    lines = ["| backend | pattern | calibration | seeds | " + " | ".join(label for _, label, _ in columns) + " |",
             "|" + "---|" * (4 + len(columns))]
    lines.append("| dense | - | - | - | " + " | ".join(_fmt(dense.get(key)) for key, _, _ in columns) + " |")
    for method, pattern in sorted({(k[0], k[1]) for k in table}):
        for calib in CALIBRATIONS:
            row = table.get((method, pattern, calib))
            if row is None:
                continue
            n = max(v[2] for v in row.values())
            cells = [_fmt_spread(row.get(key), n) for key, _, _ in columns]
            lines.append(f"| {method} | {pattern} | {CALIB_LABEL[calib]} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdicts(table: dict) -> list[dict]:
    """Per backend x pattern x metric: does decode-aware beat C4, by how much, and is the gap larger
    than the seeds' spread (|difference| > std_C4 + std_decode; None when a side has one seed, so no spread)?"""
    rows = []
    for method, pattern in sorted({(k[0], k[1]) for k in table}):
        c4, dec = table.get((method, pattern, "text")), table.get((method, pattern, "decode"))
        if not (c4 and dec):
            continue
        for key, label, higher_better in metric_columns(table):
            if key in c4 and key in dec:
                (m_c4, s_c4, n_c4), (m_dec, s_dec, n_dec) = c4[key], dec[key]
                better = m_dec > m_c4 if higher_better else m_dec < m_c4
                rows.append({"method": method, "pattern": pattern, "metric": label, "c4": m_c4, "decode": m_dec,
                             "decode_better": better, "tie": m_dec == m_c4,
                             "beyond_spread": abs(m_dec - m_c4) > s_c4 + s_dec if min(n_c4, n_dec) > 1 else None})
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [c for c in metric_columns(table)]
    pairs = sorted({(k[0], k[1]) for k in table})
    fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns), 4), squeeze=False)
    for ax, (key, label, higher_better) in zip(axes[0], columns):
        x = range(len(pairs))
        for offset, calib in ((-0.2, "text"), (0.2, "decode")):
            cells = [table.get((m, p, calib), {}).get(key, (float("nan"), 0.0, 0)) for m, p in pairs]
            ax.bar([i + offset for i in x], [c[0] for c in cells], width=0.4, yerr=[c[1] for c in cells],
                   capsize=3, label=CALIB_LABEL[calib])
        if key in dense:
            ax.axhline(dense[key], color="black", linestyle=":", label="dense")
        ax.set_xticks(list(x), [f"{m}\n{p}" for m, p in pairs], fontsize=8)
        ax.set_title(f"{label} ({'higher' if higher_better else 'lower'} is better)", fontsize=9)
        if key in ("kl", "wikitext2_ppl", "c4_ppl"):
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = cli_args.ArgumentParser(description="Decode-aware vs C4 calibration: prune, evaluate, tabulate, plot.")
    parser.add_argument("--checkpoint", type=Path, required=True, help="dense source checkpoint")
    parser.add_argument("--workdir", type=Path, required=True, help="pruned checkpoints and cached metrics")
    parser.add_argument("--methods", nargs="+", default=["sparsegpt", "wanda"])
    parser.add_argument("--patterns", nargs="+", default=["2:4", "8:16", "50%"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--tokens", type=cli_args.positive_int, default=16384, help="calibration budget, the same for both sources")
    parser.add_argument("--calib_max_new_tokens", type=cli_args.positive_int, default=256, help="decode calibration: tokens per prompt")
    parser.add_argument("--calib_batch_size", type=cli_args.positive_int, default=16, help="decode calibration: prompts generated at once")
    parser.add_argument("--calib_seq_len", type=cli_args.positive_int, default=512, help="text calibration: window length")
    parser.add_argument("--calibration_cache", type=Path,
                        help="folder of cached decode calibrations (default: --workdir); share it between workdirs")
    parser.add_argument("--prune_args", nargs=argparse.REMAINDER, default=[],
                        help="pruning flags of python -m prune: --one_shot, --count_first_token, --include, "
                             "--exclude, --batch_tokens (put last)")
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
                        help="tabulate what exists: cells whose pruned checkpoint is in --workdir, task scores "
                             "already measured")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument("--plot", type=Path, help="PNG")
    parser.add_argument("--table", type=Path, help="markdown table")
    args = parser.parse_args()
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
    calibration, heldout = prompt_split(args.heldout_writing, args.heldout_code)
    calib_prompts = args.workdir / "calibration_prompts.jsonl"
    prompt_lines = "".join(json.dumps({"prompt": p}) + "\n" for p in calibration)
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
        references = [r for r in references if r[1]]
        wikitext = read_text(data_path("wikitext2_test.raw"), max_chars=8 * args.ppl_tokens)
        context.update(dense=dense, tokenizer=tokenizer, references=references,
                       wikitext_ids=tokenizer.encode(wikitext)[: args.ppl_tokens],
                       dense_logits=decode_step_logits(dense, references))
        return context

    eval_key = f"ppl{args.ppl_tokens}x{args.seq_len}-refs{len(heldout)}x{args.max_new_tokens}"
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
    grid = [(m, p, c, s) for s in args.seeds for p in args.patterns for m in args.methods for c in CALIBRATIONS]
    runs = []
    for method, pattern, calib, seed in tqdm(grid, desc="grid"):
        name = run_name(method, pattern, calib, seed)
        checkpoint = args.workdir / f"{name}.pth"
        if args.existing_only and not checkpoint.exists():
            continue
        prune(args, method, pattern, calib, seed, calib_prompts, checkpoint)
        metrics = metrics_of(name, functools.cache(lambda: load_model(checkpoint, args.device)))
        runs.append({"method": method, "pattern": pattern, "calib": calib, "seed": seed, "metrics": metrics})
        write_results(args, runs, dense_metrics, evaluation)
    return write_results(args, runs, dense_metrics, evaluation)


def write_results(args, runs, dense_metrics, evaluation: str) -> dict:
    # prune_args records the rule the cells were pruned under (e.g. --count_first_token), so that
    # evaluation.merge can refuse to pool cells of two rules.
    return write_outputs({"checkpoint": str(args.checkpoint), "calibration_tokens": args.tokens, "evaluation": evaluation,
                          "prune_args": list(args.prune_args), "dense": dense_metrics, "runs": runs},
                         args.out, args.table, args.plot)


def write_outputs(results: dict, out: Path, table_path: Path = None, plot_path: Path = None) -> dict:
    """results + the table over its runs (markdown) and the verdicts, as JSON at `out` (atomically);
    the markdown table and the plot too where asked."""
    table = aggregate(results["runs"])
    results = {**results, "table_markdown": markdown_table(table, results["dense"]), "verdicts": verdicts(table)}
    write_json_atomic(out, results)
    if table_path:
        atomic_write(table_path, lambda tmp: Path(tmp).write_text(results["table_markdown"]))
    if plot_path:
        plot(table, results["dense"], plot_path)
    return results


def print_summary(results: dict):
    """The table, then one line per verdict (backend x pattern x metric)."""
    print(results["table_markdown"])
    for v in results["verdicts"]:
        outcome = "ties" if v["tie"] else "beats" if v["decode_better"] else "loses to"
        print(f"{v['method']:>9} {v['pattern']:>4} {v['metric']:>18}: decode-aware {outcome} C4 "
              f"({v['decode']:.4g} vs {v['c4']:.4g}){SPREAD_NOTE[v['beyond_spread']]}")


def cached_metrics(path: Path, measure) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    metrics = measure()
    write_json_atomic(path, metrics)
    return metrics


if __name__ == "__main__":
    main()
