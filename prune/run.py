"""Layer-sequential pruning driver and the `python -m prune` command line.

The model's weights stay on the CPU (memory-mapped from the checkpoint); one TransformerBlock at
a time moves to the device, so peak device memory is one block, one set of activations of the
calibration tokens (the replays advance it in place, batch by batch) and one layer's statistics:

    x_0 = embeddings of the calibration sequences               (stored per padded batch)
    for each block i, with h = x + attention(attention_norm(x)):
        attention_norm(x_i)         -> H of wqkv's input -> prune wqkv
        replay attention on x_i     -> H of wo's input   -> prune wo;   h_i = the pruned attention half
        ffn_norm(h_i)               -> H of w13's input  -> prune w13
        replay the MLP on h_i       -> H of w2's input   -> prune w2;   x_{i+1} = the pruned block's output

Sequential collection (the default) calibrates every linear on the inputs the *pruned* model
feeds it: block i sees the outputs of already-pruned blocks 0..i-1, and inside a block wo sees
the pruned wqkv's attention output, w2 the pruned w13's activations. That is the protocol of
SparseGPT and Wanda, chosen because each layer's solve then corrects the error the layers before
it introduced; it costs about two block forwards per block (each replay stops at the linear it
calibrates). `one_shot=True` collects all four statistics from the dense block in one replay and
feeds each block the dense model's activations: one forward per block, every layer fitted to
the dense model's own inputs, errors left to accumulate.

All backends prune from the same statistics (prune/calibration.py's InputStatistics), computed
only at the calibration set's counted positions (decode steps for decoding-aware calibration).
Only the block linears are pruned by default; embeddings, norms and lm_head stay dense.

Packed output: N:M linears become `<name>.values` + `<name>.mask` (sparse.pack, validated on
the device right after each solve); unstructured ones stay dense with their zeros. Everything
else is copied from the source.

At scale (an 8B model, a million decode tokens and their prompts) one set of activations runs to
gigabytes and stays on the GPU when it fits (pick_activation_device); the
replays are about two block forwards per block, H accumulates on the tensor cores
(prune/calibration.py), and SparseGPT's column walk is bound by kernel launches.
scripts/bench_prune.py times it.

Public: read_source (the one read of a checkpoint), calibrate_by_decoding, prune_model -> a
PrunedCheckpoint to save; main() is `python -m prune` over them.
"""
import copy
import fnmatch
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import cli_args
from checkpoint import CheckpointError, load_checkpoint, same_file, save_checkpoint
from generate import model_from_state_dict
from model import ModelArgs, Transformer, precompute_rope
from prune.calibration import (DECODE_SOURCES, SOURCES, CalibrationError, CalibrationSet, InputStatistics,
                               decode_calibration, download_c4_shard, from_decode, mix_label, prompt_file_record,
                               read_prompt_rows, reference_calibration, text_windows)
from prune.magnitude import magnitude_prune
from prune.sparsegpt import sparsegpt_prune
from prune.wanda import wanda_prune
from sparse import is_unstructured, pack, parse_pattern, validate
from sparse.format import FORMAT as BITMASK_FORMAT, packed_shapes

BLOCK_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")  # forward order

# Each backend as (weight, statistics of its input, pattern) -> (pruned weight, keep mask).
METHODS = {
    "sparsegpt": lambda weight, stats, pattern: sparsegpt_prune(weight, stats.hessian, pattern),
    "wanda": lambda weight, stats, pattern: wanda_prune(weight, stats.squared_norms, pattern),
    "magnitude": lambda weight, stats, pattern: magnitude_prune(weight, pattern),
}


