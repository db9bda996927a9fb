"""How fast can the batch-1 SpMV's weight reads go without its arithmetic, and would another layout
read faster? A Triton kernel that only loads a packed weight and XORs what it loads, on the SpMV's
own grid (the tuned config's warps per program, words per warp and prefetch depth) with the SpMV's
16-byte `.cg` loads, in two layouts of the same bytes:

- "packed": sparse/format.py's buffers, read as the SpMV reads them. Per mask word a warp reads
  128 B of mask words and two 512-B runs of values n_rows x 16 B apart: three places in memory.
- "interleaved": the same 32-bit words rearranged so that a warp's word (32 mask words, then the
  32 rows' values) is one 1152-B run and a warp's successive words follow each other: one long
  stream a warp, as a dense GEMV row is. A layout the format could adopt.

And a third kernel, "the SpMV without its scan": the SpMV's own loader (x's element too) and
its ending (the program's warps summed in shared memory, the K splits through the workspace and
the arrival counter), with the 16-step bit scan, shuffles and FMAs of each word replaced by XORs.

And the packed probe once more with K split in two (`halved_programs`), for what evening out the
whole-K grids over the SMs would be worth.

Printed per shape beside the tuned SpMV (batch 1, no fusions) and cuBLAS bf16, all timed as
bench_kernel.py times (`kernels.time_in_cuda_graph`, rotating copies past the L2). The SpMV is
timed twice: as a decode step launches it (programmatic dependent launches with the L2 prefetch,
kernels.PDL_L2_PREFETCH_BYTES: each call overlaps the previous one's tail) and with plain
launches, as the probe's kernels and cuBLAS launch; the probe's columns compare with the plain
one (sessions 21-24 measured them before the SpMV had PDL). Reading the
result (docs/KERNEL_NOTES.md, session 21: in a decode step the SpMV reads at 79 % of its bytes
floor, dense's GEMVs at 87 %): "packed" close to the SpMV says the kernel is bound by its loads,
not its arithmetic; "interleaved" well under "packed" says the layout costs bandwidth (session
22: neither; the packed reads ran 1.0-1.9 µs a call under the SpMV). Of that gap, the SpMV
minus "without its scan" is the scan's share, and "without its scan" minus "packed" that of x's
loads and the ending.

    python scripts/load_probe.py --shapes 6144x4096,4096x4096,28672x4096,4096x14336
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sparse import kernels  # noqa: E402
from sparse.format import pack  # noqa: E402
from sparse.kernels import INTERPRETING, _load_u32  # noqa: E402


@triton.jit
def _load_word_bits(mask_u32, values_u32, k, row_block, lane, n_rows, n_words, CHUNKS: tl.constexpr,
                    U32_PER_CHUNK: tl.constexpr, INTERLEAVED: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """The XOR of the mask word and value words of word k (clamped; zero past the end) of each
    thread's row, loaded from either layout."""
    valid = k < n_words
    k = tl.minimum(k, n_words - 1)
    if INTERLEAVED:  # one buffer: per (row block, word) 32 mask words, then CHUNKS x 32 rows x U32_PER_CHUNK
        base = mask_u32 + (row_block * n_words + k) * (32 * (1 + CHUNKS * U32_PER_CHUNK))
        bits = _load_u32(base + lane, 1, INTERPRETER_SAFE)[0]
        for c in tl.static_range(CHUNKS):
            tile = _load_u32(base + 32 + (c * 32 + lane) * U32_PER_CHUNK, U32_PER_CHUNK, INTERPRETER_SAFE)
            for u in tl.static_range(U32_PER_CHUNK):
                bits = bits ^ tile[u]
    else:
        rows = row_block * 32 + lane
        bits = _load_u32(mask_u32 + k * n_rows + rows, 1, INTERPRETER_SAFE)[0]
        for c in tl.static_range(CHUNKS):
            tile = _load_u32(values_u32 + ((k * CHUNKS + c) * n_rows + rows) * U32_PER_CHUNK, U32_PER_CHUNK,
                             INTERPRETER_SAFE)
            for u in tl.static_range(U32_PER_CHUNK):
                bits = bits ^ tile[u]
    return tl.where(valid, bits.to(tl.uint32, bitcast=True), 0)


