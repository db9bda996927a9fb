"""scripts/kernel_sass.py: the SpMV compiles for sm_90a without a GPU, and the properties the
kernel's design rests on hold in its machine code (docs/KERNEL_NOTES.md)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import kernel_sass  # noqa: E402


def test_batch_one_spmv_machine_code():
    report = kernel_sass.compile_spmv(kernel_sass.kernels_module(), batch=1, rows_per_thread=1, warps=4,
                                      words_per_step=1, one_step=False)
    assert report["spill_bytes"] == 0
    # Per kept weight one bit scan (FLO) and one FMA: 16 of each per word walked.
    assert report["ffma"] == 16 and report["flo"] >= 16
    # No shared-memory layout conversion inside the loop (the split-K barrier's LDS/STS only).
    assert report["shared"] <= 2
    assert report["loop"] is not None and report["loop"] / report["kept_weights"] < 17.7  # the issue budget
