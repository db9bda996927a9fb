"""scripts/kernel_profile.py: the timeline lines a profile ends with, on a made-up kernel sequence."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.kernel_profile import timeline_lines  # noqa: E402


def test_timeline_splits_a_kernel_by_the_one_before_it():
    # Two steps of attention -> spmv (o) -> spmv (w13), µs; the o SpMV starts 2 µs before the
    # attention ends (a programmatic dependent launch) and waits; a 1 µs idle gap before each step.
    kernels = []
    for t in (0.0, 20.0):
        kernels += [(t + 1, t + 6, "attention"), (t + 4, t + 10, "spmv"), (t + 10.5, t + 19, "spmv")]
    lines = timeline_lines(kernels, steps=2)
    assert lines[0] == "timeline: span 19.0 us/step, GPU busy (union of kernels) 17.5, idle 1.5"
    after_attention = next(line for line in lines if line.endswith("spmv  (after attention)"))
    exposed, gap, calls = (float(v) for v in after_attention.split()[:3])
    assert (exposed, gap, calls) == (4.0, -2.0, 1.0)  # 6 to 10, started 2 before the attention's end
    after_spmv = next(line for line in lines if line.endswith("spmv  (after spmv)"))
    assert [float(v) for v in after_spmv.split()[:3]] == [8.5, 0.5, 1.0]
