"""Compile the SpMV kernel for the H100/H200 (sm_90a) on any machine, no GPU needed, and count
what matters for it: registers, spills, SASS instructions and the instruction mix.

Triton compiles to PTX for a target without a device, and the triton wheel ships ptxas and
cuobjdump, so a kernel change can be checked for spills and instruction count per kept weight
before spending device time (docs/KERNEL_NOTES.md has the budget: ~17.7 per kept weight).

    python scripts/kernel_sass.py                          # batch 1 / 4 / 16, 4 slices, prefetch 2
    python scripts/kernel_sass.py --batch 1 --slices 8 --prefetch 1 --sass_out runs/sass
    python scripts/kernel_sass.py --revision bee681a       # the same configs compiled from an older sparse/kernels.py
                                                           # (of the same kernel signature)
    python scripts/kernel_sass.py --attention              # decode_attention's partial kernel, with and
                                                           # without RoPE and the cache write inside, and
                                                           # the splits' merge (--stages 1 2: plain and
                                                           # pipelined block loop)
"""
import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")


def loops_with(sass: str, marker: str):
    """Every loop of the SASS (the span from a backward branch's target to the branch) that holds a
    `marker` instruction, each as (opcode, line) in program order."""
    lines = [(int(m.group(1), 16), m.group(3), line) for line in sass.splitlines() if (m := SASS_LINE.match(line))]
    offsets = {address: i for i, (address, _, _) in enumerate(lines)}
    loops = []
    for i, (address, opcode, line) in enumerate(lines):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in offsets:
            loops.append(lines[offsets[int(target.group(1), 16)]:i + 1])
    return [[(op, text) for _, op, text in loop] for loop in loops if any(op.startswith(marker) for _, op, _ in loop)]


def innermost_loop(sass: str, marker: str = "SHFL"):
    """(opcode, line) of the word loop's instructions, in program order: the shortest loop that holds
    a `marker` instruction (SHFL: the SpMV's loop shuffles x, the fused variant's sum-of-squares loop
    does not; HGMMA: the SpMM's K loop, wgmma on sm_90)."""
    return min(loops_with(sass, marker), key=len, default=[])


def kernels_module(revision: str = None):
    """sparse/kernels.py of the working tree, or as it was at a git revision."""
    path = ROOT / "sparse" / "kernels.py"
    if revision:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:sparse/kernels.py"],
                                capture_output=True, text=True, check=True).stdout
        path = Path(tempfile.mkdtemp()) / "kernels.py"
        path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"kernels_{revision or 'tree'}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_for_sm90a(kernel, types: dict, constants: dict, num_warps: int, divisible_by_16=()):
    """(SASS text, registers, spill bytes, shared-memory bytes a program) of a @triton.jit kernel
    compiled for sm_90a; types: the Triton type of each argument that is not an i32 ("*bf16",
    "fp32", ...), constants: the constexpr arguments' values; divisible_by_16: the arguments the
    JIT would specialize as multiples of 16 at run time (aligned pointers, shapes like 4096), which
    lets the compiler vectorize loads as it does on the GPU."""
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    folder = Path(tempfile.mkdtemp())
    (folder / "k.ptx").write_text(compiled.asm["ptx"])
    report = subprocess.run([str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", str(folder / "k.ptx"), "-o",
                             str(folder / "k.cubin")], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(folder / "k.cubin")],
                          capture_output=True, text=True, check=True).stdout
    return (sass, int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)), compiled.metadata.shared)


