"""Is the dense engine's process-to-process spread where its weights sit in GPU memory?

dense_spread.sh (2026-12-04) ran our dense Llama-3.1-8B at batch 1 in three processes: 4.552, 5.187
and 5.256 ms a step, nearly all of it one kernel (the w2 GEMV with silu·mul in front: 32.6 against
54 µs a call). Coordinate descent picked differently in most kernels from process to process, so
"different picks" and "the same picks at another speed" were not yet apart. This script stays in
ONE process and moves the weights instead: it times the step, then copies every weight and cache
buffer to fresh storage behind a spacer allocation of a new size (so the copies land at other
addresses, hence other physical pages) and times again, a few times over.

By default the compiled step is kept: the kernels and their tuned configs stay as they are, the
CUDA graph is re-recorded for the new addresses (cudagraph trees do that when a static input moves),
and the generated tokens must match the first placement's (else the graph read stale memory and the
run stops). --recompile also resets Dynamo after each move, so each placement compiles (and may tune)
anew: what the first run of this script did (2026-12-04, docs/BENCHMARKS.md session 18).

  step times that move between placements as much as between processes, kernels kept: placement;
  step times within ~1 % while the addresses change: the tuned picks (or the process's state).

--arena adds a last placement with every weight and buffer in ONE allocation (2 MiB-aligned views
into it), the remedy to try if placement is the cause: one cudaMalloc instead of one per tensor.

  python scripts/dense_placement.py --placements 4 --out runs/dense_placement     (CUDA only)
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402
import generate  # noqa: E402  (bench_decode put the repository on sys.path)
from bench_decode import random_model, time_decode  # noqa: E402


def move_to_fresh_storage(model):
    """Every parameter and buffer copied to new memory; the old storage is freed once the copies exist."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.data = tensor.data.clone()
    torch.cuda.empty_cache()


def move_to_one_allocation(model, align: int = 2**21) -> torch.Tensor:
    """Every parameter and buffer copied into views of one new allocation (each starting on an
    `align` boundary), which is returned; the old storage is freed."""
    tensors = list(model.parameters()) + list(model.buffers())
    nbytes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for size in nbytes:
        starts.append(starts[-1] + -(-size // align) * align)
    arena = torch.empty(starts[-1], dtype=torch.uint8, device=tensors[0].device)
    with torch.no_grad():
        for tensor, start, size in zip(tensors, starts, nbytes):
            view = arena[start:start + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.data)
            tensor.data = view
    torch.cuda.empty_cache()
    return arena


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Llama-3.1-8B")
    p.add_argument("--placements", type=int, default=4, help="weight placements after the first")
    p.add_argument("--recompile", action="store_true", help="reset Dynamo after each move (compile anew)")
    p.add_argument("--arena", action="store_true", help="then one more placement: all weights in one allocation")
    p.add_argument("--out", type=Path, default=Path("runs/dense_placement"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: dense_placement.py needs a CUDA GPU")
    bench_args = bench_decode.parse_args(["--models", args.model, "--out", str(args.out)])
    torch._dynamo.config.cache_size_limit = 64
    model = random_model(args.model)
    model.setup_caches(1, bench_args.prompt_length + bench_args.new_tokens)
    # Fixed prompts for the stale-memory check: the same weights at new addresses give the same tokens.
    check_prompts = [torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))]
    sampling = dict(temperature=bench_args.temperature, top_k=bench_args.top_k, top_p=bench_args.top_p, seed=0,
                    compile=True)
    spacers, rows, first_tokens, arena = [], [], None, None
    try:
        for placement in range(args.placements + 1 + args.arena):
            if placement > args.placements:
                arena = move_to_one_allocation(model)
            elif placement:
                # A spacer of a size no earlier one had, so the fresh copies start elsewhere.
                spacers.append(torch.empty(placement * 331 * 2**20, dtype=torch.uint8, device="cuda"))
                move_to_fresh_storage(model)
            if placement and args.recompile:
                torch._dynamo.reset()  # recompile against the new tensors (Inductor may tune anew)
            for repeat in range(2):  # the same placement twice: the spread inside one placement
                timing = time_decode(model, 1, bench_args, label=f"placement{placement}")
                rows.append(dict(placement=placement, repeat=repeat,
                                 median_step_ms=round(timing["median_step_s"] * 1e3, 3),
                                 first_weight_address=hex(model.layers[0].feed_forward.w13.weight.data_ptr()),
                                 spacer_mib=placement * 331 if arena is None else None,
                                 one_allocation=arena is not None, recompiled=bool(placement and args.recompile)))
                print(json.dumps(rows[-1]), flush=True)
            tokens = generate.generate(model, check_prompts, bench_args.new_tokens, **sampling).sequences
            first_tokens = first_tokens or tokens
            if any(not torch.equal(a, b) for a, b in zip(tokens, first_tokens)):
                sys.exit(f"error: placement {placement} generated other tokens than placement 0: the CUDA graph "
                         "did not follow the moved weights (run with --recompile)")
    finally:  # what was measured, even when a placement fails
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dense_placement.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
