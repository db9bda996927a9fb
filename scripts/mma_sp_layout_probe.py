"""Which register layout does the GPU's `mma.sp` m16n8k32 (bf16) read? One warp, one instruction, on
fragments built on the host from a random 16 x 32 2:4 matrix A and a 32 x 8 matrix B, under each of
a few hypotheses about the layout; the relative error of D against A @ B (float64) says which one
the hardware follows.

sparse/mma_sp.py's kernel is built on hypothesis ("k blocks in order", "groups 0-3 / 4-7"): the A
registers as the PTX ISA's text gives them, B register j holding K rows 8j + 2t and 8j + 2t + 1, and
the metadata of threads t = 0 / 1 holding groups 0-3 / 4-7 of rows g (low 16 bits) and g + 8. The
B and metadata layouts come from figures of the ISA, so the others are the nearest alternatives:
B registers in the order of K blocks 0, 2, 1, 3, and thread t = 0 / 1 holding all eight groups of
row g / g + 8. Under TRITON_INTERPRET=1 the instruction is sparse/mma_sp.py's emulation, so the
probe then checks that the emulation and this host-side builder agree (only the kernel's own
hypothesis matches); on a GPU it checks the hardware.

    python scripts/mma_sp_layout_probe.py          # a table: hypothesis, relative error
"""
import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sparse import mma_sp  # noqa: E402
from sparse.kernels import INTERPRETING  # noqa: E402

B_ORDERS = {"k blocks in order": (0, 1, 2, 3), "k blocks 0, 2, 1, 3": (0, 2, 1, 3)}
METADATA_LAYOUTS = ("groups 0-3 / 4-7", "row g / row g + 8")


@triton.jit
def _one_instruction(a_ptr, b_ptr, c_ptr, e_ptr, d_ptr, INTERPRETER_SAFE: tl.constexpr):
    """d = mma.sp(a, b, c, e) for one warp; register r of lane l at [r * 32 + l]."""
    lane = tl.arange(0, 32)
    a = (tl.load(a_ptr + lane), tl.load(a_ptr + 32 + lane), tl.load(a_ptr + 64 + lane), tl.load(a_ptr + 96 + lane))
    b = (tl.load(b_ptr + lane), tl.load(b_ptr + 32 + lane), tl.load(b_ptr + 64 + lane), tl.load(b_ptr + 96 + lane))
    c = (tl.load(c_ptr + lane), tl.load(c_ptr + 32 + lane), tl.load(c_ptr + 64 + lane), tl.load(c_ptr + 96 + lane))
    d = mma_sp._mma_sp(a, b, c, tl.load(e_ptr + lane), INTERPRETER_SAFE)
    for i in tl.static_range(4):
        tl.store(d_ptr + i * 32 + lane, d[i])


def random_operands(seed: int = 0):
    """A (16 x 32, two kept in every group of four, bf16-exact) and B (32 x 8), float64."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 32, generator=generator).to(torch.bfloat16).double()
    keep = torch.zeros(16, 8, 4, dtype=torch.bool)
    for row in range(16):
        for group in range(8):
            keep[row, group, torch.randperm(4, generator=generator)[:2]] = True
    b = torch.randn(32, 8, generator=generator).to(torch.bfloat16).double()
    return a * keep.reshape(16, 32), keep.reshape(16, 32), b


def _bf16_pair(low: float, high: float) -> int:
    bits = torch.tensor([low, high], dtype=torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def fragments(a, keep, b, b_order=(0, 1, 2, 3), metadata_layout="groups 0-3 / 4-7"):
    """Per lane (g, t) the registers (a: 4, b: 4, e), as uint32 tensors [register, lane], under the
    given hypothesis; a's registers as the PTX ISA's text gives them."""
    kept = [[[i for i in range(4) if keep[row, 4 * group + i]] for group in range(8)] for row in range(16)]
    a_regs, b_regs, e = torch.zeros(4, 32, dtype=torch.int64), torch.zeros(4, 32, dtype=torch.int64), []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, group) in enumerate([(g, t), (g + 8, t), (g, 4 + t), (g + 8, 4 + t)]):
            first, second = kept[row][group]
            a_regs[r, lane] = _bf16_pair(a[row, 4 * group + first], a[row, 4 * group + second])
        for j in range(4):
            k = 8 * b_order[j] + 2 * t
            b_regs[j, lane] = _bf16_pair(b[k, g], b[k + 1, g])

        def codes(row, groups):
            return sum((kept[row][group][0] | kept[row][group][1] << 2) << 4 * i for i, group in enumerate(groups))

        if metadata_layout == "groups 0-3 / 4-7":
            groups = range(4 * (t % 2), 4 * (t % 2) + 4)
            e.append(codes(g, groups) | codes(g + 8, groups) << 16)
        else:
            e.append(codes(g + 8 * (t % 2), range(8)))
    as_uint32 = lambda values: torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.uint32)  # noqa: E731
    return (as_uint32(a_regs.tolist()), as_uint32(b_regs.tolist()), as_uint32(e))


def run_instruction(a_regs, b_regs, e, device: str):
    """D (16 x 8, float64) from one mma.sp on these fragments (zero C)."""
    c = torch.zeros(4, 32, dtype=torch.float32, device=device)
    d = torch.empty(4, 32, dtype=torch.float32, device=device)
    _one_instruction[(1, )](a_regs.to(device), b_regs.to(device), c, e.to(device), d,
                            INTERPRETER_SAFE=INTERPRETING, num_warps=1)
    out = torch.empty(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):  # d0, d1: row g, columns 2t, 2t + 1; d2, d3: row g + 8
            out[g + 8 * (i // 2), 2 * t + i % 2] = float(d[i, lane])
    return out


def probe(device: str, seed: int = 0) -> dict:
    """{(B order, metadata layout): relative error of D against A @ B}."""
    a, keep, b = random_operands(seed)
    expected = a @ b
    errors = {}
    for order_name, order in B_ORDERS.items():
        for layout in METADATA_LAYOUTS:
            d = run_instruction(*fragments(a, keep, b, order, layout), device)
            errors[order_name, layout] = float((d - expected).norm() / expected.norm())
    return errors


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
    if device == "cpu" and not INTERPRETING:
        sys.exit("mma_sp_layout_probe: needs a CUDA GPU, or TRITON_INTERPRET=1 to check the emulation")
    print(f"mma.sp m16n8k32 bf16 on {'the interpreter (emulated)' if device == 'cpu' else torch.cuda.get_device_name()}")
    print("| B registers | metadata | relative error of D |\n|---|---|---|")
    for (order, layout), error in probe(device, args.seed).items():
        print(f"| {order} | {layout} | {error:.2e} |")


if __name__ == "__main__":
    main()
