"""Where the lm_head's time goes in a compiled decode step: dense vs 2:4, with Inductor variants (GPU).

    python scripts/probe_lm_head.py --layers 2 --variants dense,sparse,sparse_cublas_head --out runs/probe
    python scripts/probe_lm_head.py --layers 32 --variants sparse --tag _L32 --out runs/probe

Why it exists: in bench_decode's 2026-12-01 runs (dense, then 2:4, in one process) the 2:4 model's
lm_head kernel took 432 us a step against 233-272 us in the dense model. Each variant here runs in
a process of its own (a fresh Python, a fresh Inductor) on the Llama-3.1-8B shape cut to --layers
layers, random bf16 weights, batch 1, a 512-token prompt and 128 new tokens at T 0.8 / top-k 200
(bench_decode's sampling). It prints the median decode step (steps 20 on) and the first kernels of
torch.profiler's table per step, and writes OUT/profile_<variant>.txt, OUT/log_<variant>.txt and
Inductor's generated code (TORCH_LOGS=output_code) to OUT/code_<variant>.txt.

Variants: dense | sparse (2:4 via swap_to_sparse) | sparse_no_mix (Inductor's mix-order reduction
off) | sparse_realized_norm (the final norm's output made a buffer of its own by an identity custom
op) | sparse_cublas_head and dense_cublas_head (the lm_head through cuBLAS, F.linear in a custom
op) | dense_mk and sparse_mk (Inductor's multi_kernel=1: persistent and looped reductions both
compiled, the faster kept). What the 2026-12-02 runs found is in docs/BENCHMARKS.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = ["dense", "sparse", "sparse_no_mix", "sparse_realized_norm", "sparse_cublas_head", "dense_cublas_head",
            "dense_mk", "sparse_mk"]
INDUCTOR_PATCHES = {"sparse_no_mix": {"triton.mix_order_reduction": False},
                    "dense_mk": {"triton.multi_kernel": 1}, "sparse_mk": {"triton.multi_kernel": 1}}


def followed_by(module, op):
    """A module that runs `module`, then `op` on its output (an op Inductor cannot fuse across)."""
    import torch.nn as nn

    class Followed(nn.Module):
        def forward(self, x):
            return op(module(x))

    return Followed()


def run_variant(variant: str, layers: int, out: Path, tag: str):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import generate
    import sparse
    from scripts.bench_decode import random_model
    from scripts.kernel_profile import profile_steps

    model = random_model("Llama-3.1-8B", n_layer=layers)
    model.setup_caches(1, 512 + 128)
    if variant.startswith("sparse"):
        sparse.swap_to_sparse(model, "2:4")  # the lm_head stays dense
    generate.INDUCTOR_OPTIONS = {**generate.INDUCTOR_OPTIONS, **INDUCTOR_PATCHES.get(variant, {})}
    if variant == "sparse_realized_norm":
        @torch.library.custom_op("probe::realize", mutates_args=())
        def realize(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        realize.register_fake(lambda x: torch.empty_like(x))
        model.norm = followed_by(model.norm, realize)
    if variant.endswith("cublas_head"):
        @torch.library.custom_op("probe::linear", mutates_args=())
        def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return F.linear(x, weight)

        linear.register_fake(lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0]))
        weight = model.output.weight
        model.output = followed_by(nn.Identity(), lambda x: linear(x, weight))
    prompts = [torch.randint(0, model.config.vocab_size, (512,))]
    sampling = dict(temperature=0.8, top_k=200, seed=0, compile=True)
    generate.generate(model, prompts, 128, **sampling)  # compiles and warms up
    result = generate.generate(model, prompts, 128, **sampling)
    profile_steps(lambda: generate.generate(model, prompts, 128, **sampling), 127, out / f"profile_{variant}{tag}.txt")
    step_ms = statistics.median(result.step_times_s[20:]) * 1e3
    print(json.dumps(dict(variant=variant, layers=layers, median_step_ms=round(step_ms, 4))), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tag", default="", help="appended to the output file names")
    p.add_argument("--timeout_s", type=float, default=400, help="per variant")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: probe_lm_head.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.variant:
        return run_variant(args.variant, args.layers, args.out, args.tag)
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            sys.exit(f"error: unknown variant '{variant}' (known: {', '.join(VARIANTS)})")
        env = dict(os.environ, TORCH_LOGS="output_code", TORCH_LOGS_OUT=str(args.out / f"code_{variant}{args.tag}.txt"))
        log = args.out / f"log_{variant}{args.tag}.txt"
        with open(log, "w") as log_file:
            try:
                subprocess.run([sys.executable, __file__, "--variant", variant, "--layers", str(args.layers),
                                "--tag", args.tag, "--out", str(args.out)], env=env, stdout=log_file,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                print(f"{variant}: timed out after {args.timeout_s:.0f} s", flush=True)
        print(variant, [line for line in log.read_text().splitlines() if line.startswith("{")], flush=True)
        profile = args.out / f"profile_{variant}{args.tag}.txt"
        if profile.exists():
            print("\n".join(profile.read_text().splitlines()[:9]), flush=True)


if __name__ == "__main__":
    main()