@dataclass
class Source:
    """A dense checkpoint read for pruning: its model, whose weights are the checkpoint's
    memory-mapped CPU tensors in the checkpoint's own dtype, and the checkpoint's metadata."""
    path: Path
    model: Transformer
    metadata: dict

    def tokenizer_dir(self) -> Path:
        """Where the source's tokenizer is: beside it, or where its metadata points (FileNotFoundError if nowhere)."""
        from tokenizer import find_tokenizer  # the generation stack, needed only for calibration
        return Path(find_tokenizer(self.path, self.metadata)).resolve()

    def provenance(self) -> dict:
        """What a pruned checkpoint's metadata starts from: the source's own, where it came from, and
        where its tokenizer is, so a pruned checkpoint written elsewhere finds it (the source's folder
        if it has none)."""
        try:
            tokenizer_dir = self.tokenizer_dir()
        except FileNotFoundError:
            tokenizer_dir = self.path.resolve().parent
        return dict(self.metadata, source_checkpoint=str(self.path.resolve()), tokenizer_dir=str(tokenizer_dir))


def read_source(checkpoint) -> Source:
    """Read a dense checkpoint to prune: the one read of it in a run. The model keeps the stored
    dtype and stays memory-mapped until each block is pruned (generate.load_model would cast and
    move it), and the pruned checkpoint inherits the source's metadata."""
    state_dict, config, metadata = load_checkpoint(checkpoint, mmap=True)
    if "sparsity" in metadata:
        raise CheckpointError(f"{checkpoint} is already pruned ({metadata['sparsity'].get('pattern')}); "
                              f"prune the dense source checkpoint")
    return Source(Path(checkpoint), model_from_state_dict(state_dict, config, metadata, checkpoint), metadata)


def selected_linears(model, pattern: str, include, exclude) -> list:
    """Names 'layers.{i}.{linear}' of the block linears matching an include glob and no exclude
    glob; raises ValueError if one of them cannot take the pattern."""
    names = [f"layers.{i}.{linear}" for i in range(model.config.n_layer) for linear in BLOCK_LINEARS]
    names = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in include)
             and not any(fnmatch.fnmatchcase(n, g) for g in exclude)]
    if not names:
        raise ValueError(f"no block linear matches --include {list(include)} minus --exclude {list(exclude)}")
    if not is_unstructured(pattern):
        for name in names:
            linear = model.get_submodule(name)
            try:
                packed_shapes(linear.in_features, linear.out_features, pattern)
            except ValueError as e:
                raise ValueError(f"{name} cannot be packed {pattern}: {e} (keep it dense with --exclude)") from None
    return names


class StopReplay(Exception):
    """Raised by a watch hook once every watched input of a batch is caught: the rest of the
    sublayer would be computed for nothing."""


class BlockReplay:
    """Runs parts of one TransformerBlock teacher-forced (no KV cache) over the calibration
    activations, one stored batch at a time, feeding the inputs of watched linears into their
    statistics."""

    def __init__(self, config, batches, device):
        self.counted = [counted.to(device) for _, counted in batches]
        T = max(tokens.shape[1] for tokens, _ in batches)
        cos, sin = precompute_rope(T, config.head_dim, config.rope_base, config.rope_scaling)
        self.cos, self.sin = cos.to(device)[None], sin.to(device)[None]  # [1, T, head_dim]
        self.causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))
        self.device = device

    # The two residual halves of TransformerBlock.forward, so a replay can stop between them.
    def attention(self, block, x):
        T = x.shape[1]
        return x + block.attention(block.attention_norm(x), None, self.cos[:, :T], self.sin[:, :T], self.causal[:T, :T])

    @staticmethod
    def feed_forward(block, h):
        return h + block.feed_forward(block.ffn_norm(h))

    @torch.no_grad()
    def run(self, block, fn, stream: list, watch=None, collect=None, advance=False):
        """fn(x) for each stored batch x [B, T, dim] of `stream`. `watch` maps a linear's name in
        `block` to the InputStatistics its input is added to; `collect` takes fn's outputs
        (counted positions only). advance=True replaces each batch of `stream` by fn's output, in
        place, so only one set of activations is ever alive (at 1M tokens of an 8B model one set is
        8 GB); otherwise fn stops as soon as the watched inputs are caught."""
        current = {}

        def catch(module, args, stats):
            stats.add(args[0], current["counted"])
            current["pending"] -= 1
            if current["pending"] == 0 and not advance:
                raise StopReplay

        watch = watch or {}
        hooks = [block.get_submodule(name).register_forward_pre_hook(
                     lambda module, args, stats=stats: catch(module, args, stats))
                 for name, stats in watch.items()]
        # Teacher-forced attention over the whole sequence: a cache (left by a generate() on this
        # model) would be written to and attended instead, so it is set aside for the replay.
        cache, block.attention.kv_cache = block.attention.kv_cache, None
        try:
            for k, (x, counted) in enumerate(zip(stream, self.counted)):
                current.update(counted=counted, pending=len(watch))
                try:
                    y = fn(x.to(self.device))
                except StopReplay:
                    continue
                if collect is not None:
                    collect.add(y, counted)
                if advance:
                    stream[k] = y.to(x.device)
        finally:
            block.attention.kv_cache = cache
            for hook in hooks:
                hook.remove()