@triton.jit
def _word_bits(x_ptr, mask_u32, values_u32, k, row_block, lane, n_rows, n_words, CHUNKS: tl.constexpr,
               U32_PER_CHUNK: tl.constexpr, INTERLEAVED: tl.constexpr, SPMV_LOADS: tl.constexpr,
               INTERPRETER_SAFE: tl.constexpr):
    """`_load_word_bits`, or with SPMV_LOADS the SpMV's own loader (`kernels._load_word`: the mask
    word made ready to scan, the values, and x's lane through L1), all XORed (zero past the end)."""
    if SPMV_LOADS:
        word, tile, x_lanes, valid, _ = kernels._load_word(
            x_ptr, x_ptr, values_u32, mask_u32, k, row_block * 32 + lane, lane, n_rows, n_words, n_words * 32, 1, (),
            CHUNKS, U32_PER_CHUNK, 1, False, False, False, False, INTERPRETER_SAFE)
        bits = word ^ (x_lanes[0] >> 16)  # x's float32 bits: bf16 in the high half, which the low byte must see
        for u in tl.static_range(len(tile)):
            bits = bits ^ tile[u]
        bits = tl.where(valid, bits, 0)
    else:
        bits = _load_word_bits(mask_u32, values_u32, k, row_block, lane, n_rows, n_words, CHUNKS, U32_PER_CHUNK,
                               INTERLEAVED, INTERPRETER_SAFE)
    return bits


