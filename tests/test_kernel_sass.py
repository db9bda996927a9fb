"""scripts/kernel_sass.py: the SpMV compiles for sm_90a without a GPU, and the properties the
kernel's design rests on hold in its machine code (docs/KERNEL_NOTES.md)."""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import kernel_sass  # noqa: E402


def test_batch_one_spmv_machine_code():
    report = kernel_sass.compile_spmv(kernel_sass.kernels_module(), batch=1, slices=4, prefetch=2)
    assert report["spill_bytes"] == 0
    # Per kept weight one bit scan (FLO), one shuffle of x and one FMA: 16 of each per word walked.
    assert report["ffma"] == 16 and report["flo"] == 16 and report["shfl"] == 16
    # A word's loads: the mask, two 16-byte value loads and x. No shared memory inside the loop
    # (a layout conversion there would mean a barrier per word).
    assert report["loads"] == 4 and report["shared"] == 0
    assert report["loop"] / report["kept_weights"] < 10  # the issue budget is ~17.7 per kept weight


def test_fused_prologues_cost_one_load_per_word():
    # The RMSNorm prologue (wqkv, w13) adds the norm weight's load, a multiply and the square of x
    # for 1/rms (one FFMA) per word; silu(gate) * up (w2) the up load and h + h * tanh(h) with one
    # MUFU op: per word, not per kept weight, so the loop stays well under the issue budget.
    for variant in ("norm", "gated"):
        report = kernel_sass.compile_spmv(kernel_sass.kernels_module(), batch=1, slices=4, prefetch=2,
                                          variant=variant)
        assert report["spill_bytes"] == 0, variant
        assert report["ffma"] == 17 and report["flo"] == 16 and report["shfl"] == 16, variant
        assert report["mufu"] == (1 if variant == "gated" else 0), variant
        assert report["loads"] == 5 and report["shared"] == 0, variant
        assert report["loop"] / report["kept_weights"] < 10, variant


def pdl_opcodes(sass: str, case, reads=("LDG", "ATOM", "RED")) -> list:
    """The opcodes of a programmatic dependent launch's SASS, after checking its contract: the L2
    prefetch (CCTL.E.PF2) before the wait (ACQBULK), no `reads` before it, and the next launch let
    start (PREEXIT) only after it."""
    opcodes = [m.group(3) for line in sass.splitlines() if (m := kernel_sass.SASS_LINE.match(line))]
    wait = opcodes.index("ACQBULK")
    assert "CCTL.E.PF2" in sass.split("ACQBULK")[0] and opcodes.index("PREEXIT") > wait, case
    assert not [op for op in opcodes[:wait] if op.startswith(reads)], case
    return opcodes


def test_spmv_with_pdl_reads_nothing_before_its_wait():
    # Launched as a programmatic dependent launch, the SpMV runs while the previous kernel drains:
    # it may prefetch its weights into the L2 (CCTL.E.PF2) before the wait (ACQBULK), but every
    # load (x, the norm weight, the residual, the weights themselves) and atomic (the split-K
    # workspace) must follow it, and the next launch is let start (PREEXIT) only after it. x's
    # loads are pure inline PTX, which the compiler may move: checked on every variant.
    kernels = kernel_sass.kernels_module()
    for batch, variant, packed_x in ((1, "plain", False), (1, "norm", False), (1, "gated", False),
                                     (4, "plain", True), (8, "gated", True)):
        sass = kernel_sass.compile_spmv(kernels, batch=batch, slices=8, prefetch=2, variant=variant,
                                        packed_x=packed_x, pdl=True)["sass"]
        assert pdl_opcodes(sass, (batch, variant)).count("ACQBULK") == 1, (batch, variant)
    plain = kernel_sass.compile_spmv(kernels, batch=1, slices=8, prefetch=2)["sass"]
    assert "ACQBULK" not in plain and "CCTL.E.PF2" not in plain


def test_tensor_core_product_with_pdl_reads_nothing_before_its_wait():
    # The same contract for sparse/mma_sp.py, whose words-ahead ring must stay as it was.
    for batch, tiles, norm in ((1, 1, False), (1, 1, True), (8, 2, False)):
        report = kernel_sass.compile_mma_sp(batch, slices=4, unroll=4, tiles=tiles, ahead=4, norm=norm, pdl=True)
        pdl_opcodes(report["sass"], (batch, tiles, norm))
        assert report["spill_bytes"] == 0 and report["words_to_first_use"][0] >= 3.5, (batch, tiles, norm)