def prune_block(block, replay: BlockReplay, stream: list, names, prune_linear, one_shot=False):
    """Prune the linears `names` of `block` (prune_linear(name, statistics) does one) and advance
    `stream` (in place) from the block's inputs to its outputs, computed with the pruned weights
    (sequential) or the dense ones (one-shot)."""
    def statistics(*linears):
        return {n: InputStatistics(block.get_submodule(n).in_features, replay.device) for n in linears if n in names}

    attention = lambda x: replay.attention(block, x)  # noqa: E731
    feed_forward = lambda h: replay.feed_forward(block, h)  # noqa: E731
    if one_shot:  # every statistic from the dense block, in one replay
        attention_stats = statistics("attention.wqkv", "attention.wo")
        feed_forward_stats = statistics("feed_forward.w13", "feed_forward.w2")
        replay.run(block, attention, stream, attention_stats, advance=True)
        replay.run(block, feed_forward, stream, feed_forward_stats, advance=True)
        for name, stats in {**attention_stats, **feed_forward_stats}.items():
            prune_linear(name, stats)
        return

    # Sequential: each linear is calibrated after the ones before it are pruned, by the shortest
    # replay that produces its input. wqkv and w13 read a norm's output: replaying the norm is
    # enough. wo and w2 read values inside attention / the MLP (which do not depend on wo or w2
    # themselves): the sublayer runs up to the linear, where a hook catches its input.
    norm_before = {"attention.wqkv": block.attention_norm, "feed_forward.w13": block.ffn_norm}
    sublayer_of = {"attention.wo": attention, "feed_forward.w2": feed_forward}

    def calibrate_and_prune(name):
        for name, stats in statistics(name).items():
            if name in norm_before:
                replay.run(block, norm_before[name], stream, collect=stats)
            else:
                replay.run(block, sublayer_of[name], stream, watch={name: stats})
            prune_linear(name, stats)

    calibrate_and_prune("attention.wqkv")
    calibrate_and_prune("attention.wo")
    replay.run(block, attention, stream, advance=True)
    calibrate_and_prune("feed_forward.w13")
    calibrate_and_prune("feed_forward.w2")
    replay.run(block, feed_forward, stream, advance=True)


def pick_activation_device(device, n_tokens, dim, dtype):
    """Keep the calibration activations on the GPU when one set of them (the replay advances
    them in place) fits in half of its free memory, else on the CPU (slower: every replay then
    crosses PCIe)."""
    if device.type != "cuda":
        return device
    need = n_tokens * dim * torch.finfo(dtype).bits // 8
    return device if need < torch.cuda.mem_get_info(device)[0] // 2 else torch.device("cpu")