def compile_partial_attention(rope_and_write: bool, group_size: int = 4, head_dim: int = 128, merge: bool = False,
                              splits: int = 32, v_with_k: bool = False, stages: int = 1, qk_norm: bool = False,
                              pdl: bool = False) -> dict:
    """decode_attention's partial kernel for sm_90a (bf16, Llama-3.1-8B's GQA group of 4 by
    default), with or without RoPE and the cache write (and Qwen3's q/k norms: qk_norm), with or
    without the merge of `splits` splits in the last program, its block loop plain or
    software-pipelined over `stages`: registers, spills, shared memory, all instructions and the
    slot loop's."""
    sys.path.insert(0, str(ROOT))
    import decode_attention
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", keep_ptr="*i1", acc_ptr="*fp32", stats_ptr="*fp32",
                 new_k_ptr="*bf16", new_v_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", left_pad_ptr="*i64",
                 write_slot_ptr="*i64", out_ptr="*bf16", arrivals_ptr="*i32", scale="fp32", q_norm_ptr="*bf16",
                 k_norm_ptr="*bf16", norm_eps="fp32")
    constants = dict(GROUP_SIZE=group_size, GROUP=max(16, triton.next_power_of_2(group_size)), HEAD_DIM=head_dim,
                     BLOCK=decode_attention.BLOCK_SLOTS, ROPE_AND_WRITE=rope_and_write, QK_NORM=qk_norm, MERGE=merge,
                     V_WITH_K=v_with_k, STAGES=stages, IEEE=False, PDL=pdl, INTERPRETER_SAFE=False)
    constants.update(zip(("MERGE_HEADS", "SPLITS", "MERGE_CHUNK"), decode_attention.merge_tiling(group_size, splits,
                                                                                               merge)))
    # What the JIT sees on Llama's shapes: aligned buffers, strides and slot counts in multiples of 16.
    aligned = [name for name in decode_attention._partial_attention_kernel.arg_names
               if name.endswith(("_ptr", "stride_b", "stride_h", "stride_s")) or name in ("n_slots", "slots_per_split")]
    sass, registers, spill_bytes, shared = compile_for_sm90a(decode_attention._partial_attention_kernel, types,
                                                             constants, num_warps=4, divisible_by_16=aligned)
    loop = [op for op, _ in innermost_loop(sass)]
    # Where the slot loop's loads sit (fraction of the loop), and its CTA barriers: K's loads come
    # first, V's either with them (V_WITH_K) or behind the softmax's cross-warp reductions. LDGSTS:
    # the asynchronous copies global -> shared memory a pipelined loop issues for later blocks.
    return dict(registers=registers, spill_bytes=spill_bytes, shared_bytes=shared,
                instructions=len(SASS_LINE.findall(sass)), loop=len(loop), loads=sass.count("LDG"),
                async_copies_in_loop=sum(op.startswith("LDGSTS") for op in loop),
                barriers_in_loop=sum(op.startswith("BAR") for op in loop),
                loop_loads_at=[round(i / len(loop), 2) for i, op in enumerate(loop) if op.startswith("LDG")], sass=sass)


def compile_spmm(two_of_four: bool, block_out: int = 128, words: int = 2, num_warps: int = 4,
                 block_tokens: int = 16, prefetch_pairs: bool = False, stages: int = 1) -> dict:
    """sparse/spmm.py's kernel for sm_90a (bf16, 16 kept a word; one 16-token tile = a decode
    batch, 64 = the prefill's tile), expanding by gather or, two_of_four, by nibble: registers,
    spills, the K loop's instructions and those per kept weight (the loop walks `words` mask words
    of block_out rows)."""
    sys.path.insert(0, str(ROOT))
    from sparse import spmm
    pointers = dict(x_ptr="*bf16", values_ptr="*bf16", mask_ptr="*i32", y_ptr="*bf16", workspace_ptr="*fp32",
                    arrivals_ptr="*i32")
    constants = dict(NNZ=16, CHUNK=8, BLOCK_OUT=block_out, BLOCK_TOKENS=block_tokens, WORDS=words,
                     TWO_OF_FOUR=two_of_four, PREFETCH_PAIRS=two_of_four and prefetch_pairs, INTERPRETER_SAFE=False,
                     STAGES=stages)
    sass, registers, spill_bytes, shared = compile_for_sm90a(spmm._spmm_kernel, pointers, constants, num_warps,
                                                             divisible_by_16=[*pointers, "n_rows", "n_words"])
    loop = [op.split(".")[0] for op, _ in innermost_loop(sass, marker="HGMMA")]
    kept_per_thread = words * 16 * block_out / (32 * num_warps)
    mix = {op: loop.count(op) for op in sorted(set(loop), key=loop.count, reverse=True)}
    return dict(registers=registers, spill_bytes=spill_bytes, shared_bytes=shared, loop=len(loop),
                per_kept_weight=len(loop) / kept_per_thread, mix=mix, sass=sass)


