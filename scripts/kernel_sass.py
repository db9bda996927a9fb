"""Compile the SpMV kernel for the H100/H200 (sm_90a) on any machine, no GPU needed, and count
what matters for it: registers, spills, SASS instructions and the instruction mix.

Triton compiles to PTX for a target without a device, and the triton wheel ships ptxas and
cuobjdump, so a kernel change can be checked for spills and instruction count per kept weight
before spending device time (docs/KERNEL_NOTES.md has the budget: ~17.7 per kept weight).

    python scripts/kernel_sass.py                          # the batch 1 / 4 / 16 configs
    python scripts/kernel_sass.py --batch 1 --rows_per_thread 1 --words_per_step 4 --one_step
    python scripts/kernel_sass.py --revision bee681a       # the same configs compiled from an older sparse/kernels.py
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
SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")


def loop_length(sass: str):
    """Instructions in the innermost loop (the word loop): from a backward branch's target to it."""
    lines = [(int(m.group(1), 16), m.group(3), line) for line in sass.splitlines() if (m := SASS_LINE.match(line))]
    offsets = {address: i for i, (address, _, _) in enumerate(lines)}
    loops = []
    for i, (address, opcode, line) in enumerate(lines):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in offsets:
            loops.append(i - offsets[int(target.group(1), 16)] + 1)
    return min(loops) if loops else None


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


def compile_spmv(kernels, batch: int, rows_per_thread: int, warps: int, words_per_step: int, one_step: bool,
                 nnz_per_word: int = 16) -> dict:
    signature = {"x_ptr": "*bf16" if batch == 1 else "*i64", "values_ptr": "*bf16", "mask_ptr": "*i32",
                 "y_ptr": "*bf16", "workspace_ptr": "*fp32", "arrivals_ptr": "*i32", "n_rows": "i32",
                 "n_words": "i32", "words_per_split": "i32", "x_pair_stride": "i32"}
    constants = dict(NNZ_PER_WORD=nnz_per_word, BATCH=batch, BLOCK_ROWS=rows_per_thread * 32 * warps,
                     INTERPRETER_SAFE=False)
    parameters = kernels._spmv_kernel.arg_names
    if "WORDS_PER_STEP" in parameters:  # older revisions had one word per step, always
        constants.update(WORDS_PER_STEP=words_per_step, ONE_STEP=one_step)
    signature.update({name: "constexpr" for name in constants})
    compiled = triton.compile(ASTSource(fn=kernels._spmv_kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    folder = Path(tempfile.mkdtemp())
    (folder / "k.ptx").write_text(compiled.asm["ptx"])
    report = subprocess.run([str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", str(folder / "k.ptx"), "-o",
                             str(folder / "k.cubin")], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(folder / "k.cubin")],
                          capture_output=True, text=True, check=True).stdout
    opcodes = [m.group(3) for m in map(SASS_LINE.match, sass.splitlines()) if m]
    count = lambda *names: sum(op in names for op in opcodes)  # noqa: E731
    return dict(registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
                instructions=len(opcodes), ffma=count("FFMA"), flo=count("FLO"), loads=count("LDG"),
                shared=count("LDS", "STS"), loop=loop_length(sass),
                kept_weights=words_per_step * nnz_per_word * rows_per_thread, sass=sass)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--rows_per_thread", type=int, default=1)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--words_per_step", type=int, default=1)
    p.add_argument("--one_step", action="store_true", help="one step per program (no prefetch of a next step)")
    p.add_argument("--revision", help="compile sparse/kernels.py as of this git revision instead")
    p.add_argument("--sass_out", type=Path, help="write each config's SASS into this folder")
    args = p.parse_args()
    kernels = kernels_module(args.revision)
    print(f"{'batch':>5} {'regs':>5} {'spill B':>7} {'instr':>6} {'FFMA':>5} {'FLO':>4} {'LDG':>4} {'LDS/STS':>7}"
          f" {'loop':>5} {'per kept weight':>16}")
    for batch in args.batch:
        r = compile_spmv(kernels, batch, args.rows_per_thread, args.warps, args.words_per_step, args.one_step)
        print(f"{batch:5d} {r['registers']:5d} {r['spill_bytes']:7d} {r['instructions']:6d} {r['ffma']:5d} "
              f"{r['flo']:4d} {r['loads']:4d} {r['shared']:7d} {r['loop'] or '-':>5} "
              f"{(r['loop'] or r['instructions']) / r['kept_weights']:16.1f}")
        if args.sass_out:
            args.sass_out.mkdir(parents=True, exist_ok=True)
            (args.sass_out / f"spmv_b{batch}.sass").write_text(r["sass"])
    print("per kept weight = the word loop's instructions / the kept weights one trip multiplies (with one step per "
          "program there is no loop: the whole kernel, prologue and split-K epilogue included)", file=sys.stderr)


if __name__ == "__main__":
    main()