@dataclass
class PruneResult:
    names: list  # the pruned linears 'layers.{i}.{linear}', in pruning order
    packed: dict  # name -> (values, mask) on the CPU, for N:M patterns (packed on the device)
    seconds: dict  # replay (moving blocks, replays, statistics), solve (the backend, packing), total
    peak_memory_bytes: int


def prune_layers(model, calibration: CalibrationSet, method: str, pattern: str, names: list, *, device="cpu",
                 one_shot=False, batch_tokens=8192) -> PruneResult:
    """Prune the block linears `names` of `model` in place, block by block on `device`.

    Each block moves to the device for its turn and back to where it was (the CPU for a model
    loaded from a checkpoint), so the device holds one block, the calibration activations and
    one layer's statistics at a time."""
    started = time.perf_counter()
    device = torch.device(device)
    if method not in METHODS:
        raise ValueError(f"unknown method '{method}' (expected {', '.join(METHODS)})")
    storage_dtype = model.tok_embeddings.weight.dtype
    # CPU matmuls in bf16/fp16 are slow and coarse; the GPU runs the checkpoint's own dtype.
    compute_dtype = torch.float32 if device.type == "cpu" else storage_dtype
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    batches = calibration.padded_batches(batch_tokens)
    activation_device = pick_activation_device(device, sum(t.numel() for t, _ in batches), model.config.dim,
                                               compute_dtype)
    replay = BlockReplay(model.config, batches, device)
    with torch.no_grad():
        table = model.tok_embeddings.weight.to(device, compute_dtype)  # one copy, not one per batch
        stream = [F.embedding(tokens.to(device), table).to(activation_device) for tokens, _ in batches]
        del table
    pruned_names, packed, solve_seconds = [], {}, 0.0
    last_pruned_layer = max(int(name.split(".")[1]) for name in names)  # blocks after it stay as they are
    for i, block in enumerate(tqdm(model.layers[:last_pruned_layer + 1], desc=f"{method} {pattern}", unit="block")):
        home = block.attention_norm.weight.device
        block.to(device, compute_dtype)

        def prune_linear(name, stats):
            nonlocal solve_seconds
            sync()  # the replays queued before this belong to the replay phase
            solve_started = time.perf_counter()
            linear = block.get_submodule(name)
            pruned, keep = METHODS[method](linear.weight.data, stats, pattern)
            linear.weight.data = pruned  # rebind, never write into the memory-mapped source tensor
            full_name = f"layers.{i}.{name}"
            pruned_names.append(full_name)
            if not is_unstructured(pattern):
                values, mask = pack(pruned.to(storage_dtype), pattern, mask=keep)
                validate(values, mask, pattern)
                packed[full_name] = values.cpu(), mask.cpu()
            solve_seconds += time.perf_counter() - solve_started  # .cpu() waited for the device

        block_names = [n.split(".", 2)[2] for n in names if n.startswith(f"layers.{i}.")]
        prune_block(block, replay, stream, block_names, prune_linear, one_shot)
        block.to(home, storage_dtype)
    del stream
    sync()
    total = time.perf_counter() - started
    seconds = dict(replay=round(total - solve_seconds, 2), solve=round(solve_seconds, 2), total=round(total, 2))
    return PruneResult(pruned_names, packed, seconds, peak_memory_bytes(device))


@dataclass
class PrunedCheckpoint:
    state_dict: dict  # the source's, each pruned N:M linear as `<name>.values` + `<name>.mask`
    config: ModelArgs
    metadata: dict  # the source's provenance + sparsity, method, calibration, timing, seed

    def save(self, path):
        """Write the checkpoint atomically (an interrupted save leaves nothing), never over its source."""
        check_output_path(path, [self.metadata.get("source_checkpoint")])
        save_checkpoint(path, self.state_dict, self.config, self.metadata)