def compile_mma_sp(batch: int, slices: int = 4, unroll: int = 2, tiles: int = 1, ahead: int = 1,
                   norm: bool = False, gated: bool = False, pdl: bool = False) -> dict:
    """sparse/mma_sp.py's kernel for sm_90a (bf16 x of `batch` rows, 2:4): registers, spills, the word
    loop's instructions and those per kept weight (a warp's word: 16 rows x 16 kept values a tile),
    the loads a word, the barriers (all in the warps' final sum), and how many words after its load
    each weight register is first read
    (`words_to_first_use`: min and max over the loop's weight loads, the streamed `ld.global.cg`,
    LDG...STRONG.GPU in SASS); the word loop unrolled `unroll` times, `tiles` 16-row tiles a warp,
    `ahead` words' loads in flight; `norm`: the RMSNorm fused (x times the norm weight before the
    instruction, its squares summed); `gated`: silu(gate) * up fused."""
    sys.path.insert(0, str(ROOT))
    from sparse import mma_sp
    pointers = dict(x_ptr="*bf16", values_ptr="*bf16", mask_ptr="*i32", y_ptr="*bf16", residual_ptr="*bf16",
                    norm_ptr="*bf16")
    constants = dict(SLICES=slices, M_TILES=tiles, N_BLOCKS=triton.cdiv(batch, 8), EVEN_K=True, UNROLL=unroll,
                     PREFETCH=ahead, NORM=norm, GATED=gated, RESIDUAL=False, PDL=pdl, INTERPRETER_SAFE=False)
    for name in ("PREFETCH", "NORM", "GATED", "norm_ptr", "PDL"):  # before session 24: one word ahead, no prologue
        if name not in mma_sp._mma_sp_kernel.arg_names:
            constants.pop(name, None)
            pointers.pop(name, None)
    sass, registers, spill_bytes, shared = compile_for_sm90a(mma_sp._mma_sp_kernel, {**pointers, "norm_eps": "fp32"},
                                                             constants, slices,
                                                             divisible_by_16=[*pointers, "n_rows", "n_words"])
    # The main word loop: the one with the most sparse MMAs (an unrolled loop leaves a shorter
    # remainder loop beside it); its instructions per word and per kept weight (16 rows x 16 kept).
    loop = max(loops_with(sass, "HMMA"), key=lambda loop: sum(".SP." in text for _, text in loop))
    words = sum(".SP." in text for _, text in loop) // (constants["N_BLOCKS"] * tiles)
    distances = load_use_distances(loop, "HMMA", "STRONG.GPU")
    per_word_mmas = constants["N_BLOCKS"] * tiles
    return dict(registers=registers, spill_bytes=spill_bytes, shared_bytes=shared, words_in_loop=words,
                barriers=sass.count("BAR.SYNC"),
                per_word=len(loop) / words, per_kept_weight=len(loop) / words * 32 / (16 * 16 * tiles),
                loads_per_word=sum(op.startswith("LDG") for op, _ in loop) / words,
                words_to_first_use=(min(distances) / per_word_mmas, max(distances) / per_word_mmas), sass=sass)


def load_use_distances(loop, marker: str, load_kind: str = ""):
    """For each global load of a loop ((opcode, line) in program order, run again and again) whose
    opcode holds `load_kind`, how many `marker` instructions (a sparse MMA: one a word and tile)
    issue between it and the first instruction that reads a register it wrote: how far ahead the
    loop loads."""
    parsed = []
    for opcode, line in loop:
        opcode, operands = re.search(rf"\b({opcode}\S*)(.*?);", line).groups()  # e.g. LDG.E.64.STRONG.GPU
        width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
        registers = [int(r) for r in re.findall(r"\bR(\d+)\b", operands)]
        parsed.append((opcode, registers, width))
    distances = []
    for i, (opcode, registers, width) in enumerate(parsed):
        if not opcode.startswith("LDG") or load_kind not in opcode or not registers:
            continue
        written = set(range(registers[0], registers[0] + width))
        markers = 0
        for step in range(1, len(parsed) + 1):
            later, later_registers, _ = parsed[(i + step) % len(parsed)]
            # an MMA reads register ranges (A: 4, B: 2 or 4, C: 4) from its first ones; count them all
            reads = set(later_registers[1:]) if not later.startswith(marker) else \
                {r + k for r in later_registers[1:] for k in range(4)}
            if written & reads:
                break
            markers += later.startswith(marker)
        distances.append(markers)
    return distances


