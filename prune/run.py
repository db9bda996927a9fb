"""Layer-sequential pruning driver and the `python -m prune` command line.

The model's weights stay on the CPU (memory-mapped from the checkpoint); one TransformerBlock at
a time moves to the device, so peak device memory is one block plus the activations it works on:

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

Packed output: N:M linears become `<name>.values` + `<name>.mask` (sparse.pack, validated);
unstructured ones stay dense with their zeros. Everything else is copied from the source.
"""
import argparse
import fnmatch
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model import Transformer, precompute_rope
from prune.calibration import (CalibrationError, CalibrationSet, InputStatistics, decode_calibration,
                               download_c4_shard, read_prompts, text_windows)
from prune.magnitude import magnitude_prune
from prune.sparsegpt import sparsegpt_prune
from prune.wanda import wanda_prune
from sparse import is_unstructured, pack, parse_pattern, validate
from sparse.format import packed_shapes

BLOCK_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")  # forward order

# Each backend as (weight, statistics of its input, pattern) -> (pruned weight, keep mask).
METHODS = {
    "sparsegpt": lambda weight, stats, pattern: sparsegpt_prune(weight, stats.hessian, pattern),
    "wanda": lambda weight, stats, pattern: wanda_prune(weight, stats.squared_norms, pattern),
    "magnitude": lambda weight, stats, pattern: magnitude_prune(weight, pattern),
}


def load_model_on_cpu(checkpoint):
    """(Transformer whose weights are the checkpoint's memory-mapped CPU tensors, config, metadata)."""
    state_dict, config, metadata = load_checkpoint(checkpoint, mmap=True)
    if "sparsity" in metadata:
        raise CheckpointError(f"{checkpoint} is already pruned ({metadata['sparsity'].get('pattern')}); "
                              f"prune the dense source checkpoint")
    if config.tie_embeddings:  # a tied checkpoint may store the shared matrix once
        state_dict = dict(state_dict)
        state_dict.setdefault("output.weight", state_dict.get("tok_embeddings.weight"))
    with torch.device("meta"):
        model = Transformer(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint} does not match its config: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    if config.tie_embeddings:  # assign=True set the two parameters separately
        model.output.weight = model.tok_embeddings.weight
    return model, config, metadata


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


class BlockReplay:
    """Runs parts of one TransformerBlock teacher-forced (no KV cache) over the stored calibration
    batches, feeding the inputs of watched linears into their statistics."""

    def __init__(self, config, batches, device, activation_device):
        self.counted = [counted.to(device) for _, counted in batches]
        T = max(tokens.shape[1] for tokens, _ in batches)
        cos, sin = precompute_rope(T, config.head_dim, config.rope_base, config.rope_scaling)
        self.cos, self.sin = cos.to(device)[None], sin.to(device)[None]  # [1, T, head_dim]
        self.causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))
        self.device, self.activation_device = device, activation_device

    # The two residual halves of TransformerBlock.forward, so a replay can stop between them.
    def attention(self, block, x):
        T = x.shape[1]
        return x + block.attention(block.attention_norm(x), None, self.cos[:, :T], self.sin[:, :T], self.causal[:T, :T])

    @staticmethod
    def feed_forward(block, h):
        return h + block.feed_forward(block.ffn_norm(h))

    @torch.no_grad()
    def run(self, block, fn, inputs, watch=None, collect=None, keep_outputs=False):
        """fn(x) for each stored batch x [B, T, dim]. `watch` maps a linear's name in `block` to
        the InputStatistics its input is added to; `collect` takes fn's outputs (counted positions only)."""
        current = {}
        hooks = [block.get_submodule(name).register_forward_pre_hook(
                     lambda module, args, stats=stats: stats.add(args[0], current["counted"]))
                 for name, stats in (watch or {}).items()]
        outputs = []
        # Teacher-forced attention over the whole sequence: a cache (left by a generate() on this
        # model) would be written to and attended instead, so it is set aside for the replay.
        cache, block.attention.kv_cache = block.attention.kv_cache, None
        try:
            for x, counted in zip(inputs, self.counted):
                current["counted"] = counted
                y = fn(x.to(self.device))
                if collect is not None:
                    collect.add(y, counted)
                if keep_outputs:
                    outputs.append(y.to(self.activation_device))
        finally:
            block.attention.kv_cache = cache
            for hook in hooks:
                hook.remove()
        return outputs


