"""Decoding-aware SparseGPT at scale: wall time of generation + pruning for a named model shape.

    python scripts/bench_prune.py --model Llama-3.1-8B --tokens 1000000 --batch_size 128 --no_write
    python scripts/bench_prune.py --model stories15M --tokens 2000 --batch_size 8 --device cpu --out /tmp/p.pth

The target: SparseGPT 2:4 on a Llama-3.1-8B-shaped model with 1M decode-step tokens on one
H200 in at most 20 minutes. The weights are random (bench_decode.random_model: made on the device in
bf16, float32 on the CPU), the prompts random token ids of the model's vocabulary (Llama-3's
128,256 for Llama-3.1-8B) with lengths drawn uniformly from --prompt_lengths, like chat prompts
of the paper's prompt sets. Every phase runs prune's own code, the functions the CLI calls:

    compile     a first generate() call of the calibration's exact shape (batch, steps, cache),
                so torch.compile + CUDA-graph capture are timed apart from the steady generation
                rate that scales to other budgets (this phase includes that one batch's decode)
    generation  prune.calibration.generation_calibration: --tokens decode steps, batches of
                --batch_size prompts (sampled at the paper's T 0.7, top-k 20, top-p 0.8)
    offload     KV caches and the CUDA-graph pool freed, the model moved to the CPU, where the
                CLI's pruning finds it (memory-mapped from the checkpoint)
    replay      prune.prune_model, sequential protocol: blocks moved to the device, replays of the
                (pruned) sublayers, H accumulated at decode positions
    solve       the same call's SparseGPT solves, plus packing each layer on the device
    write       PrunedCheckpoint.save (skipped by --no_write)

Prints one JSON line (also written to --json) and a short table; tqdm shows progress on stderr.
"""
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli_args  # noqa: E402
from checkpoint import atomic_write  # noqa: E402
from generate import generate  # noqa: E402
from prune import CalibrationSet, prune_model  # noqa: E402
from prune.calibration import generation_calibration  # noqa: E402
from scripts.bench_decode import random_model  # noqa: E402

SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.8)  # the paper's
CALIBRATION_SETTINGS = ("model", "tokens", "batch_size", "max_new_tokens", "prompts", "prompt_lengths", "seed", "device")


def random_prompts(n: int, lengths: tuple, vocab_size: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (size,), generator=g) for size in sizes]


class Phases:
    """Wall time (device synchronised) and peak device memory of each phase, in order."""

    def __init__(self, device):
        self.device, self.seconds, self.peak_gib = device, {}, {}
        self.on_cuda = device.type == "cuda"

    def start(self):
        if self.on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()

    def stop(self, name: str):
        if self.on_cuda:
            torch.cuda.synchronize()
            self.peak_gib[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        self.seconds[name] = round(time.perf_counter() - self.started, 2)
        print(f"[bench_prune] {name}: {self.seconds[name]} s", file=sys.stderr, flush=True)


def generate_calibration(args, model, prompts, phases, device) -> CalibrationSet:
    compile = device.type == "cuda" and not args.no_compile
    # One batch of exactly the calibration's shape; any other (even fewer steps) would recompile.
    phases.start()
    model.setup_caches(args.batch_size, min(model.config.block_size, args.prompt_lengths[1] + args.max_new_tokens))
    batch = [prompts[j % len(prompts)] for j in range(args.batch_size)]
    generate(model, batch, args.max_new_tokens, **SAMPLING, seed=args.seed, compile=compile)
    phases.stop("compile")

    phases.start()
    calibration = generation_calibration(model, prompts, args.tokens, args.max_new_tokens, **SAMPLING,
                                         seed=args.seed, batch_size=args.batch_size, compile=compile)
    phases.stop("generation")
    return calibration


def load_calibration(path: Path, phases, record: dict) -> CalibrationSet:
    """The calibration a first call saved, with that call's phase times, so the record totals both."""
    saved = torch.load(path, weights_only=True)
    if saved["settings"] != record["calibration_settings"]:
        raise SystemExit(f"error: {path} was made by a run with other settings ({', '.join(saved['settings'])})")
    phases.seconds.update(saved["seconds"])
    phases.peak_gib.update(saved["peak_memory_gib"])
    record["calibration_loaded"] = str(path)
    return CalibrationSet([t.long() for t in saved["sequences"]], saved["counted"], saved["info"])


def save_calibration(path: Path, calibration: CalibrationSet, phases, record: dict):
    """What load_calibration reads back: the calibration, this call's phase times and its settings.
    Token ids as int32: half the file of int64, and a million decode tokens with their prompts stay small."""
    payload = dict(sequences=[t.to(torch.int32) for t in calibration.sequences], counted=calibration.counted,
                   info=calibration.info, seconds=dict(phases.seconds), peak_memory_gib=dict(phases.peak_gib),
                   settings=record["calibration_settings"])
    atomic_write(path, lambda tmp: torch.save(payload, tmp))
    record["calibration_saved"] = str(path)


def bench(args, record: dict):
    """Runs the phases, filling `record` as it goes (so a run cut short still reports its phases)."""
    device = torch.device(args.device)
    phases = Phases(device)
    record.update(seconds=phases.seconds, peak_memory_gib=phases.peak_gib)
    torch.manual_seed(args.seed)
    model = random_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts = random_prompts(args.prompts, args.prompt_lengths, model.config.vocab_size, args.seed)
    # A run longer than one GPU job may last is split by --calibration: the first call generates,
    # saves and stops; the same command again prunes, and its record sums both.
    second_call = args.calibration is not None and args.calibration.exists()
    if second_call:
        calibration = load_calibration(args.calibration, phases, record)
    else:
        calibration = generate_calibration(args, model, prompts, phases, device)
    record.update(decode_tokens=calibration.counted_tokens,
                  replayed_tokens=sum(len(s) for s in calibration.sequences), sequences=len(calibration.sequences))
    if args.calibration is not None and not second_call:
        save_calibration(args.calibration, calibration, phases, record)
        return

    phases.start()
    for layer in model.layers:
        layer.attention.kv_cache = None
    torch._dynamo.reset()  # frees the CUDA-graph pool, which holds on to the generation's memory
    model.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    phases.stop("offload")

    pruned = prune_model(model, calibration, "sparsegpt", args.pattern, device=device, one_shot=args.one_shot,
                         batch_tokens=args.batch_tokens, seed=args.seed,
                         metadata={"source_checkpoint": f"random {args.model} weights (scripts/bench_prune.py)"})
    timing = pruned.metadata["timing"]
    phases.seconds.update(replay=timing["replay_seconds"], solve=timing["solve_seconds"])
    phases.peak_gib["prune"] = round(timing["peak_memory_bytes"] / 2**30, 2) if device.type == "cuda" else None
    record["pruned_linears"] = len(pruned.metadata["sparsity"]["layers"])

    if args.out:
        phases.start()
        pruned.save(args.out)
        phases.stop("write")


def environment(args) -> dict:
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
               command=" ".join(sys.argv) if __name__ == "__main__" else None)
    if args.device.startswith("cuda"):
        import triton
        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    return env


