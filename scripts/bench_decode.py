"""End-to-end decode speed on the GPU: dense vs N:M sparse, through the real generate() loop.

    python scripts/bench_decode.py --models Llama-3.1-8B,Qwen3-8B,Qwen3-14B,Qwen3-32B \
        --patterns dense,2:4,4:8,8:16,16:32 --batch_sizes 1,4,8 --out runs/bench_decode
    python scripts/bench_decode.py --models Llama-3.1-8B --patterns dense --batch_sizes 1 --gptfast .gptfast

scripts/gpu_benchmarks.sh runs the configurations behind docs/BENCHMARKS.md.

Each model is a named shape (ModelArgs.from_name) with random bf16 weights made directly on the
GPU; speed does not depend on the values, but zeros would flatter the hardware, so they are
random. A sparse model is built packed (a 70B model's dense form would not fit the GPU that holds
its 2:4 form): each linear layer gets random weights pruned to the pattern, keeping the N largest
|w| of every M-group (a valid mask); the lm_head stays dense.

Tensor parallel (tp.py): the same command under torchrun, e.g.
    torchrun --nproc_per_node=2 scripts/bench_decode.py --models Llama-3.3-70B --patterns 2:4 --batch_sizes 1,8
builds only each rank's shard on its GPU and runs every configuration in that process (as
--same_process); rank 0 prints and writes the tables. Its rows say `tp` = the process count, and
their bytes, GB/s and share of the copy bandwidth are one GPU's (a rank reads its shard).

Protocol (the paper's): a 512-token random prompt, 256 new tokens, generate(compile=True) so the
decode step is one CUDA graph. The first generate() call compiles and warms up; in the second,
each decode step is timed with CUDA events and we report the median over the steps after the
first `--warmup_steps`. Our dense model and our sparse model of a shape each run in a fresh
process (`--same_process` runs both in this one; bench() says why). GB/s = bytes one step reads
(generate.bytes_read_per_step: weights once, KV cache over all slots) / median step time. The
bound speedup of a sparse pattern is dense bytes / sparse bytes at the same batch size: what a
purely bandwidth-bound decode would gain. `--profile` also writes each configuration's GPU kernel
time per decode step (scripts/kernel_profile.py) to OUT/profile_*.txt.

`--gptfast DIR` also times GPT-Fast's own dense decode of the same shape, side by side: DIR holds
a copy of pytorch-labs/gpt-fast, and scripts/gptfast_decode_driver.py builds its Transformer with
random weights and times its compiled decode the same way (in a subprocess, since both projects
name their modules model.py / generate.py). Results go to OUT/bench_decode.json and .md.
"""
import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli_args  # noqa: E402
import generate  # noqa: E402
import tp  # noqa: E402
from scripts.kernel_profile import profile_steps  # noqa: E402
from checkpoint import atomic_write  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

GPTFAST_NAMES = {"Llama-3.1-8B": "llama-3.1-8b", "Meta-Llama-3-8B": "llama-3-8b"}  # shapes GPT-Fast knows


def meta_model(name: str, pattern: str = None, n_layer: int = None, dtype=torch.bfloat16) -> Transformer:
    """The named shape on the meta device (no memory), its linear layers (but the lm_head) packed
    empty to `pattern` if given, and under torchrun only this rank's shard (tp.shard)."""
    config = ModelArgs.from_name(name)
    config.n_layer = n_layer or config.n_layer
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    if pattern is not None:
        import sparse

        placeholders = {f"{layer}.values": torch.empty(0, dtype=dtype, device="meta")
                        for layer, module in model.named_modules()
                        if isinstance(module, torch.nn.Linear) and layer != "output"}
        sparse.swap_linears_for_state_dict(model, placeholders, pattern)
    return tp.shard(model)


def random_model(name: str, device="cuda", dtype=torch.bfloat16, n_layer: int = None, pattern: str = None) -> Transformer:
    """meta_model(name, pattern, n_layer) with random weights, allocated and filled on the device
    (no CPU copy, bf16 from the start: Qwen3-32B in fp32 would not fit); n_layer keeps only that
    many layers (quick probes of one shape)."""
    model = meta_model(name, pattern, n_layer, dtype).to_empty(device=device)
    if model.config.tie_embeddings and isinstance(model.output, torch.nn.Linear):  # tp.shard unties them
        model.output.weight = model.tok_embeddings.weight
    torch.manual_seed(0)  # every rank's replicated weights alike
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    if pattern is not None:
        repack_in_place(model, pattern)
    return model.eval()


def dense_bytes(name: str, batch_size: int, args) -> int:
    """Bytes one dense decode step of this shape reads (one rank's under torchrun), counted on a
    meta-device model."""
    model = meta_model(name)
    model.setup_caches(batch_size, args.prompt_length + args.new_tokens)
    return generate.bytes_read_per_step(model, batch_size)["total"]


