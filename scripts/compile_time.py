"""How long a tuner's candidates take to compile, one at a time against `kernels.compile_all`'s
threads: the tensor-core product's candidates (sparse/mma_sp.py, 40 a shape) and the SpMV's, for
one weight shape and row count, each thread count with an empty Triton cache (a temporary
directory) and an empty JIT cache, so every candidate really compiles.

    python scripts/compile_time.py --shape 6144x4096 --rows 1 --threads 1,2,4,16

On a machine without a GPU the JIT compiles for an sm_90 stand-in (`Sm90StandIn`: the same
Triton -> PTX -> cubin work, no launch); with one, for the GPU there.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sparse import kernels, mma_sp  # noqa: E402
from sparse.format import pack  # noqa: E402


class Sm90StandIn:
    """What Triton's JIT asks its driver before a compile, answered for an sm_90 GPU (an H100 or
    H200): enough for `compile_only` launches (Triton's warmup) on a machine without one."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def candidates_and_compile(kernel_name: str, out_features: int, in_features: int, rows: int, device: str):
    """(the JIT kernel, its candidate configs, compile_only(config)) for one shape and row count."""
    weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
    values, mask = pack(weight, "2:4")
    x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
    if kernel_name == "mma_sp":
        return (mma_sp._mma_sp_kernel, mma_sp.candidate_configs(in_features // 32),
                lambda config: mma_sp.spmv_2of4(x, values, mask, config=config, compile_only=True))
    return (kernels._spmv_kernel, kernels.candidate_configs(out_features, in_features // 32, rows),
            lambda config: kernels.spmv(x, values, mask, config=config, compile_only=True))


def time_compiles(kernel, configs, compile_only, threads: int):
    """(seconds for compile_all over `configs` on `threads` threads from empty caches, the kernels
    it compiled: fewer than the configs where some differ only in run-time arguments)."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_time_")
    kernel.device_caches = defaultdict(kernel.create_binder)
    kernels.COMPILE_THREADS = threads
    start = time.perf_counter()
    kernels.compile_all(configs, compile_only)
    seconds = time.perf_counter() - start
    device = driver.active.get_current_device()
    return seconds, len(kernel.device_caches[device][0])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="mma_sp,spmv", help="mma_sp and/or spmv")
    parser.add_argument("--shape", default="6144x4096", help="out_features x in_features")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1-16)")
    parser.add_argument("--threads", default="1,2,4,16", help="compile threads to compare")
    parser.add_argument("--out-json", help="write the table here as JSON")
    args = parser.parse_args()
    out_features, in_features = (int(n) for n in args.shape.split("x"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        driver.set_active(Sm90StandIn())
    rows = []
    for kernel_name in args.kernels.split(","):
        kernel, configs, compile_only = candidates_and_compile(kernel_name, out_features, in_features, args.rows,
                                                               device)
        compile_only(configs[0])  # the first compile loads the backend: not part of any row
        for threads in (int(t) for t in args.threads.split(",")):
            seconds, compiled = time_compiles(kernel, configs, compile_only, threads)
            rows.append(dict(kernel=kernel_name, shape=args.shape, rows=args.rows, configs=len(configs),
                             compiled=compiled, threads=threads, seconds=round(seconds, 2)))
            print(f"{kernel_name} {args.shape} x {args.rows} rows: {len(configs)} configs ({compiled} kernels) on "
                  f"{threads} threads {seconds:.2f} s", flush=True)
    print(f"\ncompile times ({device}, {os.cpu_count()} CPUs)\n\n| kernel | configs (kernels) | threads | s | faster than the first row |\n"
          "|---|---|---|---|---|")
    for row in rows:
        first = next(r for r in rows if r["kernel"] == row["kernel"])
        print(f"| {row['kernel']} | {row['configs']} ({row['compiled']}) | {row['threads']} | {row['seconds']:.2f} | "
              f"{first['seconds'] / row['seconds']:.2f}x |")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(dict(device=device, cpus=os.cpu_count(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