def summary(record: dict) -> dict:
    """Totals and the rates a larger budget scales by."""
    s = record.get("seconds", {})
    record["total_s"] = round(sum(s.values()), 2)
    record["generation_plus_pruning_min"] = round(sum(s.get(k, 0) for k in ("compile", "generation", "replay", "solve"))
                                                  / 60, 2)
    if s.get("generation"):
        record["decode_tok_s"] = round(record["decode_tokens"] / s["generation"])
    if s.get("replay"):
        record["replayed_tok_s"] = round(record["replayed_tokens"] / s["replay"])
    return record


def table(record: dict) -> str:
    peaks = record.get("peak_memory_gib", {})
    rows = [f"| {phase} | {seconds} | {peaks.get('prune' if phase in ('replay', 'solve') else phase, '')} |"
            for phase, seconds in record.get("seconds", {}).items()]
    return "\n".join([f"{record['model']}, {record.get('decode_tokens', '?')} decode tokens "
                      f"({record.get('replayed_tokens', '?')} replayed), batch {record['batch_size']}, {record['pattern']}",
                      "| phase | seconds | peak GiB |", "|---|---|---|", *rows,
                      f"| total | {record.get('total_s')} | |"])


def parse_args(argv=None):
    p = cli_args.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Llama-3.1-8B", help="a name in model.py's transformer_configs")
    p.add_argument("--tokens", type=cli_args.positive_int, default=1_000_000, help="decode-token budget")
    p.add_argument("--batch_size", type=cli_args.positive_int, default=128, help="prompts generated at once")
    p.add_argument("--max_new_tokens", type=cli_args.positive_int, default=512)
    p.add_argument("--prompts", type=cli_args.positive_int, default=1024, help="distinct random prompts (cycled)")
    p.add_argument("--prompt_lengths", type=lambda s: tuple(int(n) for n in s.split(":")), default=(64, 512),
                   help="MIN:MAX prompt length in tokens")
    p.add_argument("--pattern", default="2:4")
    p.add_argument("--one-shot", "--one_shot", dest="one_shot", action="store_true")
    p.add_argument("--batch_tokens", type=cli_args.positive_int, default=8192, help="tokens per replay batch")
    p.add_argument("--device", type=cli_args.device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="packed checkpoint to write")
    p.add_argument("--no_write", action="store_true", help="time everything but writing the checkpoint")
    p.add_argument("--json", type=Path, help="also write the JSON record here")
    p.add_argument("--calibration", type=Path,
                   help="split the run in two: if this file is absent, generate, save the calibration here and "
                   "stop; if present, load it and prune (the same command both times)")
    args = p.parse_args(argv)
    if not args.out and not args.no_write:
        p.error("give --out PATH or --no_write")
    if args.no_write:
        args.out = None
    if len(args.prompt_lengths) != 2 or not 0 < args.prompt_lengths[0] <= args.prompt_lengths[1]:
        p.error("--prompt_lengths must be MIN:MAX with 0 < MIN <= MAX")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but CUDA is not available")
    record = dict(model=args.model, pattern=args.pattern, budget=args.tokens, batch_size=args.batch_size,
                  max_new_tokens=args.max_new_tokens, prompt_lengths=list(args.prompt_lengths),
                  collection="one-shot" if args.one_shot else "sequential", device=args.device,
                  calibration_settings=[f"{k}={getattr(args, k)}" for k in CALIBRATION_SETTINGS], **environment(args))
    try:
        bench(args, record)
    finally:  # what was measured is reported even if a later phase fails or is interrupted
        summary(record)
        line = json.dumps(record)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(line + "\n")
        print(line)
        print(table(record), flush=True)
    return record


if __name__ == "__main__":
    main()