def time_decode(model, batch_size: int, args, label: str = "run") -> dict:
    """Warm-up generate() (compiles), then a timed one; the median step time after warm-up steps."""
    seeded = torch.Generator().manual_seed(0)  # the same prompts on every rank under torchrun
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_length,), generator=seeded)
               for _ in range(batch_size)]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0, compile=True)
    start = time.perf_counter()
    generate.generate(model, prompts, args.new_tokens, **sampling)
    warmup_s = time.perf_counter() - start
    result = generate.generate(model, prompts, args.new_tokens, **sampling)
    measured = result.step_times_s[args.warmup_steps:]
    if len(measured) < 50:
        raise ValueError(f"only {len(measured)} measured steps; raise --new_tokens above {args.warmup_steps + 51}")
    if args.profile:
        # the same new_tokens as the timed calls: another length would recompile inside the trace
        profile_steps(lambda: generate.generate(model, prompts, args.new_tokens, **sampling), args.new_tokens - 1,
                      args.out / f"profile_{label.replace(':', '-')}.txt")
    return dict(median_step_s=statistics.median(measured), measured_steps=len(measured),
                first_call_s=round(warmup_s, 1), inductor_tuner_clock=generate.inductor_tuner_clock())


def run_gptfast(gptfast_dir: Path, model_name: str, batch_size: int, args, timeout_s: float) -> dict:
    command = [sys.executable, str(Path(__file__).with_name("gptfast_decode_driver.py")), "--gptfast_dir", str(gptfast_dir),
               "--model", GPTFAST_NAMES[model_name],
               "--batch_size", str(batch_size), "--prompt_length", str(args.prompt_length),
               "--new_tokens", str(args.new_tokens), "--warmup_steps", str(args.warmup_steps),
               "--temperature", str(args.temperature), "--top_k", str(args.top_k or 0)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout_s:.0f} s")
    if done.returncode != 0:
        return dict(error=(done.stderr.strip().splitlines() or ["failed"])[-1][:200])
    return json.loads(done.stdout.strip().splitlines()[-1])


def free(model):
    """Drop a model and everything compiled against it, so the next one starts with an empty GPU."""
    del model
    torch._dynamo.reset()  # also frees the CUDA-graph pools that hold the old weights
    gc.collect()
    torch.cuda.empty_cache()


def bench(args, rows: list):
    """Appends a row per configuration to `rows` as it goes, so a failure keeps what was measured.

    Our dense model and our sparse model of a shape each run in a fresh process of their own (unless
    --same_process), as a user runs one model per process and as GPT-Fast is run: a model decoded
    after another in the same process ran measurably slower (its lm_head, docs/BENCHMARKS.md)."""
    start = time.perf_counter()
    # Under torchrun rank 0's clock decides for every rank whether to start a run, so all start it.
    remaining = lambda: tp.from_main_process(args.deadline_s - (time.perf_counter() - start))  # noqa: E731
    run_ours = bench_model if args.same_process else bench_model_in_child
    sparse_patterns = [p for p in args.patterns if p != "dense"]
    for name in args.models:
        dense_step_s = {}  # batch size -> our dense median step, for the speedup columns
        if "dense" in args.patterns:
            run_ours(name, [], remaining, args, rows)
            dense_step_s = {r["batch"]: r["median_step_s"] for r in rows
                            if r.get("model") == name and r.get("pattern") == "dense" and "median_step_s" in r}
            if args.gptfast and name in GPTFAST_NAMES:
                bench_gptfast(name, dense_step_s, remaining, args, rows)
        if sparse_patterns:
            first_sparse_row = len(rows)
            run_ours(name, sparse_patterns, remaining, args, rows)
            for row in rows[first_sparse_row:]:
                if row.get("batch") in dense_step_s and "median_step_s" in row:
                    row["speedup"] = round(dense_step_s[row["batch"]] / row["median_step_s"], 3)


def bench_model_in_child(name: str, sparse_patterns: list, remaining, args, rows: list):
    """bench_model in a fresh Python process (this script with --same_process); its rows come back
    through a JSON file. A child that dies leaves one error row per pattern it did not report."""
    patterns = sparse_patterns or ["dense"]
    if remaining() <= 0:
        rows += [dict(model=name, pattern=p, error="skipped: past --deadline_s") for p in patterns]
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.json"
        command = [sys.executable, __file__, "--same_process", "--rows_out", str(rows_file), "--models", name,
                   "--patterns", ",".join(patterns), "--batch_sizes", ",".join(map(str, args.batch_sizes)),
                   "--prompt_length", str(args.prompt_length), "--new_tokens", str(args.new_tokens),
                   "--warmup_steps", str(args.warmup_steps), "--temperature", str(args.temperature),
                   "--copy_bandwidth", str(args.copy_bandwidth), "--deadline_s", str(remaining()), "--out", str(args.out)]
        command += ["--top_k", "off" if args.top_k is None else str(args.top_k)]
        command += ["--top_p", str(args.top_p)] if args.top_p is not None else []
        command += ["--profile"] if args.profile else []
        done = subprocess.run(command, stdin=subprocess.DEVNULL)  # its output goes straight to ours
        child_rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    rows += child_rows
    reported = {r["pattern"] for r in child_rows}
    rows += [dict(model=name, pattern=p, error=f"child process exited with {done.returncode}")
             for p in patterns if p not in reported]


