"""Kernel time per decode step from torch.profiler, shared by bench_decode.py --profile (our engine)
and gptfast_decode_driver.py (GPT-Fast, run in its own process). Imports nothing but torch, so
both can load it whatever else is on their path."""
from pathlib import Path

import torch


def profile_steps(run, steps: int, path: Path):
    """Kernel time per decode step (CUDA graph replays included: CUPTI reports each kernel of a
    replayed graph), summed by kernel name and divided by the steps; the table goes to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in events) / steps
    lines = [f"{steps} decode steps (+ one prefill, included below); GPU kernel time per step {total_us:.1f} us",
             f"{'us/step':>9} {'calls/step':>10}  kernel"]
    lines += [f"{e.self_device_time_total / steps:9.1f} {e.count / steps:10.2f}  {e.key[:150]}" for e in events[:60]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:25]), flush=True)