def prune_block(block, replay: BlockReplay, inputs, names, prune_linear, one_shot=False):
    """Prune the linears `names` of `block` (prune_linear(name, statistics) does one) and return
    the block's outputs on `inputs`, computed with the pruned weights (sequential) or the dense
    ones (one-shot)."""
    def statistics(*linears):
        return {n: InputStatistics(block.get_submodule(n).in_features, replay.device) for n in linears if n in names}

    attention = lambda x: replay.attention(block, x)  # noqa: E731
    feed_forward = lambda h: replay.feed_forward(block, h)  # noqa: E731
    if one_shot:  # every statistic from the dense block, in one replay
        attention_stats = statistics("attention.wqkv", "attention.wo")
        feed_forward_stats = statistics("feed_forward.w13", "feed_forward.w2")
        hidden = replay.run(block, attention, inputs, attention_stats, keep_outputs=True)
        outputs = replay.run(block, feed_forward, hidden, feed_forward_stats, keep_outputs=True)
        for name, stats in {**attention_stats, **feed_forward_stats}.items():
            prune_linear(name, stats)
        return outputs

    # Sequential: each linear is calibrated after the ones before it are pruned, by the shortest
    # replay that produces its input. wqkv and w13 read a norm's output: replaying the norm is
    # enough. wo and w2 read values inside attention / the MLP (which do not depend on wo or w2
    # themselves): the sublayer runs and a hook on the linear catches its input.
    norm_before = {"attention.wqkv": block.attention_norm, "feed_forward.w13": block.ffn_norm}
    sublayer_of = {"attention.wo": attention, "feed_forward.w2": feed_forward}

    def calibrate_and_prune(name, stream):
        for name, stats in statistics(name).items():
            if name in norm_before:
                replay.run(block, norm_before[name], stream, collect=stats)
            else:
                replay.run(block, sublayer_of[name], stream, watch={name: stats})
            prune_linear(name, stats)

    calibrate_and_prune("attention.wqkv", inputs)
    calibrate_and_prune("attention.wo", inputs)
    hidden = replay.run(block, attention, inputs, keep_outputs=True)
    calibrate_and_prune("feed_forward.w13", hidden)
    calibrate_and_prune("feed_forward.w2", hidden)
    return replay.run(block, feed_forward, hidden, keep_outputs=True)


def pick_activation_device(device, n_tokens, dim, dtype):
    """Keep the calibration activations on the GPU when the three sets alive at once (block inputs,
    mid-block hidden states, outputs) fit in a quarter of its free memory, else on the CPU (an 8B
    model with 1M tokens needs ~25 GB for them)."""
    if device.type != "cuda":
        return device
    need = 3 * n_tokens * dim * torch.finfo(dtype).bits // 8
    return device if need < torch.cuda.mem_get_info(device)[0] // 4 else torch.device("cpu")