def repack_in_place(model, pattern: str):
    """Give every SparseLinear fresh random weights pruned to `pattern`, in its existing buffers.

    All 50 % patterns have the same buffer shapes, so the compiled decode step (its CUDA graph
    holds the buffers' addresses) runs the new pattern without recompiling.
    """
    import sparse
    from tqdm import tqdm

    layers = [module for module in model.modules() if isinstance(module, sparse.SparseLinear)]
    for module in tqdm(layers, desc=f"packing {pattern}", unit="layer", disable=not tp.is_main_process()):
        weight = torch.randn(module.out_features, module.in_features, device=module.values.device) * 0.02
        values, mask = sparse.pack(weight.to(module.values.dtype), pattern)
        module.values.copy_(values)
        module.mask.copy_(mask)
        module.pattern = pattern


def bench_model(name: str, sparse_patterns: list, remaining, args, rows: list):
    """Our generate() on one model shape at every batch size: dense if sparse_patterns is empty,
    else each pattern in turn (one compile per batch size, patterns swapped in place)."""
    patterns = sparse_patterns or ["dense"]
    if remaining() <= 0:
        rows += [dict(model=name, pattern=p, error="skipped: past --deadline_s") for p in patterns]
        return
    packed_as = sparse_patterns[0] if sparse_patterns else None  # packing a 70B model takes a while: once a pattern
    model = random_model(name, tp.process_device("cuda"), pattern=packed_as)
    model.setup_caches(max(args.batch_sizes), args.prompt_length + args.new_tokens)
    # Peak memory from here on: what decoding this model takes, as for a user who loads a pruned
    # checkpoint (packing made one layer's dense weight at a time).
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for batch_size in args.batch_sizes:
        for pattern in patterns:
            row = dict(model=name, pattern=pattern, batch=batch_size, engine="ours", tp=tp.world_size())
            if remaining() <= 0:
                rows.append(dict(row, error="skipped: past --deadline_s"))
                continue
            if pattern not in ("dense", packed_as):
                repack_in_place(model, pattern)
                packed_as = pattern
            step_bytes = generate.bytes_read_per_step(model, batch_size)["total"]
            label = f"{name}_{pattern}_b{batch_size}" + (f"_rank{tp.rank()}" if tp.world_size() > 1 else "")
            timing = time_decode(model, batch_size, args, label=label)
            step_s = timing["median_step_s"]
            row.update(timing, **throughput(step_s, batch_size, step_bytes, args.copy_bandwidth),
                       bound_speedup=round(dense_bytes(name, batch_size, args) / step_bytes, 3),
                       checkpoint_gb=round(generate.state_dict_bytes(model) / 1e9, 2),
                       peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
            if pattern == "dense":
                row["speedup"] = 1.0
            rows.append(row)
            print(json.dumps(row), flush=True)
    free(model)


def bench_gptfast(name: str, dense_step_s: dict, remaining, args, rows: list):
    """GPT-Fast's dense decode of the same shape; its GB/s uses our byte count for that shape."""
    for batch_size in args.batch_sizes:
        row = dict(model=name, pattern="dense", batch=batch_size, engine="gpt-fast")
        if remaining() <= 0:
            rows.append(dict(row, error="skipped: past --deadline_s"))
            continue
        result = run_gptfast(args.gptfast, name, batch_size, args, timeout_s=args.gptfast_timeout_s)
        if "median_step_s" in result:
            step_s = result["median_step_s"]
            result.update(throughput(step_s, batch_size, dense_bytes(name, batch_size, args), args.copy_bandwidth))
            if batch_size in dense_step_s:
                row["ours_vs_gptfast"] = round(step_s / dense_step_s[batch_size], 3)
        rows.append(dict(row, **result))
        print(json.dumps(rows[-1]), flush=True)


def throughput(step_s: float, batch_size: int, step_bytes: int, copy_bandwidth: float) -> dict:
    return dict(median_step_ms=round(step_s * 1e3, 3), tok_s=round(1 / step_s, 1),
                tok_s_all_rows=round(batch_size / step_s, 1), step_gb=round(step_bytes / 1e9, 3),
                gb_s=round(step_bytes / step_s / 1e9), pct_of_copy=round(100 * step_bytes / step_s / copy_bandwidth, 1))


COLUMNS = ["model", "pattern", "batch", "engine", "tp", "tok_s", "tok_s_all_rows", "median_step_ms", "gb_s", "pct_of_copy",
           "step_gb", "bound_speedup", "speedup", "ours_vs_gptfast", "checkpoint_gb", "peak_memory_gb", "error"]


def markdown_table(rows) -> str:
    used = [c for c in COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(used) + " |", "|" + "---|" * len(used)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in used) + " |" for r in rows]
    return "\n".join(lines)