def check_output_path(out, inputs):
    """Refuse an output that would destroy an input (the same file, a hard link or a symlink to one)
    or that cannot be written as a file (an existing directory, a folder that cannot be made or
    written): raises ValueError before any work, not after an hour of pruning."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name the checkpoint file to write (e.g. {out / 'pruned.pth'})")
    folder = next(p for p in out.absolute().parents if p.exists())  # the folder made or written in
    if not folder.is_dir():
        raise ValueError(f"--out {out}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: no permission to write in {folder}")
    for path in inputs:
        if path is not None and same_file(out, path):
            raise ValueError(f"--out {out} is the input {path}; writing it would destroy the input")


def prune_model(model, calibration: CalibrationSet, method: str = "sparsegpt", pattern: str = "2:4", *,
                device="cpu", one_shot=False, include=("layers.*",), exclude=(), batch_tokens=8192, seed=0,
                metadata=None) -> PrunedCheckpoint:
    """Prune the block linears of `model` (in place) that match an `include` glob and no `exclude`
    glob, on `calibration`, block by block on `device`, and return the packed checkpoint. Its
    metadata starts from `metadata` (Source.provenance() for a model from read_source) and adds
    the pruning's own record; `seed` is recorded as the seed the calibration was made with."""
    names = selected_linears(model, pattern, include, exclude)
    result = prune_layers(model, calibration, method, pattern, names, device=device, one_shot=one_shot,
                          batch_tokens=batch_tokens)
    record = dict(metadata or {})
    record.update(pruned_metadata(result, calibration, method, pattern, one_shot, device), seed=seed)
    return PrunedCheckpoint(packed_state_dict(model, result), model.config, record)


def pruned_metadata(result: PruneResult, calibration: CalibrationSet, method, pattern, one_shot, device) -> dict:
    """What a pruned checkpoint records about its pruning (the caller adds where it came from)."""
    return dict(
        sparsity=dict(pattern=pattern, format="dense-zeros" if is_unstructured(pattern) else BITMASK_FORMAT,
                      layers=result.names),
        method=method,
        calibration=dict(calibration.info, counted_tokens=calibration.counted_tokens,
                         sequences=len(calibration.sequences), total_tokens=sum(len(s) for s in calibration.sequences),
                         collection="one-shot" if one_shot else "sequential", mix=calibration.mix()),
        timing=dict(prune_seconds=result.seconds["total"], replay_seconds=result.seconds["replay"],
                    solve_seconds=result.seconds["solve"], peak_memory_bytes=result.peak_memory_bytes,
                    device=str(device)),
    )


def packed_state_dict(model, result: PruneResult):
    """The model's state dict with every pruned N:M linear as `.values` + `.mask` (packed and
    validated on the device as it was pruned); unstructured patterns keep the dense tensor with
    its zeros."""
    state_dict = model.state_dict()
    for name, (values, mask) in result.packed.items():
        del state_dict[f"{name}.weight"]
        state_dict[f"{name}.values"], state_dict[f"{name}.mask"] = values, mask
    return state_dict


def peak_memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def calibrate_by_decoding(source: Source, tokenizer, prompts_file, tokens: int, max_new_tokens: int, *, device,
                          generator=None, seed=0, batch_size=16, temperature=0.7, top_k=20, top_p=0.8,
                          compile=False) -> CalibrationSet:
    """Decoding-aware calibration for `source`: `generator` (a checkpoint with the same tokenizer;
    by default the source model itself, copied to `device`) answers the prompts of `prompts_file`
    in its chat template, and only its decode steps are counted (prune.calibration)."""
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if generator is None:  # a copy, so the source keeps its dtype and memory map for the pruning
        model = copy.deepcopy(source.model).to(device=device, dtype=dtype)
    else:
        from generate import load_model  # the generation stack, needed only here
        model = load_model(generator, device, dtype)
        if model.config.vocab_size != source.model.config.vocab_size:
            raise CalibrationError(f"--generator {generator} has a vocabulary of {model.config.vocab_size} tokens, "
                                   f"the pruned model {source.model.config.vocab_size}: they must share a tokenizer")
    rows = read_prompt_rows(prompts_file)
    calibration = decode_calibration(model, tokenizer, [row["prompt"] for row in rows], tokens, max_new_tokens,
                                     domains=[row["domain"] for row in rows], temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, batch_size=batch_size, compile=compile)
    calibration.info.update(prompt_file_record(prompts_file, rows),
                            generator=str(Path(generator or source.path).resolve()))
    del model
    if device.type == "cuda":
        torch._dynamo.reset()  # the compiled step's CUDA-graph pool still holds the generator's memory
        torch.cuda.empty_cache()
    return calibration