def compile_spmv(kernels, batch: int, slices: int, prefetch: int, nnz_per_word: int = 16,
                 dtype: str = "bf16", even_k: bool = True, variant: str = "plain", packed_x: bool = False,
                 pdl: bool = False) -> dict:
    """Compile the SpMV for sm_90a and count its machine code; one loop trip = one mask word of
    one row per thread, so per kept weight = loop instructions / nnz_per_word. variant: "plain",
    "norm" (the RMSNorm prologue: what wqkv and w13 run in a decode step) or "gated" (silu(gate) *
    up and the residual: w2); packed_x: two rows of x to a register (bf16 pairs, kernels.packs_x)."""
    types = {"x_ptr": f"*{dtype}", "values_ptr": f"*{dtype}", "mask_ptr": "*i32", "y_ptr": f"*{dtype}",
             "workspace_ptr": "*fp32", "arrivals_ptr": "*i32", "norm_ptr": f"*{dtype}", "residual_ptr": f"*{dtype}",
             "norm_eps": "fp32"}
    constants = dict(NNZ=nnz_per_word, CHUNK=min(8, nnz_per_word), BATCH=batch, SLICES=slices, PREFETCH=prefetch,
                     EVEN_K=even_k, NORM=variant == "norm", RESIDUAL=variant == "gated",
                     GATED=variant == "gated", PACKED_X=packed_x, PDL=pdl, INTERPRETER_SAFE=False)
    # The constants this revision's kernel has (older ones lack the fused operands).
    constants = {name: value for name, value in constants.items() if name in kernels._spmv_kernel.arg_names}
    sass, registers, spill_bytes, _ = compile_for_sm90a(kernels._spmv_kernel, types, constants, slices)
    loop = innermost_loop(sass)
    count = lambda ops, *names: sum(op.split(".")[0] in names for op in ops)  # noqa: E731
    loop_ops = [op for op, _ in loop]
    loads = [i for i, op in enumerate(loop_ops) if op == "LDG"]
    return dict(registers=registers, spill_bytes=spill_bytes,
                loop=len(loop) or None, ffma=count(loop_ops, "FFMA"), flo=count(loop_ops, "FLO"),
                shfl=count(loop_ops, "SHFL"), mufu=count(loop_ops, "MUFU"), loads=len(loads),
                shared=count(loop_ops, "LDS", "STS", "BAR"),
                last_load_at=(max(loads) / len(loop)) if loads else None,
                kept_weights=nnz_per_word, sass=sass)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--slices", type=int, default=4, help="warps per program (each a slice of K)")
    p.add_argument("--prefetch", type=int, default=2, help="words loaded ahead of the one multiplied (1 or 2)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--variant", default="plain", choices=["plain", "norm", "gated"],
                   help="norm: with the RMSNorm prologue (wqkv, w13); gated: silu(gate) * up and the residual (w2)")
    p.add_argument("--revision", help="compile sparse/kernels.py as of this git revision instead")
    p.add_argument("--sass_out", type=Path, help="write each config's SASS into this folder")
    p.add_argument("--attention", action="store_true", help="decode_attention's partial kernel instead")
    p.add_argument("--spmm", action="store_true", help="the tensor-core SpMM's K loop (2:4 by nibble, and by gather)")
    p.add_argument("--stages", type=int, nargs="*", default=[1],
                   help="with --attention: the block loop's pipeline stages (decode_attention.PIPELINE_STAGES); "
                        "with --spmm: the K loop's (1: pipelined by hand; spmm.DECODE_STAGES)")
    args = p.parse_args()
    if args.spmm:
        for two_of_four in (True, False):
            for stages in args.stages:
                r = compile_spmm(two_of_four, stages=stages)
                print(f"{'2:4 by nibble' if two_of_four else 'by gather':13} stages {stages}: {r['registers']} registers, "
                      f"{r['spill_bytes']} B spilled, {r['shared_bytes']} B shared, loop {r['loop']} "
                      f"({r['per_kept_weight']:.2f} a kept weight), LDG {r['mix'].get('LDG', 0)}, "
                      f"LDGSTS {r['mix'].get('LDGSTS', 0)}")
        return
    if args.attention:
        for rope_and_write in (False, True):
            for merge in (False, True):
                for v_with_k in (False, True):
                    for stages in args.stages:
                        print(f"RoPE and cache write {rope_and_write!s:5}, merge in the last split {merge!s:5}, "
                              f"V loaded with K {v_with_k!s:5}, stages {stages}:",
                              compile_partial_attention(rope_and_write, merge=merge, v_with_k=v_with_k, stages=stages))
        return
    kernels = kernels_module(args.revision)
    print(f"{'batch':>5} {'regs':>5} {'spill B':>7} {'loop':>5} {'FFMA':>5} {'FLO':>4} {'SHFL':>4} {'LDG':>4} "
          f"{'LDS/STS/BAR':>11} {'last LDG at':>11} {'per kept weight':>16}")
    for batch in args.batch:
        r = compile_spmv(kernels, batch, args.slices, args.prefetch, dtype=args.dtype, variant=args.variant)
        last = f"{r['last_load_at']:.0%}" if r["last_load_at"] is not None else "-"
        print(f"{batch:5d} {r['registers']:5d} {r['spill_bytes']:7d} {r['loop'] or '-':>5} {r['ffma']:5d} "
              f"{r['flo']:4d} {r['shfl']:4d} {r['loads']:4d} {r['shared']:11d} {last:>11} "
              f"{(r['loop'] or 0) / r['kept_weights']:16.1f}")
        if args.sass_out:
            args.sass_out.mkdir(parents=True, exist_ok=True)
            (args.sass_out / f"spmv_b{batch}.sass").write_text(r["sass"])
    print("loop = the word loop's instructions (one mask word of one row per thread); 'last LDG at' = where the "
          "loop's last load sits, as a fraction of the loop (early = the prefetch is issued before the FMAs)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
