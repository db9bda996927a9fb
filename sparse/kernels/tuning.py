"""Timing and racing of kernel configs, the way a compiled decode step runs them.

Every tuner here times candidates inside a CUDA graph (launch gaps as in a compiled decode step,
no Python launch overhead), rotating over copies of the packed weight that together exceed the L2
three times, so that the weights stream from DRAM as they do in a decode step. Triton's do_bench
(L2 cleared, each call launched from Python) picked measurably slower configs and different ones
from process to process (docs/KERNELS.md). Candidates are compiled first, several at a time
(`compile_all`), because compiling dominated a tuning.

`tuned_config` is the cache every kernel's tuner goes through: the fastest config per key, timed
once; `fastest_in_cuda_graph` also races whole kernels (sparse/linear.py's measured route).
"""
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

# Compiles run in threads, most of their work outside the GIL (Triton's AsyncCompileMode).
COMPILE_THREADS = min(16, os.cpu_count() or 1)
L2_BYTES = 60e6  # the H200's L2 is ~60 MB (50 MB on an H100): copies rotated past it come from DRAM
# A tuner copies a weight at most this many times. A layer so small that more copies would be needed
# sits in the L2 in a real decode step too (its whole model is small), and tens of thousands of
# copies of it made a tuning take minutes; every layer of the benchmarked models needs fewer.
TUNING_MAX_COPIES = 128


def copies_for(nbytes: int) -> int:
    """Copies of an operand of nbytes so that rotating through them always misses the L2."""
    return max(1, math.ceil(3 * L2_BYTES / nbytes))


def time_in_cuda_graph(calls, target_ms: float = 3.0, replays: int = 15) -> float:
    """Median microseconds per call of `calls` (run round-robin), recorded into one CUDA graph of
    about target_ms and replayed: launch gaps as in a compiled decode step, no Python launch
    overhead in the number. The benchmarks (scripts/bench_kernel.py) time with this too."""
    for call in calls:  # compile and warm up outside the graph
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    estimate_ms = start.elapsed_time(end) / len(calls)
    loops = max(1, min(200, round(target_ms / max(estimate_ms, 1e-3) / len(calls))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(loops):
            for call in calls:
                call()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1000 / (loops * len(calls))


def compile_all(configs, compile_only):
    """Calls compile_only(c) for every config c, each a launch that only compiles its kernel (the
    launchers' compile_only=True: Triton's warmup), COMPILE_THREADS compiles at a time; later
    launches of those configs then find their kernels compiled."""
    with ThreadPoolExecutor(COMPILE_THREADS) as pool, triton.AsyncCompileMode(pool):
        for config in configs:
            compile_only(config)


def fastest_in_cuda_graph(configs, values: torch.Tensor, mask: torch.Tensor, run, timings_out: dict = None,
                          compile_only=None):
    """The config c of `configs` for which run(c, values, mask) is fastest, each timed in a CUDA
    graph rotating over copies of the packed weight that together exceed the L2 three times (so
    they stream from DRAM, as in a decode step), at most TUNING_MAX_COPIES of them. Every tuner and
    the measured route use it.
    timings_out, if given, receives {config: µs a call} for every candidate. compile_only, if given:
    as `compile_all` takes it; every candidate is then compiled first, several at a time."""
    if compile_only is not None:
        compile_all(configs, compile_only)
    nbytes = values.numel() * values.element_size() + mask.numel() * 4
    count = min(copies_for(nbytes), TUNING_MAX_COPIES)
    copies = [(values, mask)] + [(values.clone(), mask.clone()) for _ in range(count - 1)]
    timings = [time_in_cuda_graph([lambda v=v, m=m, c=c: run(c, v, m) for v, m in copies], target_ms=1.0, replays=9)
               for c in configs]
    if timings_out is not None:
        timings_out.update(zip(configs, timings))
    return configs[timings.index(min(timings))]


def tuned_config(cache: dict, key, configs: list, x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, run,
                 compile_only, timings_out: dict = None):
    """cache[key], or the fastest of `configs` for run(config, values, mask) (see
    fastest_in_cuda_graph), timed now and remembered. Without a choice to make, or off CUDA (the
    interpreter), the first config. While a CUDA graph is being captured nothing can be timed: the
    first config, not remembered (a warm-up call outside the capture tunes it)."""
    if key in cache:
        return cache[key]
    if len(configs) == 1 or not x.is_cuda:
        cache[key] = configs[0]
    elif torch.cuda.is_current_stream_capturing():
        return configs[0]
    else:
        cache[key] = fastest_in_cuda_graph(configs, values, mask, run, timings_out, compile_only)
    return cache[key]