# ---------------------------------------------------------------------------- command line

def build_calibration(args, source: Source, device) -> CalibrationSet:
    from tokenizer import load_tokenizer  # the generation stack, needed only here

    tokenizer = load_tokenizer(source.tokenizer_dir())  # the generator must share it (vocab checked)
    if args.calib == "text":
        path = download_c4_shard() if args.text == "c4" else args.text
        return text_windows(tokenizer, path, args.tokens, args.seq_len, args.seed)
    if args.calib == "reference":
        rows = read_prompt_rows(args.prompts)
        calibration = reference_calibration(tokenizer, rows, args.tokens)
        calibration.info.update(prompt_file_record(args.prompts, rows))
        return calibration
    decoded = calibrate_by_decoding(source, tokenizer, args.prompts, args.tokens, args.max_new_tokens, device=device,
                                    generator=args.generator, seed=args.seed, batch_size=args.batch_size,
                                    temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, compile=device.type == "cuda" and not args.no_compile)
    return from_decode(decoded, args.calib, args.tokens)


def add_pruning_args(parser):
    """The flags of how a calibrated model is pruned (not of its calibration): python -m prune's,
    and what evaluation.compare passes on to every cell with --prune_args."""
    parser.add_argument("--one-shot", "--one_shot", dest="one_shot", action="store_true",
                        help="calibrate every layer on the dense model's activations (default: sequential, on the pruned ones)")
    parser.add_argument("--include", nargs="+", default=["layers.*"], help="globs of block linears to prune")
    parser.add_argument("--exclude", nargs="+", default=[], help="globs of block linears to keep dense")
    parser.add_argument("--batch_tokens", type=cli_args.positive_int, default=8192, help="tokens per replay batch")


CALIB_HELP = ("calibration source, each on the same --tokens budget of counted tokens: "
              "text: teacher-forced windows of --text, every position; "
              "decode: the model's own continuations of --prompts, decode positions only (the paper's rule); "
              "decode_first: decode plus each sequence's first position (the attention sink); "
              "generated: the same generated sequences, every position counted (prompt included); "
              "reference: teacher-forced --prompts with their reference answers (a jsonl field reference, "
              "answer or code, e.g. MBPP's), every position (default: decode)")