@triton.jit
def _read_kernel(x_ptr, mask_u32, values_u32, out_ptr, workspace_ptr, arrivals_ptr, n_rows, n_words, words_per_warp,
                 CHUNKS: tl.constexpr, U32_PER_CHUNK: tl.constexpr, SLICES: tl.constexpr, PREFETCH: tl.constexpr,
                 INTERLEAVED: tl.constexpr, SPMV_LOADS: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """Grid (row blocks, K splits) and warps as the SpMV's; each thread XORs every 32-bit word of its
    row's words, and each program stores the XOR of its threads' (so no load is dead, and the
    stores, 4 B a program, add nothing measurable).

    SPMV_LOADS: the SpMV without its scan. Its loader (x's lanes too) instead of the plain loads,
    and its ending: each thread's low byte of the XOR as a float, summed over the program's warps
    through shared memory and over the K splits through the workspace and the arrival counter
    (`kernels._store_or_reduce`), stored per row (fp32) to out_ptr."""
    THREADS: tl.constexpr = 32 * SLICES
    thread = tl.arange(0, THREADS)
    lane = thread % 32
    row_block = tl.program_id(0)
    k_first = (tl.program_id(1) * SLICES + thread // 32) * words_per_warp
    # The SpMV's software pipeline: word i + PREFETCH's loads go out before word i is used.
    bits = _word_bits(x_ptr, mask_u32, values_u32, k_first, row_block, lane, n_rows, n_words, CHUNKS, U32_PER_CHUNK,
                      INTERLEAVED, SPMV_LOADS, INTERPRETER_SAFE)
    if PREFETCH == 2:
        bits1 = _word_bits(x_ptr, mask_u32, values_u32, k_first + 1, row_block, lane, n_rows, n_words, CHUNKS,
                           U32_PER_CHUNK, INTERLEAVED, SPMV_LOADS, INTERPRETER_SAFE)
    acc = tl.zeros([THREADS], dtype=tl.uint32)
    for i in range(PREFETCH, words_per_warp):
        next_bits = _word_bits(x_ptr, mask_u32, values_u32, k_first + i, row_block, lane, n_rows, n_words, CHUNKS,
                               U32_PER_CHUNK, INTERLEAVED, SPMV_LOADS, INTERPRETER_SAFE)
        acc = acc ^ bits
        if PREFETCH == 2:
            bits, bits1 = bits1, next_bits
        else:
            bits = next_bits
    acc = acc ^ bits
    if PREFETCH == 2:
        acc = acc ^ bits1
    if SPMV_LOADS:
        sums = tl.sum(tl.reshape((acc & 0xFF).to(tl.float32), (SLICES, 32)), axis=0)
        rows = row_block * 32 + tl.arange(0, 32)
        kernels._store_or_reduce(sums, out_ptr, workspace_ptr, arrivals_ptr, row_block, rows, rows < n_rows,
                                 tl.num_programs(1))
    else:
        program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(out_ptr + program, tl.xor_sum(acc, axis=0).to(tl.int32, bitcast=True))


def interleave(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The packed weight's 32-bit words as one buffer [row blocks, words, 32 mask words + the 32 rows'
    values chunk by chunk] (the "interleaved" layout)."""
    n_words, n_rows = mask.shape
    chunks = values.shape[0] // n_words
    values_u32 = values.contiguous().view(torch.int32).view(n_words, chunks, n_rows // 32, 32, -1)
    mask_blocks = mask.view(n_words, n_rows // 32, 32).permute(1, 0, 2)
    value_blocks = values_u32.permute(2, 0, 1, 3, 4).reshape(n_rows // 32, n_words, -1)
    return torch.cat([mask_blocks, value_blocks], dim=-1).contiguous()


def read(values: torch.Tensor, mask: torch.Tensor, config, interleaved: torch.Tensor = None,
         x: torch.Tensor = None) -> torch.Tensor:
    """Run the probe once with the SpMV config (slices, words per warp, prefetch); returns what each
    program stored. interleaved: `interleave(values, mask)`, to read that layout instead. x (1, in):
    the SpMV without its scan instead (SPMV_LOADS in `_read_kernel`); returns one fp32 per row."""
    n_words, n_rows = mask.shape
    if n_rows % 32:
        raise ValueError(f"load_probe: out_features {n_rows} is not a multiple of 32")
    chunks_total, _, chunk = values.shape
    slices, words_per_warp, prefetch = config
    split = triton.cdiv(n_words, slices * words_per_warp)
    if x is None:
        out = torch.empty(n_rows // 32 * split, dtype=torch.int32, device=mask.device)
        workspace = arrivals = mask  # unused pointers: compiled out
    else:
        out = torch.empty(n_rows, dtype=torch.float32, device=mask.device)
        workspace, arrivals = kernels._workspace(mask.device, n_rows, n_rows // 32)  # the SpMV's, left zeroed
    source = mask if interleaved is None else interleaved
    _read_kernel[(n_rows // 32, split)](
        mask if x is None else x, source, values.view(torch.int32), out, workspace, arrivals, n_rows, n_words,
        words_per_warp, CHUNKS=chunks_total // n_words, U32_PER_CHUNK=chunk * values.element_size() // 4,
        SLICES=slices, PREFETCH=prefetch, INTERLEAVED=interleaved is not None, SPMV_LOADS=x is not None,
        INTERPRETER_SAFE=INTERPRETING, num_warps=slices)
    return out


def halved_programs(config):
    """The config with half the warps a program, so K splits in two over twice the programs (None
    for one warp a program): with K whole, a call has one program per 32-row block, and on
    6144x4096 (192 of them, two to an SM) 60 SMs stream two blocks while 72 stream one. The packed
    probe at this config, whose programs only store (no split-K ending), says what evening that
    out is worth before anything pays an ending for it (docs/KERNEL_NOTES.md, session 22)."""
    slices, words_per_warp, prefetch = config
    return (slices // 2, words_per_warp, prefetch) if slices > 1 else None


def probe_shape(out_features: int, in_features: int) -> dict:
    """µs per call at batch 1: the tuned SpMV, the probe on both layouts (its config), cuBLAS."""
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * in_features ** -0.5
    values, mask = pack(weight, "2:4")
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
    config = kernels.spmv_config(x, values, mask)
    packed_bytes = values.numel() * values.element_size() + mask.numel() * 4
    copies = [(values, mask)] + [(values.clone(), mask.clone()) for _ in range(kernels.copies_for(packed_bytes) - 1)]
    spmv_us = kernels.time_in_cuda_graph([lambda v=v, m=m: kernels.spmv(x, v, m) for v, m in copies])
    with kernels.pdl_l2_prefetch(0):  # the same config, launched as the probe's kernels are
        spmv_plain_us = kernels.time_in_cuda_graph([lambda v=v, m=m: kernels.spmv(x, v, m) for v, m in copies])
    packed_us = kernels.time_in_cuda_graph([lambda v=v, m=m: read(v, m, config) for v, m in copies])
    flat = [(v, m, interleave(v, m)) for v, m in copies]
    interleaved_us = kernels.time_in_cuda_graph([lambda v=v, m=m, i=i: read(v, m, config, i) for v, m, i in flat])
    no_scan_us = kernels.time_in_cuda_graph([lambda v=v, m=m: read(v, m, config, x=x) for v, m in copies])
    halved = halved_programs(config)
    split_us = halved and kernels.time_in_cuda_graph([lambda v=v, m=m: read(v, m, halved) for v, m in copies])
    del copies, flat
    weights = [weight] + [weight.clone() for _ in range(kernels.copies_for(weight.numel() * 2) - 1)]
    cublas_us = kernels.time_in_cuda_graph([lambda w=w: F.linear(x, w) for w in weights])
    return dict(shape=f"{out_features}x{in_features}", config=config, packed_mb=packed_bytes / 1e6, spmv_us=spmv_us,
                spmv_plain_us=spmv_plain_us, packed_us=packed_us, interleaved_us=interleaved_us, no_scan_us=no_scan_us,
                split_us=split_us, cublas_us=cublas_us,
                dense_tbs=weight.numel() * 2 / cublas_us / 1e6, packed_tbs=packed_bytes / packed_us / 1e6,
                interleaved_tbs=packed_bytes / interleaved_us / 1e6, spmv_tbs=packed_bytes / spmv_us / 1e6,
                spmv_plain_tbs=packed_bytes / spmv_plain_us / 1e6)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="6144x4096,4096x4096,28672x4096,4096x14336", help="OUTxIN,...")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("load_probe: needs a CUDA GPU (its kernels run on CPU only under TRITON_INTERPRET=1, in the tests)")
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    print("| shape | config (slices, words/warp, prefetch) | packed MB | SpMV µs (TB/s) "
          "| SpMV, plain launches µs (TB/s) "
          "| probe, packed µs (TB/s) | probe, interleaved µs (TB/s) | SpMV without its scan µs "
          "| probe, K split in two µs | cuBLAS dense µs (TB/s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for out_features, in_features in shapes:
        r = probe_shape(out_features, in_features)
        split = f"{r['split_us']:.1f}" if r["split_us"] else "-"
        print(f"| {r['shape']} | {r['config']} | {r['packed_mb']:.1f} | {r['spmv_us']:.1f} ({r['spmv_tbs']:.2f}) "
              f"| {r['spmv_plain_us']:.1f} ({r['spmv_plain_tbs']:.2f}) | {r['packed_us']:.1f} ({r['packed_tbs']:.2f}) "
              f"| {r['interleaved_us']:.1f} ({r['interleaved_tbs']:.2f}) "
              f"| {r['no_scan_us']:.1f} | {split} | {r['cublas_us']:.1f} ({r['dense_tbs']:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