def test_decode_attention_with_pdl_reads_nothing_before_its_wait():
    # Launched as a programmatic dependent launch after q, k, v's projection, the attention may
    # prefetch its split's cache into the L2 before the wait (a hint), but reads (or writes)
    # q, the new k and v, the window and the cache only after it; then it lets the o projection's
    # SpMV start (PREEXIT), which prefetches its weights while the attention runs.
    for merge, stages in ((True, 2), (False, 1)):
        sass = kernel_sass.compile_partial_attention(True, merge=merge, stages=stages, pdl=True)["sass"]
        pdl_opcodes(sass, (merge, stages), reads=("LDG", "ATOM", "RED", "STG"))
    assert "ACQBULK" not in kernel_sass.compile_partial_attention(True, merge=True)["sass"]


def test_residual_is_loaded_before_the_split_k_arrival():
    # The residual (o and w2 at batch 1) is read by every program before it adds its partial sums
    # and counts its arrival, not by the last program after them: its L2 round trip overlaps the
    # partial sums' instead of following the arrival's and the exchange's.
    instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([^;]*);", kernel_sass.compile_spmv(
        kernel_sass.kernels_module(), batch=1, slices=4, prefetch=2, variant="gated")["sass"])
    residual_load = next(i for i, text in enumerate(instructions) if text.startswith("LDG.E.U16 "))  # not x's .SM
    arrival = next(i for i, text in enumerate(instructions) if text.startswith("ATOMG"))
    assert residual_load < arrival, (residual_load, arrival)


def test_packed_x_halves_the_shuffles():
    # At 8 rows of x, one shuffle per kept weight serves two rows (bf16 pairs in one register):
    # 64 shuffles per word instead of 128, the 128 FMAs unchanged, no shared memory in the loop.
    for packed_x, shuffles in ((False, 128), (True, 64)):
        report = kernel_sass.compile_spmv(kernel_sass.kernels_module(), batch=8, slices=4, prefetch=1,
                                          packed_x=packed_x)
        assert report["spill_bytes"] == 0 and report["shared"] == 0, packed_x
        assert report["shfl"] == shuffles and report["ffma"] == 128 and report["flo"] == 16, packed_x


def test_rope_cache_write_and_merge_leave_the_attention_loop_alone():
    # RoPE and the store run once a program, before the slot loop, and the merge once, after it:
    # the loop must not grow by more than a few instructions (substituting the new slot
    # inside the loop once grew it by 45 %), and the registers must allow two programs an SM.
    plain = kernel_sass.compile_partial_attention(False)
    for rope_and_write, merge in [(True, False), (False, True), (True, True)]:
        fused = kernel_sass.compile_partial_attention(rope_and_write, merge=merge)
        assert fused["spill_bytes"] == 0 and fused["loop"] <= 1.03 * plain["loop"], fused
        assert fused["registers"] <= 2 ** 16 // (2 * 128), fused


def test_v_loaded_with_k_moves_every_slot_load_before_the_softmax():
    # LOAD_V_WITH_K: the loop's last load before its middle (behind the softmax's reductions at
    # ~80 % otherwise; 0.41 since the decode step's kept window is computed, not loaded, which
    # took the mask's loads out of the loop's first fifth), no spills, registers for three programs
    # of 128 threads an SM.
    after, together = (kernel_sass.compile_partial_attention(True, merge=True, v_with_k=v) for v in (False, True))
    assert max(after["loop_loads_at"]) > 0.6 and max(together["loop_loads_at"]) < 0.5, (after, together)
    assert together["spill_bytes"] == 0 and together["registers"] <= 2 ** 16 // (3 * 128), together


def test_pipelined_attention_loop_copies_the_next_blocks_asynchronously():
    # PIPELINE_STAGES 2: the pipeliner must take the K and V loads (cp.async, LDGSTS, straight to
    # shared memory; the plain loop has none) without spills or more registers than the plain loop,
    # in shared memory that leaves three programs an SM (228 KB).
    plain, pipelined = (kernel_sass.compile_partial_attention(True, merge=True, stages=s) for s in (1, 2))
    assert plain["async_copies_in_loop"] == 0 and pipelined["async_copies_in_loop"] > 0, (plain, pipelined)
    assert pipelined["spill_bytes"] == 0 and pipelined["registers"] <= plain["registers"], pipelined
    assert 3 * pipelined["shared_bytes"] <= 228 * 1024, pipelined


def test_2of4_prefetched_pairs_stay_in_budget():
    # PREFETCH_2OF4_PAIRS holds a step's pairs across the loop's back edge: no spills, registers
    # for four programs of 128 threads an SM (as without), instructions as without.
    plain, prefetched = (kernel_sass.compile_spmm(True, prefetch_pairs=p) for p in (False, True))
    assert prefetched["spill_bytes"] == 0 and prefetched["registers"] <= 2 ** 16 // (4 * 128), prefetched
    assert prefetched["per_kept_weight"] <= 1.05 * plain["per_kept_weight"], (plain, prefetched)


