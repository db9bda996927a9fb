"""The demo's closing summary: a dense checkpoint and its pruned one side by side.

    python scripts/demo_summary.py --dense model.pth --sparse pruned-16of32.pth --prompts data/demo_heldout_prompts.jsonl

For each model: decode tokens/s on this machine (named: CPU model or GPU), the bytes a decode step
reads for the path that actually ran (on the CPU the sparse layers run expanded to dense, so there
the sparse model reads as much as the dense one; on CUDA the packed values and masks), the sparse
model's KL and top-1 agreement to the dense model along the dense model's greedy answers to the
prompts (evaluation/fidelity.py), and one short sample of each from the same prompt and seed.
"""
import os
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere
import cli_args  # noqa: E402
import generate  # noqa: E402
from checkpoint import CheckpointError, checkpoint_file  # noqa: E402
from evaluation.data import read_prompts  # noqa: E402
from evaluation.fidelity import decode_fidelity, dense_references  # noqa: E402
from evaluation.generation import encode_prompt, load_model, load_model_and_tokenizer  # noqa: E402

# Sampling for the samples: SmolLM2's and Qwen's recommended setting (also prune's calibration
# default); greedy decoding of a 135M model soon repeats itself, dense or sparse.
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.8)


def hardware_name(device: str) -> str:
    """The GPU's name, or the CPU's model name and core count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:  # not Linux
        pass
    return f"{name}, {os.cpu_count()} cores"


def speed_and_sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, compile: bool) -> dict:
    """One sampled answer to `prompt`: its text, decode tokens/s and the bytes each step read."""
    ids = torch.tensor(encode_prompt(tokenizer, prompt))
    options = dict(SAMPLING, eos_ids=tokenizer.eos_ids, seed=seed, compile=compile)
    if compile:  # the first compiled call compiles (and CUDA-graphs) the step: leave it out of the time
        generate.generate(model, [ids], max_new_tokens, **options)
    result = generate.generate(model, [ids], max_new_tokens, **options)
    text = tokenizer.decode([t for t in result.new_tokens[0].tolist() if t not in tokenizer.eos_ids])
    return {"text": text, "tokens_per_s": result.decode_steps / result.decode_s if result.decode_steps else 0.0,
            "bytes_per_step": generate.bytes_read_per_step(model, 1)["weights"],
            "expanded": any(getattr(m, "runs_expanded", False) for m in model.modules())}


def summarize(dense_path, sparse_path, prompts: list, device: str, max_new_tokens: int, sample_tokens: int,
              seed: int) -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    dense, tokenizer = load_model_and_tokenizer(dense_path, device, dtype)
    sparse = load_model(sparse_path, device, dtype)
    fidelity = decode_fidelity(dense, sparse, dense_references(dense, tokenizer, prompts, max_new_tokens))
    compile = device.startswith("cuda")
    runs = {name: speed_and_sample(model, tokenizer, prompts[0], sample_tokens, seed, compile)
            for name, model in (("dense", dense), ("sparse", sparse))}
    pattern = next((m.pattern for m in sparse.modules() if hasattr(m, "pattern")), "dense")
    return {"hardware": hardware_name(device), "device": device, "dtype": str(dtype).removeprefix("torch."),
            "pattern": pattern, "fidelity": fidelity, "prompts": len(prompts), "sample_prompt": prompts[0], **runs}


def report(s: dict) -> str:
    dense, sparse, f = s["dense"], s["sparse"], s["fidelity"]
    bytes_note = ("the sparse layers run expanded to dense here: no sparse kernel on this device"
                  if sparse["expanded"] else "packed values + bitmasks" if s["pattern"] != "dense" else "")
    lines = [
        f"== dense vs sparse {s['pattern']} on {s['device']} ({s['hardware']}; {s['dtype']}, torch {torch.__version__})",
        f"{'':28}{'dense':>14}{'sparse ' + s['pattern']:>16}",
        f"{'decode tok/s (batch 1)':28}{dense['tokens_per_s']:>14.1f}{sparse['tokens_per_s']:>16.1f}",
        f"{'weight MB read per step':28}{dense['bytes_per_step'] / 1e6:>14.1f}{sparse['bytes_per_step'] / 1e6:>16.1f}"
        + (f"   ({bytes_note})" if bytes_note else ""),
        f"{'KL(dense || sparse)':28}{'':>14}{f['kl']:>16.3f}   nats/token over {f['decode_tokens']} decode "
        f"tokens of the dense model's greedy answers to {s['prompts']} prompts",
        f"{'top-1 agreement':28}{'':>14}{f['top1_agreement']:>16.3f}",
        f"-- samples (temperature {SAMPLING['temperature']}, top-k {SAMPLING['top_k']}, top-p {SAMPLING['top_p']}, "
        f"same seed) for: {s['sample_prompt']}",
        f"dense:  {dense['text'].strip()}",
        f"sparse: {sparse['text'].strip()}",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = cli_args.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", type=Path, required=True, help="dense checkpoint (.pth, or its folder)")
    p.add_argument("--sparse", type=Path, required=True, help="pruned checkpoint of the same model (.pth)")
    p.add_argument("--prompts", type=Path, default=REPO / "data" / "demo_heldout_prompts.jsonl",
                   help="prompts for KL and top-1 (the first one also gives the samples); keep them out of the "
                   "calibration set")
    p.add_argument("--limit", type=cli_args.positive_int, default=4, help="prompts used")
    p.add_argument("--max_new_tokens", type=cli_args.positive_int, default=64,
                   help="greedy dense tokens per prompt that KL and top-1 are measured along")
    p.add_argument("--sample_tokens", type=cli_args.positive_int, default=96, help="tokens per sample (and timing run)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same for both models")
    p.add_argument("--device", type=cli_args.device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    args = p.parse_args(argv)
    try:
        prompts = read_prompts(args.prompts)[: args.limit]
        if not prompts:
            raise ValueError(f"no prompts in {args.prompts}")
        summary = summarize(checkpoint_file(args.dense), checkpoint_file(args.sparse), prompts, args.device,
                            args.max_new_tokens, args.sample_tokens, args.seed)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        cli_args.exit_with_error(e, "demo_summary")
    print(report(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