def prune_model(checkpoint, calibration: CalibrationSet, method: str, pattern: str, out, *, device="cpu",
                one_shot=False, include=("layers.*",), exclude=(), batch_tokens=8192, seed=0):
    """Prune the block linears of `checkpoint` on `calibration` and write the packed checkpoint to
    `out` (atomically). Returns the metadata written."""
    started = time.perf_counter()
    device = torch.device(device)
    if method not in METHODS:
        raise ValueError(f"unknown method '{method}' (expected {', '.join(METHODS)})")
    model, config, source_metadata = load_model_on_cpu(checkpoint)
    names = selected_linears(model, pattern, include, exclude)
    storage_dtype = model.tok_embeddings.weight.dtype
    # CPU matmuls in bf16/fp16 are slow and coarse; the GPU runs the checkpoint's own dtype.
    compute_dtype = torch.float32 if device.type == "cpu" else storage_dtype
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    batches = calibration.padded_batches(batch_tokens)
    activation_device = pick_activation_device(device, sum(t.numel() for t, _ in batches), config.dim, compute_dtype)
    replay = BlockReplay(config, batches, device, activation_device)
    with torch.no_grad():
        inputs = [model.tok_embeddings(tokens).to(activation_device, compute_dtype) for tokens, _ in batches]
    masks = {}
    last_pruned_layer = max(int(name.split(".")[1]) for name in names)  # blocks after it stay as they are
    for i, block in enumerate(tqdm(model.layers[:last_pruned_layer + 1], desc=f"{method} {pattern}", unit="block")):
        block.to(device, compute_dtype)

        def prune_linear(name, stats):
            linear = block.get_submodule(name)
            pruned, keep = METHODS[method](linear.weight.data, stats, pattern)
            linear.weight.data = pruned  # rebind, never write into the memory-mapped source tensor
            masks[f"layers.{i}.{name}"] = keep.cpu()

        block_names = [n.split(".", 2)[2] for n in names if n.startswith(f"layers.{i}.")]
        inputs = prune_block(block, replay, inputs, block_names, prune_linear, one_shot)
        block.to("cpu", storage_dtype)
    del inputs

    state_dict = packed_state_dict(model, masks, pattern)
    prune_seconds = time.perf_counter() - started
    peak = peak_memory_bytes(device)
    metadata = dict(source_metadata)
    metadata.update(
        sparsity=dict(pattern=pattern, format="dense-zeros" if is_unstructured(pattern) else "bitmask-v1",
                      layers=list(masks)),
        method=method,
        calibration=dict(calibration.info, counted_tokens=calibration.counted_tokens,
                         sequences=len(calibration.sequences), total_tokens=sum(len(s) for s in calibration.sequences),
                         collection="one-shot" if one_shot else "sequential"),
        seed=seed,
        source_checkpoint=str(Path(checkpoint).resolve()),
        tokenizer_dir=source_tokenizer_dir(checkpoint, source_metadata),
        timing=dict(prune_seconds=round(prune_seconds, 2), peak_memory_bytes=peak, device=str(device)),
    )
    save_checkpoint(out, state_dict, config, metadata)
    return metadata


def source_tokenizer_dir(checkpoint, source_metadata) -> str:
    """Where the source's tokenizer lives (beside it, or where its metadata points), so the pruned
    checkpoint written elsewhere finds it; the source's folder if it has none."""
    from tokenizer import find_tokenizer
    try:
        return str(Path(find_tokenizer(checkpoint, source_metadata)).resolve())
    except FileNotFoundError:
        return str(Path(checkpoint).resolve().parent)


def packed_state_dict(model, masks, pattern):
    """The model's state dict with every pruned N:M linear as `.values` + `.mask` (validated);
    unstructured patterns keep the dense tensor with its zeros."""
    state_dict = model.state_dict()
    if is_unstructured(pattern):
        return state_dict
    for name, keep in masks.items():
        weight = state_dict.pop(f"{name}.weight")
        values, mask = pack(weight, pattern, mask=keep)
        validate(values, mask, pattern)
        state_dict[f"{name}.values"], state_dict[f"{name}.mask"] = values, mask
    return state_dict


def peak_memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------- command line