def test_pipelined_2of4_spmm_copies_every_load_ahead():
    # STAGES 3 (the Triton-pipelined K loop; out of the tuner's candidates since session 21, see
    # spmm.DECODE_STAGES, but `spmm(config=...)` runs it): Triton's pipeliner must take all of the
    # 2:4 K loop's loads (mask words, value pairs, x) into asynchronous copies, within the issue
    # budget (17.7 a kept weight), without spills, and in shared memory for four programs an SM.
    hand, pipelined = (kernel_sass.compile_spmm(True, stages=s) for s in (1, 3))
    assert hand["mix"].get("LDG", 0) > 0 and pipelined["mix"].get("LDG", 0) == 0, (hand["mix"], pipelined["mix"])
    assert pipelined["mix"].get("LDGSTS", 0) >= 3, pipelined["mix"]
    assert pipelined["spill_bytes"] == 0 and pipelined["per_kept_weight"] < 14, pipelined
    assert 4 * pipelined["shared_bytes"] <= 228 * 1024, pipelined


def test_2of4_nibble_expansion_fits_the_issue_budget():
    # The SpMM's K loop at a decode batch: the gather expansion is over the ~17.7 instructions per
    # kept weight that the H200 can issue at full bandwidth; the 2:4 nibble one (two byte permutes
    # a nibble) must stay well under it (8.75 when written).
    gather, nibble = (kernel_sass.compile_spmm(two_of_four) for two_of_four in (False, True))
    assert nibble["spill_bytes"] == 0 and nibble["per_kept_weight"] < 12 and 17.7 < gather["per_kept_weight"]
    assert nibble["mix"]["PRMT"] == 2 * 8 * 2  # per nibble, 8 nibbles a word, 2 words a K step
    assert nibble["mix"]["HGMMA"] == gather["mix"]["HGMMA"]  # the same MMAs


def test_sparse_tensor_core_product_machine_code():
    # sparse/mma_sp.py: one HMMA.SP (m16n8k32, bf16) a word and 8 rows of x, 8 loads a word up to
    # 8 rows (the two rows' 8-byte values, their mask words, x's four bf16 pairs), 12 at 16 (x twice),
    # and with the word loop unrolled 4 times about 6 instructions per kept weight at any batch up to
    # 8: a quarter of the SpMV's at 8 rows and under its 8.6 at 1.
    for batch, per_kept_weight, loads in ((1, 7.0, 8), (8, 7.0, 8), (16, 8.5, 12)):
        report = kernel_sass.compile_mma_sp(batch, slices=4, unroll=4)
        assert report["spill_bytes"] == 0, batch
        assert report["sass"].count("HMMA.SP.16832.F32.BF16") >= report["words_in_loop"], batch
        assert report["loads_per_word"] == loads, batch
        assert report["per_kept_weight"] < per_kept_weight, (batch, report["per_kept_weight"])
    # Two 16-row tiles a warp: twice the weight bytes in flight, x's four loads shared, no spills.
    report = kernel_sass.compile_mma_sp(8, slices=4, unroll=4, tiles=2)
    assert report["spill_bytes"] == 0 and report["loads_per_word"] == 12 and report["per_kept_weight"] < 7.0


def test_sparse_tensor_core_product_sums_its_warps_slices_in_one_pass_a_tile_and_block():
    # The warps' slices of K are summed through shared memory once per 16-row tile and 8-row block
    # of x (its four accumulators in one reduction: two barriers), not once per accumulator (three
    # barriers each: 11 at 1 row, 47 at 16 rows with two tiles before session 25).
    for batch, tiles, most in ((1, 1, 2), (8, 2, 2 * 2 + 1), (16, 2, 4 * 2 + 3)):
        report = kernel_sass.compile_mma_sp(batch, slices=4, unroll=4, tiles=tiles, ahead=4)
        assert report["barriers"] <= most, (batch, tiles, report["barriers"])


def test_sparse_tensor_core_product_keeps_its_words_ahead_in_flight():
    # ptxas reorders the ring of prefetched words (mma_sp.PREFETCH_UNROLL): one word ahead, some
    # weight loads are read in the word they were issued for (0 words later), so a warp waits on
    # the memory every word; four ahead unrolled four times, every weight load is first read four
    # words later (3.5 at 16 rows: x's second block), with no spills.
    # The same with a prologue fused (the RMSNorm: one bf16x2 multiply a pair; silu(gate) * up).
    for batch, tiles, prologue in ((1, 1, ""), (8, 1, ""), (8, 2, ""), (16, 1, ""), (1, 1, "norm"), (1, 1, "gated")):
        report = kernel_sass.compile_mma_sp(batch, slices=4, unroll=4, tiles=tiles, ahead=4, norm=prologue == "norm",
                                            gated=prologue == "gated")
        assert report["spill_bytes"] == 0, (batch, tiles)
        assert report["words_to_first_use"][0] >= 3.5, (batch, tiles, report["words_to_first_use"])
    assert kernel_sass.compile_mma_sp(1, slices=4, unroll=4)["words_to_first_use"][0] == 0