def environment() -> dict:
    import triton

    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
                gpus=tp.world_size(), torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv))


def parse_args(argv=None):
    split = lambda text: [s.strip() for s in text.split(",") if s.strip()]  # noqa: E731
    p = cli_args.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=split, default=["Llama-3.1-8B"])
    p.add_argument("--patterns", type=split, default=["dense"], help="dense and/or N:M patterns, e.g. dense,2:4")
    p.add_argument("--batch_sizes", type=lambda s: [cli_args.positive_int(b) for b in split(s)], default=[1])
    p.add_argument("--prompt_length", type=cli_args.positive_int, default=512)
    p.add_argument("--new_tokens", type=cli_args.positive_int, default=256)
    p.add_argument("--warmup_steps", type=cli_args.non_negative_int, default=50, help="decode steps of the timed call left out")
    p.add_argument("--temperature", type=cli_args.temperature, default=0.8, help="GPT-Fast's defaults, for a like-for-like run")
    p.add_argument("--top_k", type=cli_args.top_k, default=200, help="tokens kept per step, or 'off'")
    p.add_argument("--top_p", type=cli_args.top_p, default=None)
    p.add_argument("--copy_bandwidth", type=float, default=4.27e12,
                   help="the GPU's device-to-device copy, bytes/s (default: the H200's, docs/BENCHMARKS.md)")
    p.add_argument("--gptfast", type=Path, help="a copy of pytorch-labs/gpt-fast: time its dense decode side by side")
    p.add_argument("--gptfast_timeout_s", type=float, default=600,
                   help="its first compile takes minutes on a fresh machine")
    p.add_argument("--deadline_s", type=float, default=float("inf"), help="start nothing new after this long")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one more call: kernel time per decode step into OUT/profile_*.txt")
    p.add_argument("--same_process", action="store_true",
                   help="run our dense and sparse models in this process (default: a fresh process each)")
    p.add_argument("--rows_out", type=Path, help=argparse.SUPPRESS)  # a child's rows, for its parent
    p.add_argument("--out", type=Path, default=Path("runs/bench_decode"))
    return p.parse_args(argv)


def check_configurations(args):
    """Exit 2 with one line, before any work, for a model name we do not know, a pattern that is
    not N:M, or (under torchrun) a process count that cannot split a model."""
    try:
        for name in args.models:
            for pattern in args.patterns:
                meta_model(name, None if pattern == "dense" else pattern, n_layer=1)
        if tp.world_size() > 1 and args.gptfast:
            raise ValueError("--gptfast times GPT-Fast on one GPU: run it without torchrun")
    except ValueError as e:
        if not tp.is_main_process():  # every rank meets the same bad input; rank 0 says it
            sys.exit(2)
        cli_args.exit_with_error(e)


def main(argv=None):
    args = parse_args(argv)
    check_configurations(args)
    if not torch.cuda.is_available():
        sys.exit("error: bench_decode.py needs a CUDA GPU")
    torch._dynamo.config.cache_size_limit = 64  # one compiled step per (model, batch size)
    # Under torchrun: one process a GPU, all configurations in it, rank 0 reports.
    tp.init_process_group(tp.process_device("cuda"))
    tp.silence_other_ranks()
    args.same_process = args.same_process or tp.world_size() > 1
    env, rows = environment(), []
    try:
        bench(args, rows)
    finally:  # keep what was measured even if a later configuration fails
        if not tp.is_main_process():
            pass  # rank 0 reports for all
        elif args.rows_out:  # a child of bench_model_in_child: its parent writes the tables
            atomic_write(args.rows_out, lambda tmp: Path(tmp).write_text(json.dumps(rows)))
        else:
            write_tables(args.out, env, rows)
        tp.destroy_process_group()


def write_tables(out: Path, env: dict, rows: list):
    out.mkdir(parents=True, exist_ok=True)
    results = json.dumps(dict(environment=env, rows=rows), indent=1)
    atomic_write(out / "bench_decode.json", lambda tmp: Path(tmp).write_text(results))
    table = "\n".join(f"{k}: {v}" for k, v in env.items()) + "\n\n" + markdown_table(rows) + "\n"
    atomic_write(out / "bench_decode.md", lambda tmp: Path(tmp).write_text(table))
    print(table)


if __name__ == "__main__":
    main()