def build_calibration(args, config, device) -> CalibrationSet:
    from tokenizer import find_tokenizer, load_tokenizer  # the generation stack, needed only here

    tokenizer = load_tokenizer(find_tokenizer(args.checkpoint))  # the generator must share it (vocab checked below)
    if args.calib == "text":
        path = download_c4_shard() if args.text == "c4" else args.text
        return text_windows(tokenizer, path, args.tokens, args.seq_len, args.seed)
    from generate import load_model

    prompts = read_prompts(args.prompts)
    generator_path = args.generator or args.checkpoint
    generator = load_model(generator_path, device, torch.float32 if device.type == "cpu" else torch.bfloat16)
    if generator.config.vocab_size != config.vocab_size:
        raise CalibrationError(f"--generator {args.generator} has a vocabulary of {generator.config.vocab_size} "
                               f"tokens, the pruned model {config.vocab_size}: they must share a tokenizer")
    temperature = 0.0 if args.greedy else args.temperature
    calibration = decode_calibration(generator, tokenizer, prompts, args.tokens, args.max_new_tokens,
                                     temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                     batch_size=args.batch_size, compile=device.type == "cuda" and not args.no_compile)
    calibration.info.update(prompt_file=str(args.prompts), generator=str(Path(generator_path).resolve()))
    del generator
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return calibration


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m prune", description="Prune a checkpoint's block linears "
                                "(SparseGPT, Wanda or magnitude) and write a packed sparse checkpoint.")
    p.add_argument("--checkpoint", "--checkpoint_path", required=True, help="dense source checkpoint (.pth)")
    p.add_argument("--method", choices=list(METHODS), default="sparsegpt")
    p.add_argument("--pattern", default="2:4", help="N:M (2:4, 4:8, 8:16, 16:32) or unstructured percentage (50%%)")
    p.add_argument("--calib", choices=["decode", "text"], default="decode",
                   help="decode: decoding-aware (generated continuations, decode positions only); text: teacher-forced windows")
    p.add_argument("--prompts", help="prompt file for --calib decode (jsonl field prompt/input/text, or one per line)")
    p.add_argument("--text", help="corpus for --calib text (jsonl field text, or plain text); 'c4' downloads a C4 shard")
    p.add_argument("--tokens", type=int, default=1_000_000,
                   help="calibration budget: decode tokens (decode) or window tokens (text)")
    p.add_argument("--seq_len", type=int, help="window length for --calib text (default: 2048, or the model's context if shorter)")
    p.add_argument("--out", required=True, help="output checkpoint (.pth), written atomically")
    p.add_argument("--generator", help="checkpoint that generates the calibration text (same tokenizer); default: the pruned model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max_new_tokens", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=16, help="prompts generated at once")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top_k", type=int, default=20)
    p.add_argument("--top_p", type=float, default=0.8)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--no_compile", action="store_true", help="do not torch.compile the generation on CUDA")
    p.add_argument("--one-shot", "--one_shot", dest="one_shot", action="store_true",
                   help="calibrate every layer on the dense model's activations (default: sequential, on the pruned ones)")
    p.add_argument("--include", nargs="+", default=["layers.*"], help="globs of block linears to prune")
    p.add_argument("--exclude", nargs="+", default=[], help="globs of block linears to keep dense")
    p.add_argument("--batch_tokens", type=int, default=8192, help="tokens per replay batch")
    args = p.parse_args(argv)
    parse_pattern(args.pattern)  # raises ValueError naming the problem
    if args.calib == "decode" and not args.prompts:
        p.error("--calib decode needs --prompts FILE")
    if args.calib == "text" and not args.text:
        p.error("--calib text needs --text FILE (or --text c4)")
    for flag in ("tokens", "seq_len", "max_new_tokens", "batch_size", "batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            p.error(f"--{flag} must be positive")
    return args


def main(argv=None):
    started = time.perf_counter()
    try:
        args = parse_args(argv)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but CUDA is not available")
        # A bad checkpoint, pattern or selection fails here, before any generation.
        model, config, _ = load_model_on_cpu(args.checkpoint)
        selected_linears(model, args.pattern, args.include, args.exclude)
        del model
        args.seq_len = args.seq_len or min(2048, config.block_size)
        if args.seq_len > config.block_size:
            raise ValueError(f"--seq_len {args.seq_len} exceeds the model's context of {config.block_size} tokens")
        calibration = build_calibration(args, config, device)
        calibrated = time.perf_counter()
        calibration.info["seconds"] = round(calibrated - started, 2)
        metadata = prune_model(args.checkpoint, calibration, args.method, args.pattern, args.out, device=device,
                               one_shot=args.one_shot, include=args.include, exclude=args.exclude,
                               batch_tokens=args.batch_tokens, seed=args.seed)
    except (CheckpointError, CalibrationError, ValueError, FileNotFoundError) as e:
        sys.exit(f"prune: error: {e}")
    except KeyboardInterrupt:
        sys.exit("prune: interrupted; no output written")
    wall = time.perf_counter() - started
    timing = metadata["timing"]
    print(f"wrote {args.out}: {len(metadata['sparsity']['layers'])} linears {args.method} {args.pattern}, "
          f"{metadata['calibration']['counted_tokens']} calibration tokens; "
          f"calibration {calibrated - started:.1f} s, pruning {timing['prune_seconds']:.1f} s, wall {wall:.1f} s, "
          f"peak memory {timing['peak_memory_bytes'] / 2**30:.2f} GiB ({timing['device']})")
