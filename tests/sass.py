"""Compile the Triton kernels for the H100/H200 (sm_90a) on the CPU and read their machine code.

Triton compiles to PTX for a target without a device, and its wheel ships ptxas and cuobjdump, so
the kernels' tests check properties of their SASS (spills, vectorized loads, instructions per kept
weight) without a GPU. `Sm90StandIn` answers the JIT's driver questions for an
sm_90 GPU, so that launchers' compile_only calls compile real cubins on the CPU too.
"""
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse.kernels import decode_attention, mma_sp, spmm, spmv

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")


class Sm90StandIn:
    """What Triton's JIT asks its driver before a compile, answered for an sm_90 GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


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


def opcodes(sass: str) -> list:
    return [m.group(3) for line in sass.splitlines() if (m := SASS_LINE.match(line))]


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
    """(opcode, line) of the shortest loop that holds a `marker` instruction (SHFL: the SpMV's word
    loop; HGMMA: the SpMM's K loop)."""
    return min(loops_with(sass, marker), key=len, default=[])


def load_use_distances(loop, marker: str, load_kind: str = ""):
    """For each global load of a loop ((opcode, line) in program order, run again and again) whose
    opcode holds `load_kind`, how many `marker` instructions issue between it and the first
    instruction that reads a register it wrote: how far ahead the loop loads."""
    parsed = []
    for opcode, line in loop:
        opcode, operands = re.search(rf"\b({opcode}\S*)(.*?);", line).groups()  # e.g. LDG.E.64.STRONG.GPU
        width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
        parsed.append((opcode, [int(r) for r in re.findall(r"\bR(\d+)\b", operands)], width))
    distances = []
    for i, (opcode, registers, width) in enumerate(parsed):
        if not opcode.startswith("LDG") or load_kind not in opcode or not registers:
            continue
        written = set(range(registers[0], registers[0] + width))
        markers = 0
        for step in range(1, len(parsed) + 1):
            later, later_registers, _ = parsed[(i + step) % len(parsed)]
            # an MMA reads register ranges (A: 4, B: 2 or 4, C: 4) from their first ones, counted as 4;
            # a sparse one's last operand is its metadata, one register
            ranges = later_registers[1:-1] if ".SP." in later else later_registers[1:]
            reads = set(later_registers[1:]) if not later.startswith(marker) else \
                {r + k for r in ranges for k in range(4)} | set(later_registers[-1:])
            if written & reads:
                break
            markers += later.startswith(marker)
        distances.append(markers)
    return distances


def spmv_kernel(batch: int, slices: int, prefetch: int, nnz_per_word: int = 16, dtype: str = "bf16",
                even_k: bool = True, variant: str = "plain", packed_x: bool = False) -> dict:
    """The SpMV's kernel for sm_90a, and counts of its word loop (one mask word of one row per
    thread: per kept weight = loop / nnz_per_word). variant: "plain", "norm" (the RMSNorm prologue)
    or "gated" (silu(gate) * up and the residual); packed_x: two rows of x to a register."""
    types = {"x_ptr": f"*{dtype}", "values_ptr": f"*{dtype}", "mask_ptr": "*i32", "y_ptr": f"*{dtype}",
             "workspace_ptr": "*fp32", "arrivals_ptr": "*i32", "norm_ptr": f"*{dtype}", "residual_ptr": f"*{dtype}",
             "norm_eps": "fp32"}
    constants = dict(NNZ=nnz_per_word, CHUNK=min(8, nnz_per_word), BATCH=batch, SLICES=slices, PREFETCH=prefetch,
                     EVEN_K=even_k, NORM=variant == "norm", RESIDUAL=variant == "gated", GATED=variant == "gated",
                     PACKED_X=packed_x, INTERPRETER_SAFE=False)
    sass, registers, spill_bytes, _ = compile_for_sm90a(spmv.spmv_kernel, types, constants, slices)
    loop = [op.split(".")[0] for op, _ in innermost_loop(sass)]
    return dict(registers=registers, spill_bytes=spill_bytes, loop=len(loop), ffma=loop.count("FFMA"),
                flo=loop.count("FLO"), shfl=loop.count("SHFL"), mufu=loop.count("MUFU"), loads=loop.count("LDG"),
                shared=sum(loop.count(op) for op in ("LDS", "STS", "BAR")), kept_weights=nnz_per_word, sass=sass)


def spmm_kernel(two_of_four: bool, block_out: int = 128, words: int = 2, num_warps: int = 4) -> dict:
    """The SpMM's kernel for sm_90a (bf16, 16 kept a word, one 16-row tile of x), expanding by gather
    or, two_of_four, by nibble: registers, spills, the K loop's instructions, those per kept weight
    and its instruction mix."""
    pointers = dict(x_ptr="*bf16", values_ptr="*bf16", mask_ptr="*i32", y_ptr="*bf16", workspace_ptr="*fp32",
                    arrivals_ptr="*i32")
    constants = dict(NNZ=16, CHUNK=8, BLOCK_OUT=block_out, BLOCK_TOKENS=spmm.MMA_TOKENS, WORDS=words,
                     TWO_OF_FOUR=two_of_four, INTERPRETER_SAFE=False)
    sass, registers, spill_bytes, shared = compile_for_sm90a(spmm.spmm_kernel, pointers, constants, num_warps,
                                                             divisible_by_16=[*pointers, "n_rows", "n_words"])
    loop = [op.split(".")[0] for op, _ in innermost_loop(sass, marker="HGMMA")]
    kept_per_thread = words * 16 * block_out / (32 * num_warps)
    return dict(registers=registers, spill_bytes=spill_bytes, shared_bytes=shared, loop=len(loop),
                per_kept_weight=len(loop) / kept_per_thread, mix={op: loop.count(op) for op in set(loop)}, sass=sass)


def mma_sp_kernel(batch: int, slices: int = 4, unroll: int = 2, tiles: int = 1, ahead: int = 1, norm: bool = False,
                  gated: bool = False, x_fragments: bool = False) -> dict:
    """The sparse tensor cores' kernel for sm_90a (bf16 x of `batch` rows): registers, spills, the
    word loop's instructions per word and per kept weight (16 rows x 16 kept values a tile), the
    loads a word, the barriers, and how many words after its load each streamed weight load
    (LDG...STRONG.GPU) is first read (`words_to_first_use`: min and max). x_fragments: x given in
    `mma_sp.fragment_order`."""
    pointers = dict(x_ptr="*bf16", values_ptr="*bf16", mask_ptr="*i32", y_ptr="*bf16", residual_ptr="*bf16",
                    norm_ptr="*bf16")
    constants = dict(SLICES=slices, M_TILES=tiles, N_BLOCKS=triton.cdiv(batch, 8), EVEN_K=True, UNROLL=unroll,
                     PREFETCH=ahead, NORM=norm, GATED=gated, RESIDUAL=False, INTERPRETER_SAFE=False,
                     X_FRAG=x_fragments)
    sass, registers, spill_bytes, shared = compile_for_sm90a(mma_sp.mma_sp_kernel, {**pointers, "norm_eps": "fp32"},
                                                             constants, slices,
                                                             divisible_by_16=[*pointers, "n_rows", "n_words"])
    # The main word loop: the one with the most sparse MMAs (an unrolled loop leaves a shorter
    # remainder loop beside it).
    loop = max(loops_with(sass, "HMMA"), key=lambda loop: sum(".SP." in text for _, text in loop))
    mmas_a_word = constants["N_BLOCKS"] * tiles
    words = sum(".SP." in text for _, text in loop) // mmas_a_word
    distances = load_use_distances(loop, "HMMA", "STRONG.GPU")
    return dict(registers=registers, spill_bytes=spill_bytes, shared_bytes=shared, words_in_loop=words,
                barriers=sass.count("BAR.SYNC"), per_kept_weight=len(loop) / words * 32 / (16 * 16 * tiles),
                loads_per_word=sum(op.startswith("LDG") for op, _ in loop) / words,
                words_to_first_use=(min(distances) / mmas_a_word, max(distances) / mmas_a_word), sass=sass)


def partial_attention_kernel(group_size: int = 4, head_dim: int = 128, splits: int = 32, stages: int = 1,
                             qk_norm: bool = False) -> dict:
    """The decode attention's kernel for sm_90a (bf16, Llama-3.1-8B's GQA group of 4 by default),
    its block loop plain or software-pipelined over `stages`: registers, spills, shared memory, the
    slot loop's instructions and its asynchronous copies (LDGSTS)."""
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", acc_ptr="*fp32", stats_ptr="*fp32",
                 new_k_ptr="*bf16", new_v_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", left_pad_ptr="*i64",
                 write_slot_ptr="*i64", out_ptr="*bf16", arrivals_ptr="*i32", scale="fp32", q_norm_ptr="*bf16",
                 k_norm_ptr="*bf16", norm_eps="fp32")
    constants = dict(GROUP_SIZE=group_size, GROUP=max(16, triton.next_power_of_2(group_size)), HEAD_DIM=head_dim,
                     BLOCK=decode_attention.BLOCK_SLOTS, QK_NORM=qk_norm, STAGES=stages, IEEE=False,
                     INTERPRETER_SAFE=False)
    constants.update(zip(("MERGE_HEADS", "SPLITS", "MERGE_CHUNK"), decode_attention.merge_tiling(group_size, splits)))
    kernel = decode_attention.partial_attention_kernel
    # What the JIT sees on Llama's shapes: aligned buffers, strides and slot counts in multiples of 16.
    aligned = [name for name in kernel.arg_names
               if name.endswith(("_ptr", "stride_b", "stride_h", "stride_s")) or name in ("n_slots", "slots_per_split")]
    sass, registers, spill_bytes, shared = compile_for_sm90a(kernel, types, constants, 4, aligned)
    loop = [op for op, _ in innermost_loop(sass)]
    return dict(registers=registers, spill_bytes=spill_bytes, shared_bytes=shared, loop=len(loop),
                async_copies_in_loop=sum(op.startswith("LDGSTS") for op in loop), sass=sass)