def parse_args(argv):
    p = cli_args.ArgumentParser(prog="python -m prune", description="Prune a checkpoint's block linears "
                                "(SparseGPT, Wanda or magnitude) and write a packed sparse checkpoint.")
    p.add_argument("--checkpoint", "--checkpoint_path", required=True, help="dense source checkpoint (.pth)")
    p.add_argument("--method", choices=list(METHODS), default="sparsegpt", help="pruning solver")
    p.add_argument("--pattern", default="2:4", help="N:M (2:4, 4:8, 8:16, 16:32) or unstructured percentage (50%%)")
    p.add_argument("--calib", choices=SOURCES, default="decode", help=CALIB_HELP)
    p.add_argument("--prompts", help="prompt file for every --calib but text (jsonl: field prompt/input/text, optional "
                   "domain and reference/answer/code; or one prompt per line)")
    p.add_argument("--text", help="corpus for --calib text (jsonl field text, or plain text); 'c4' downloads a C4 shard")
    p.add_argument("--tokens", type=cli_args.positive_int, default=1_000_000,
                   help="calibration budget: counted tokens (decode_first adds one first position per sequence)")
    p.add_argument("--seq_len", type=cli_args.positive_int, help="window length for --calib text (default: 2048, or the model's context if shorter)")
    p.add_argument("--out", required=True, help="output checkpoint (.pth), written atomically")
    p.add_argument("--generator", help="checkpoint that generates the calibration text (same tokenizer); default: the pruned model")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration sampling or window draw")
    p.add_argument("--device", type=cli_args.device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    p.add_argument("--max_new_tokens", type=cli_args.positive_int, default=512,
                   help="--calib decode: longest continuation generated per prompt")
    p.add_argument("--batch_size", type=cli_args.positive_int, help="prompts generated at once (default: 128 on CUDA, where the decode "
                   "is memory-bound and a batch costs about what one row does; 16 on the CPU)")
    p.add_argument("--temperature", type=cli_args.temperature, default=0.7, help="calibration sampling temperature")
    p.add_argument("--top_k", type=cli_args.top_k, default=20, help="tokens kept per step, or 'off'")
    p.add_argument("--top_p", type=cli_args.top_p, default=0.8, help="calibration sampling nucleus mass")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--no_compile", action="store_true", help="do not torch.compile the generation on CUDA")
    add_pruning_args(p)
    args = p.parse_args(argv)
    parse_pattern(args.pattern)  # raises ValueError naming the problem
    if args.calib != "text" and not args.prompts:
        p.error(f"--calib {args.calib} needs --prompts FILE")
    if args.calib == "text" and not args.text:
        p.error("--calib text needs --text FILE (or --text c4)")
    if args.calib in DECODE_SOURCES and args.max_new_tokens < 2:  # the first token comes from the prefill
        p.error(f"--calib {args.calib} needs --max_new_tokens >= 2")
    return args


def main(argv=None):
    started = time.perf_counter()
    try:
        args = parse_args(argv)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but CUDA is not available")
        check_output_path(args.out, [args.checkpoint, args.generator, args.prompts, args.text])
        source = read_source(args.checkpoint)  # the run's one read of the checkpoint
        config = source.model.config
        # A bad checkpoint, pattern or selection fails here, before any generation.
        selected_linears(source.model, args.pattern, args.include, args.exclude)
        args.seq_len = args.seq_len or min(2048, config.block_size)
        args.batch_size = args.batch_size or (128 if device.type == "cuda" else 16)
        if args.seq_len > config.block_size:
            raise ValueError(f"--seq_len {args.seq_len} exceeds the model's context of {config.block_size} tokens")
        calibration = build_calibration(args, source, device)
        calibrated = time.perf_counter()
        calibration.info["seconds"] = round(calibrated - started, 2)
        pruned = prune_model(source.model, calibration, args.method, args.pattern, device=device,
                             one_shot=args.one_shot, include=args.include, exclude=args.exclude,
                             batch_tokens=args.batch_tokens, seed=args.seed, metadata=source.provenance())
        pruned.save(args.out)
        metadata = pruned.metadata
    except (CheckpointError, CalibrationError, ValueError, FileNotFoundError) as e:
        cli_args.exit_with_error(e, "prune")
    except KeyboardInterrupt:
        sys.exit("prune: interrupted; no output written")
    wall = time.perf_counter() - started
    timing = metadata["timing"]
    print(f"wrote {args.out}: {len(metadata['sparsity']['layers'])} linears {args.method} {args.pattern}, "
          f"{metadata['calibration']['counted_tokens']} calibration tokens "
          f"({args.calib}: {mix_label([metadata['calibration']['mix']])}); "
          f"calibration {calibrated - started:.1f} s, pruning {timing['prune_seconds']:.1f} s (replay "
          f"{timing['replay_seconds']:.1f}, solve {timing['solve_seconds']:.1f}), wall {wall:.1f} s, "
          f"peak memory {timing['peak_memory_bytes'] / 2**30:.2f} GiB ({timing['device']})")
