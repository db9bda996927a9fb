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
    timeline = timeline_summary(prof, steps)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in events) / steps
    lines = [f"{steps} decode steps (+ one prefill, included below); GPU kernel time per step {total_us:.1f} us",
             f"{'us/step':>9} {'calls/step':>10}  kernel"]
    lines += [f"{e.self_device_time_total / steps:9.1f} {e.count / steps:10.2f}  {e.key[:150]}" for e in events[:60]]
    lines += [""] + timeline
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:25]), flush=True)


def timeline_summary(prof, steps: int) -> list:
    """`timeline_lines` of the profile's kernels."""
    return timeline_lines(sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                                 if e.device_type == torch.autograd.DeviceType.CUDA), steps)


def timeline_lines(kernels: list, steps: int) -> list:
    """Lines on how the kernels ((start, end, name), in start order) sit in time, which their
    summed durations hide: the GPU's busy time (the union of kernel intervals) and idle time per
    step, and for the kernels that take most time, by the kernel that ran before them (the o
    projection's SpMV follows the attention, the others another SpMV), the mean gap between the
    previous kernel's end and their start (negative: they started early, as a programmatic
    dependent launch may, and waited) and their exposed time (end minus the later of their start
    and the previous end: what they add to the step)."""
    if not kernels:
        return []
    busy, stats, last_end, previous = 0.0, {}, kernels[0][0], ""
    for start, end, name in kernels:
        busy += max(0.0, end - max(start, last_end))
        gaps, exposed = stats.setdefault((name, previous), ([], []))
        gaps.append(start - last_end)
        exposed.append(max(0.0, end - max(start, last_end)))
        last_end, previous = max(last_end, end), name
    span = last_end - kernels[0][0]
    lines = [f"timeline: span {span / steps:.1f} us/step, GPU busy (union of kernels) {busy / steps:.1f}, "
             f"idle {(span - busy) / steps:.1f}",
             f"{'exposed us/step':>15} {'mean gap before us':>18} {'calls/step':>10}  kernel  (after the kernel before it)"]
    top = sorted(stats.items(), key=lambda item: -sum(item[1][1]))[:20]
    lines += [f"{sum(exposed) / steps:15.1f} {sum(gaps) / len(gaps):18.2f} {len(gaps) / steps:10.2f}  {name[:100]}"
              f"  (after {previous[:60] or 'nothing'})" for (name, previous), (gaps, exposed) in top]
    return lines
