"""scripts/kernel_sass.py: the SpMV compiles for sm_90a without a GPU (its inline-asm path
included), and the properties the kernel's design rests on hold in its machine code
(docs/KERNEL_NOTES.md)."""
import re
import sys
from pathlib import Path

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse import kernels

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


@pytest.mark.parametrize("batch", [4, 8, 16])
def test_small_batch_spmv_machine_code(batch):
    report = kernel_sass.compile_spmv(kernel_sass.kernels_module(), batch=batch, rows_per_thread=1, warps=4,
                                      words_per_step=1, one_step=False)
    assert report["spill_bytes"] == 0 and report["shared"] <= 2
    assert report["ffma"] == 16 * batch
    # x comes in one 128-bit load per four lanes (the inline ld.global.ca.v4.f32), 16 steps per word.
    assert report["sass"].count("LDG.E.128") == 16 * batch // 4
    if batch == 4:
        assert report["loop"] / report["kept_weights"] < 17.7


@triton.jit
def _lane_order_probe(x_ptr, y_ptr, LANES: tl.constexpr):
    """Row r of a warp loads x[r, 0:LANES] through the SpMV's GPU path and stores lane l at
    y[l, r]: one thread per row, so the stores need no shuffle and each register's way from
    load to store is visible in the PTX."""
    rows = tl.arange(0, 32)
    lanes = kernels._load_lanes(x_ptr + rows * LANES, LANES, False)
    tl.store(y_ptr + tl.arange(0, LANES)[None, :] * 32 + rows[:, None], lanes)


@pytest.mark.parametrize("lanes", [2, 4, 8, 16])
def test_vector_loads_keep_the_lane_order(lanes):
    """The inline asm runs only on the GPU; its lane order is checked here in the PTX instead:
    the register the vector load fills from byte 4*l of a row must be the one stored as lane l."""
    compiled = triton.compile(ASTSource(fn=_lane_order_probe, signature={"x_ptr": "*fp32", "y_ptr": "*fp32",
                                                                         "LANES": "constexpr"},
                                        constexprs={"LANES": lanes}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    ptx = compiled.asm["ptx"]
    offset = {}  # address register -> bytes past its base register
    for target, source, added in re.findall(r"add\.s64\s+(%rd\d+), (%rd\d+), (\d+);", ptx):
        offset[target] = offset.get(source, 0) + int(added)
    loaded_lane = {}
    for registers, address in re.findall(r"ld\.global\.ca\.v[24]\.f32\s+\{([^}]*)\}, \[(%rd\d+)\]", ptx):
        for i, register in enumerate(registers.split(",")):
            loaded_lane[register.strip()] = (offset.get(address, 0) + 4 * i) // 4
    stored_lane = {}
    for address, added, register in re.findall(r"st\.global\.b32 \[ (%rd\d+) \+ (\d+) \], \{ (%r\d+) \}", ptx):
        stored_lane[register] = (offset.get(address, 0) + int(added)) // (32 * 4)
    assert len(loaded_lane) == lanes and sorted(stored_lane.values()) == list(range(lanes)), ptx
    assert stored_lane == {register: loaded_lane[register] for register in stored_lane}
