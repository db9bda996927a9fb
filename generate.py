"""Text generation: load a checkpoint, prefill the prompt, decode one token at a time.

    python generate.py --checkpoint checkpoints/SmolLM2-135M-Instruct/model.pth --prompt "Hello" --chat
    python generate.py --checkpoint_path model.pth --prompt "Once upon a time" --compile --max_new_tokens 200
    torchrun --nproc_per_node=2 generate.py --checkpoint model.pth --compile   # tensor parallel (tp.py)

The decode step is one small function so that, on CUDA, `torch.compile(mode="reduce-overhead")`
captures the whole step (32 layers, sampling included) into one CUDA graph. Nothing in the loop
waits for the GPU except the end-of-sequence check, which looks at the tokens every
EOS_CHECK_INTERVAL steps instead of after each one.

Sampling never synchronises either: instead of torch.multinomial we draw Exponential(1) noise E
and take argmax(p / E). For independent E_i, E_i / p_i is exponential with rate p_i, and the
smallest of such variables is i with probability p_i / sum(p): an exact categorical draw made of
two elementwise ops and an argmax. Since p_i is exp(logit_i / T) up to a factor common to all i,
the step takes argmax(logit_i / T - log E_i) over the kept tokens and never computes the softmax
(one fused reduction instead of three). The noise is drawn eagerly from an explicit torch.Generator
and handed to the compiled step, so a fixed seed gives the same tokens compiled or not.

`generate()` is also what prune/ calls for decoding-aware calibration: it returns each
sequence's prompt length and generated ids, so the caller knows which positions were decode steps.
"""
import contextlib
import functools
import inspect
import itertools
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch._inductor
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import cli_args
import tp
from checkpoint import CheckpointError, checkpoint_file, load_checkpoint
from model import Attention, KVCache, Transformer
from tokenizer import find_tokenizer, load_tokenizer

EOS_CHECK_INTERVAL = 8  # decode steps between the host's looks at "has every row hit EOS?"
# The decode step's argmax over the vocabulary (greedy, or the exponential race) is a max over each
# of ARGMAX_CHUNKS slices, then an argmax over the slices: Inductor gives a one-row reduction to one
# program that walks the whole row, the slices give each row ARGMAX_CHUNKS programs (measured faster
# on the H200, docs/BENCHMARKS.md). Same index as torch.argmax (the first maximum).
ARGMAX_CHUNKS = 64


# ---------------------------------------------------------------------------------------------
# Loading


def load_model(checkpoint_path, device="cuda", dtype=torch.bfloat16, shard=None) -> Transformer:
    """A ready-to-run Transformer, dense or packed-sparse depending on the checkpoint's metadata.
    shard: a function applied to the model while its tensors are still the checkpoint's (memory-
    mapped, on the CPU), before it moves to `device`: tp.shard keeps a tensor-parallel rank's slices."""
    state_dict, config, metadata = load_checkpoint(checkpoint_path)
    model = model_from_state_dict(state_dict, config, metadata, checkpoint_path)
    if shard is not None:
        model = shard(model)
    # Module.to(dtype) casts floating-point tensors only, so sparse bitmasks stay int32.
    model = model.to(device=device, dtype=dtype).eval()
    if model.tok_embeddings.weight.is_cuda:
        install_decode_attention(model)
    return model


def model_from_state_dict(state_dict: dict, config, metadata: dict, source="checkpoint") -> Transformer:
    """The Transformer of a loaded checkpoint, on the tensors as they are (no copy, no cast: a
    memory-mapped checkpoint stays mapped): packed layers become SparseLinear after their masks are
    validated, tied embeddings are shared. `source` names the checkpoint in errors."""
    with torch.device("meta"):  # no memory is touched until load_state_dict hands over the tensors
        model = Transformer(config)
    sparsity = metadata.get("sparsity") or {}
    if sparsity.get("format") in ("bitmask-v1", "bitmask-v2"):
        import sparse  # only packed checkpoints need the kernels

        state_dict = dict(state_dict)
        for layer in [n[:-len(".values")] for n in state_dict if n.endswith(".values")]:
            values, mask = state_dict[f"{layer}.values"], state_dict.get(f"{layer}.mask")
            try:
                if mask is None:
                    raise ValueError("no mask stored beside the values")
                if sparsity["format"] == "bitmask-v1":  # the values' older layout (sparse/format.py)
                    values = state_dict[f"{layer}.values"] = sparse.format.values_from_v1(values, mask)
                sparse.validate(values, mask, sparsity["pattern"])  # every mask keeps its pattern exactly
            except ValueError as e:
                raise CheckpointError(f"checkpoint {source}, layer {layer}: {e}") from None
        sparse.swap_linears_for_state_dict(model, state_dict, sparsity["pattern"])
    elif sparsity.get("format") not in (None, "dense-zeros"):
        raise CheckpointError(f"checkpoint {source} has unknown sparsity format '{sparsity.get('format')}'")
    if config.tie_embeddings:  # a tied checkpoint may store the shared matrix once
        state_dict = dict(state_dict)
        state_dict.setdefault("output.weight", state_dict.get("tok_embeddings.weight"))
    expected, found = set(model.state_dict()), {k for k, v in state_dict.items() if v is not None}
    if expected != found:
        missing, unexpected = sorted(expected - found), sorted(found - expected)
        raise CheckpointError(f"checkpoint {source} does not match its config: "
                              f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                              f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}")
    model.load_state_dict(state_dict, assign=True)
    if config.tie_embeddings:  # assign=True replaced the two parameters separately; share them again
        model.output.weight = model.tok_embeddings.weight
    return model


def install_decode_attention(model: Transformer) -> bool:
    """Plug the decode-attention kernel into every Attention of `model` where it applies; True if it did.

    It applies on CUDA (and on CPU under TRITON_INTERPRET=1, where Triton interprets it: tests) for
    a head_dim the kernel supports; elsewhere the model keeps plain PyTorch attention. A decode step
    then makes one kernel call per layer instead of Inductor's SDPA, RoPE and cache-write kernels.
    The kernel's merge counts on per-(row, KV head) counters, reserved here for the model's caches:
    call this after setup_caches and before capturing a CUDA graph, since counters first allocated
    inside a graph's warm-up would land in its memory pool. generate() does so on CUDA.
    """
    from sparse.kernels import decode_attention  # Triton: imported only where it may run

    device = model.tok_embeddings.weight.device
    runs_here = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if not runs_here or not decode_attention.supports(model.config.head_dim):
        return False
    for module in model.modules():
        if isinstance(module, Attention):
            module.decode_attention = decode_attention.decode_attention_with_cache_write
    if model.max_batch_size > 0:
        decode_attention.reserve_arrival_counters(device, model.max_batch_size * model.config.n_local_heads)
    return True


# ---------------------------------------------------------------------------------------------
# Sampling


def kept_logits(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None) -> Tensor:
    """logits [..., V] -> fp32 logits / temperature, with everything outside the top-k / top-p set at -inf.

    top-k keeps the k largest logits; top-p (nucleus) then keeps the smallest set of the most
    likely remaining tokens whose probability mass reaches top_p. Both become one threshold on
    the logits, so values tied with the threshold are all kept.
    """
    logits = logits.float() / temperature
    if top_k is not None or top_p is not None:
        k = logits.shape[-1] if top_k is None else min(top_k, logits.shape[-1])
        # Unsorted unless top-p needs the order: on CUDA the sort is a kernel of its own, and top-k
        # alone needs only the k-th value.
        ranked = torch.topk(logits, k, sorted=top_p is not None).values  # sorted: descending
        if top_p is not None:
            ranked_probs = torch.softmax(ranked, dim=-1)  # renormalised over the top-k, as if top-k ran first
            mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs
            ranked = ranked.masked_fill(mass_before >= top_p, float("inf"))  # mass already reached: drop
        threshold = ranked.min(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None) -> Tensor:
    """logits [..., V] -> the probabilities that `sample` draws from (zero outside the kept set)."""
    return torch.softmax(kept_logits(logits, temperature, top_k, top_p), dim=-1)


def argmax_over_vocab(scores: Tensor, chunks: int = ARGMAX_CHUNKS) -> Tensor:
    """scores.argmax(dim=-1), as a max over each of `chunks` slices of the last dim, then an argmax
    over the slices (see ARGMAX_CHUNKS)."""
    width = -(-scores.shape[-1] // chunks)
    padded = torch.nn.functional.pad(scores, (0, width * chunks - scores.shape[-1]), value=float("-inf"))
    slices = padded.reshape(*scores.shape[:-1], chunks, width)
    best, where = slices.max(dim=-1)  # each slice's first maximum
    chunk = best.argmax(dim=-1, keepdim=True)  # the first slice holding the row's maximum
    return (chunk * slices.shape[-1] + where.gather(-1, chunk)).squeeze(-1)


def sample(logits: Tensor, noise: Optional[Tensor], temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None) -> Tensor:
    """logits [B, V] -> token ids [B]. Temperature 0 is greedy; otherwise `noise` is Exponential(1) [B, V]."""
    if temperature == 0:
        return argmax_over_vocab(logits)
    # The exponential race in log space (see the module docstring); the clamp guards against a zero draw.
    return argmax_over_vocab(kept_logits(logits, temperature, top_k, top_p) - noise.clamp_min(1e-20).log())


def draw_noise(batch_size: int, vocab_size: int, temperature: float, generator, device) -> Optional[Tensor]:
    if temperature == 0:
        return None
    return torch.empty(batch_size, vocab_size, device=device).exponential_(generator=generator)


# ---------------------------------------------------------------------------------------------
# Prefill and decode


def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, noise: Optional[Tensor], **sampling) -> Tensor:
    """Run the whole (left-padded) prompt [B, T] through the model; returns the first new token [B]."""
    logits = model(tokens, input_pos, last_position_only=True)
    return sample(logits[:, -1], noise, **sampling)


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, noise: Optional[Tensor],
                     **sampling) -> Tensor:
    """token [B, 1] at position input_pos [1] -> next token [B]. This is what gets CUDA-graphed."""
    logits = model(token, input_pos)
    return sample(logits[:, -1], noise, **sampling)


_compiled_functions = {}

# With coordinate-descent tuning, Inductor turns batch-1 matmuls (GEMVs) into reductions it
# generates and tunes itself; cuBLAS GEMV is markedly slower on the 4096-wide shapes.
INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True, "fx_graph_cache": True}


def inductor_tuner_clock() -> str:
    """How Inductor's tuner times candidates in this process: 'device' once tune_on_device_clock()
    has wrapped it, else 'events' (CUDA events around Python launches). Benchmarks record it."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return "device" if getattr(CachingAutotuner.bench, "on_device_clock", False) else "events"


def tune_on_device_clock() -> None:
    """Make Inductor's Triton autotuner (CachingAutotuner.bench, every config and coordinate-
    descent candidate it times on a GPU) time with the profiler's device clock.

    Inductor times each candidate with CUDA events around a launch from Python. A decode step's
    kernels are shorter than that launch, so the events time the launch and the picks are noise;
    the profiler's device clock times the kernel alone (Inductor's own do_bench_using_profiling).
    Our SpMV tuner avoids the same trap with CUDA graphs. Process-wide and idempotent; leaves
    Inductor as it is, with a warning, if its bench() no longer takes the with_profiler switch
    this relies on."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    if inductor_tuner_clock() == "device":
        return
    bench = CachingAutotuner.bench
    if "with_profiler" not in inspect.signature(bench).parameters:
        print("warning: this torch's Inductor autotuner has no with_profiler switch; its picks for the "
              "decode step's kernels are timed with Python launches", file=sys.stderr)
        return

    @functools.wraps(bench)
    def bench_on_device_clock(self, launcher, *args, with_profiler=False, **kwargs):
        if with_profiler or self.device_props.type == "cpu":
            return bench(self, launcher, *args, with_profiler=with_profiler, **kwargs)
        try:
            return bench(self, launcher, *args, with_profiler=True, **kwargs)
        except RuntimeError as error:  # e.g. no device records from the profiler (CUPTI unavailable)
            if not bench_on_device_clock.warned:
                bench_on_device_clock.warned = True
                print(f"warning: Inductor's profiler-based timer failed ({error}); such candidates are timed "
                      "with CUDA events around their launch", file=sys.stderr)
            return bench(self, launcher, *args, **kwargs)

    bench_on_device_clock.on_device_clock = True
    bench_on_device_clock.warned = False
    CachingAutotuner.bench = bench_on_device_clock


def compiled(fn, mode: Optional[str] = None, **compile_args):
    """torch.compile(fn, mode=mode, **compile_args) with INDUCTOR_OPTIONS, made once per process and
    reused by every generate() call.

    The options travel with this compile only (Inductor applies them as a config patch while it
    compiles), so importing or calling us leaves torch._inductor.config as the caller set it.
    torch.compile takes `mode` or `options`, not both, so the mode's own options are merged in.
    Inductor's autotuner is switched to the device clock first (tune_on_device_clock), process-wide."""
    key = (fn, mode, tuple(sorted(compile_args.items())))
    if key not in _compiled_functions:
        tune_on_device_clock()
        options = {**(torch._inductor.list_mode_options(mode) if mode else {}), **INDUCTOR_OPTIONS}
        _compiled_functions[key] = torch.compile(fn, options=options, **compile_args)
    return _compiled_functions[key]


@dataclass
class GenerationResult:
    sequences: list  # per row: prompt + generated ids (1-D LongTensor, CPU), cut after the first EOS
    prompt_lengths: list  # per row: tokens of prompt at the start of its sequence
    new_tokens: list  # per row: generated ids only
    prefill_s: float = 0.0  # prompt forward + first token
    decode_s: float = 0.0  # the decode loop, wall clock, synchronised
    decode_steps: int = 0  # one-token forwards run (a batch row each per step)
    step_times_s: list = field(default_factory=list)  # each decode step's time (CUDA events on GPU)


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]):
    """The same rules the CLIs enforce, for callers of the Python API: ValueError naming the argument."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None (off), got {top_k}")
    if top_p is not None and not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None (off), got {top_p}")


@torch.no_grad()
def generate(model: Transformer, prompts: Sequence[Tensor], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, eos_ids=(), seed: Optional[int] = None,
             generator: Optional[torch.Generator] = None, compile: bool = False, compile_prefill: bool = False,
             progress: bool = False, pad_id: int = 0,
             on_tokens: Optional[Callable[[Tensor], Optional[bool]]] = None) -> GenerationResult:
    """Continue each prompt (a list of 1-D token-id tensors, lengths may differ) by up to max_new_tokens.

    Prompts are left-padded into one batch. The KV-cached step t >= 1 feeds generated token t-1
    at position prompt_len + t - 1 of its row, so a row's decode-step positions are
    prompt_len .. len(sequence) - 2. Generation stops when every row has produced one of
    `eos_ids` or after max_new_tokens; it is also cut short where the model's context ends.
    A row that has produced an EOS leaves the batch (its KV cache rows are compacted away), so
    later steps cost only the rows still going; under `compile` the batch keeps its shape for the
    CUDA graph instead, and ended rows keep being fed tokens whose output is cut.

    on_tokens, if given, is called with the ids generated so far ([B, n] on the model's device):
    after the prefill, then every decode step on the CPU but only every EOS_CHECK_INTERVAL steps
    on CUDA, where looking at the ids waits for the GPU (the EOS check already waits there), and
    once at the end. It lets a caller stream text or move a progress bar; the ids are the same.
    If it returns True, generation stops there: the caller has what it wanted (e.g. every row has
    reached one of its stop strings).
    """
    device = model.tok_embeddings.weight.device
    prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("generate() needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    lengths = [len(p) for p in prompts]
    batch_size, prompt_width, context = len(prompts), max(lengths), model.config.block_size
    if prompt_width >= context:
        raise ValueError(f"prompt of {prompt_width} tokens does not fit the model's context of {context} tokens")
    max_new_tokens = min(max_new_tokens, context - prompt_width)

    model.setup_caches(batch_size, prompt_width + max_new_tokens)
    on_cuda = device.type == "cuda"
    if on_cuda:
        install_decode_attention(model)
    pads = [prompt_width - n for n in lengths]
    tokens = torch.stack([torch.cat([torch.full((pad,), pad_id), p]) for p, pad in zip(prompts, pads)]).to(device)

    if generator is None and seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    vocab_size = model.config.vocab_size
    noise = lambda: draw_noise(batch_size, vocab_size, temperature, generator, device)  # noqa: E731
    prefill_fn = compiled(prefill, fullgraph=True, dynamic=True) if compile_prefill else prefill
    decode_fn = decode_one_token
    if compile:
        decode_fn = compiled(decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device) if len(eos_ids) else None
    out = torch.full((batch_size, max_new_tokens), pad_id, dtype=torch.long, device=device)

    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    # One-token attention over the cache is tiny; under compile, the math backend lets Inductor
    # fuse it with its neighbours instead of calling a separate kernel.
    math_attention = sdpa_kernel(SDPBackend.MATH) if compile else contextlib.nullcontext()
    with left_padding(model, pads):
        sync()
        start = time.perf_counter()
        out[:, 0] = prefill_fn(model, tokens, torch.arange(prompt_width, device=device), noise(), **sampling)
        sync()
        prefill_s = time.perf_counter() - start
        if on_tokens is not None:
            on_tokens(out[:, :1])

        input_pos = torch.tensor([prompt_width], dtype=torch.long, device=device)
        # The step's input is a [B, 1] buffer of its own, not a slice of `out`: a slice's stride
        # depends on max_new_tokens, and the compiled step would recompile for every new length.
        token = out[:, :1].clone()
        rows = Batch(model, pads, retire=eos is not None and not compile)
        check_every = EOS_CHECK_INTERVAL if on_cuda else 1  # a look at the ids is free on the CPU
        clock = StepClock(on_cuda)
        start = time.perf_counter()
        steps = 1
        with math_attention:
            for step in _progress(range(1, max_new_tokens), progress):
                if eos is not None and step % check_every == 0:
                    ended = torch.isin(out[rows.ids, :step], eos).any(dim=1)  # the loop's only host sync
                    if bool(ended.all()):
                        break
                    token = rows.retire(ended, token, int(input_pos))
                out[rows.ids, step] = decode_fn(model, token, input_pos, rows.select(noise()), **sampling)
                token.copy_(out[rows.ids, step:step + 1])
                input_pos += 1
                steps += 1
                clock.mark()
                if on_tokens is not None and (not on_cuda or steps % EOS_CHECK_INTERVAL == 0):
                    if on_tokens(out[:, :steps]):
                        break
        sync()
        decode_s = time.perf_counter() - start
        if on_tokens is not None:
            on_tokens(out[:, :steps])

    generated = out[:, :steps].cpu()
    new_tokens = [_cut_after_eos(row, eos_ids) for row in generated]
    return GenerationResult(
        sequences=[torch.cat([p, n]) for p, n in zip(prompts, new_tokens)], prompt_lengths=lengths,
        new_tokens=new_tokens, prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps - 1,
        step_times_s=clock.step_times())


@contextlib.contextmanager
def left_padding(model: Transformer, pads: list):
    """Tell the model how many pad tokens precede each row; leave it unpadded afterwards, since
    other callers (prune/'s teacher-forced passes) run plain forwards on the same model."""
    model.set_left_padding(torch.tensor(pads, device=model.left_pad.device) if any(pads) else None)
    try:
        yield
    finally:
        model.set_left_padding(None)


class StepClock:
    """Marks the end of each decode step without waiting for the GPU: CUDA events there, the host
    clock on CPU (where every op is synchronous anyway)."""

    def __init__(self, on_cuda: bool):
        self.on_cuda, self.marks = on_cuda, []
        self.mark()

    def mark(self):
        if self.on_cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def step_times(self) -> list:
        """Seconds between consecutive marks; call after synchronising."""
        if self.on_cuda:
            return [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


def _progress(steps, show: bool):
    if not show:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="decoding", unit="tok")


class Batch:
    """The rows of `out` still decoding, in the order the model's caches hold them. With `retire`,
    rows that ended are dropped: the live rows' KV cache and left padding move to the front of the
    buffers (which keep their size), and the next step runs on fewer rows."""

    def __init__(self, model: Transformer, pads: list, retire: bool):
        self.model, self.retire_rows = model, retire
        self.ids = slice(None)  # every row, until one retires: a slice keeps the full batch's steps as they were
        self.pads = torch.tensor(pads, device=model.left_pad.device)

    def select(self, noise: Optional[Tensor]) -> Optional[Tensor]:
        """The live rows' share of noise drawn for every row, so a row samples as it would in a full batch."""
        return noise if noise is None else noise[self.ids]

    def retire(self, ended: Tensor, token: Tensor, written: int) -> Tensor:
        """Drop the rows marked `ended` (given that cache slots [0, written) hold data); the live rows' token."""
        if not self.retire_rows or not bool(ended.any()):
            return token
        keep = (~ended).nonzero().flatten()
        if isinstance(self.ids, slice):
            self.ids = torch.arange(len(ended), device=ended.device)
        for layer in self.model.layers:
            cache = layer.attention.kv_cache
            for buffer in (cache.k_cache, cache.v_cache):
                buffer[: len(keep), :, :written] = buffer[keep, :, :written]  # the index makes a copy first
        self.ids, self.pads = self.ids[keep], self.pads[keep]
        self.model.set_left_padding(self.pads if bool(self.pads.any()) else None)
        return token[keep].clone()


def _cut_after_eos(row: Tensor, eos_ids) -> Tensor:
    hits = torch.isin(row, torch.tensor(sorted(eos_ids), dtype=row.dtype)).nonzero() if len(eos_ids) else []
    return row[: int(hits[0]) + 1] if len(hits) else row


# ---------------------------------------------------------------------------------------------
# What a decode step costs


def bytes_read_per_step(model: Transformer, batch_size: int) -> dict:
    """Bytes one decode step reads from memory, by kind.

    weights: every linear (dense weight, or sparse values + masks where the kernels run; on the
    CPU the sparse layers run expanded to dense, so dense-sized), norms and the lm_head in full,
    but only the embedding rows looked up. kv_cache: the KV cache for `batch_size` rows
    over the *whole* allocated length, because the masked SDPA scores every slot and lets the
    mask zero the future ones (like GPT-Fast). On CUDA the decode-attention kernel skips blocks
    of unused slots, so there this is an upper bound.
    """
    weights = batch_size * model.tok_embeddings.weight[0].nbytes
    kv_cache, seen = 0, set()
    for module in model.modules():
        if isinstance(module, KVCache):
            kv_cache += module.k_cache[:batch_size].nbytes + module.v_cache[:batch_size].nbytes
        elif hasattr(module, "bytes_read_per_step"):  # SparseLinear: packed, or expanded on the CPU
            weights += module.bytes_read_per_step()
        # The model's own buffers are RoPE / mask tables (a row of each per step). A tied lm_head
        # is counted in full under model.output, the embedding module itself is skipped.
        elif module is not model and module is not model.tok_embeddings:
            for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
                if id(t) not in seen:
                    seen.add(id(t))
                    weights += t.nbytes
    return {"weights": weights, "kv_cache": kv_cache, "total": weights + kv_cache}


def state_dict_bytes(model: Transformer) -> int:
    """Size of the weights as a checkpoint stores them (shared tensors once)."""
    unique = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    return sum(unique.values())


def peak_memory_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except (CheckpointError, ValueError, FileNotFoundError) as e:  # bad input: a usage error
        if not tp.is_main_process():  # under torchrun every rank meets the same bad input; rank 0 says it
            sys.exit(2)
        cli_args.exit_with_error(e)
    except (OSError, RuntimeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        tp.destroy_process_group()


def parse_args(argv=None):
    p = cli_args.ArgumentParser(description="Generate text with a dense or N:M-sparse checkpoint.")
    p.add_argument("--checkpoint", "--checkpoint_path", dest="checkpoint", type=Path, required=True,
                   help="a .pth checkpoint (dense or packed-sparse), or a folder holding exactly one")
    p.add_argument("--tokenizer", type=Path, help="tokenizer file or folder (default: found beside the checkpoint)")
    p.add_argument("--prompt", default="Hello, my name is", help="text to continue (with --chat: the user's message)")
    p.add_argument("--prompts_file", type=Path, help="one prompt per line; generated together as one batch")
    p.add_argument("--max_new_tokens", type=cli_args.positive_int, default=200, help="tokens generated per prompt at most")
    p.add_argument("--temperature", type=cli_args.temperature, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=cli_args.top_k, default=200, help="tokens kept per step, or 'off'")
    p.add_argument("--top_p", type=cli_args.top_p, default=None, help="nucleus mass kept per step (default: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none; torch's global random generator)")
    p.add_argument("--batch_size", type=cli_args.positive_int, default=1, help="repeat --prompt this many times")
    p.add_argument("--num_samples", type=cli_args.positive_int, default=1, help="times the whole generation is repeated")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat in the terminal")
    p.add_argument("--compile", action="store_true", help="CUDA-graph the decode step (torch.compile)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile the prefill (dynamic shapes)")
    p.add_argument("--device", type=cli_args.device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    return p.parse_args(argv)


def run(args):
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    args.checkpoint = checkpoint_file(args.checkpoint)  # a model's folder names its one .pth
    start = time.perf_counter()
    # Under torchrun (tp.py): each process takes its GPU and its slices of the model, then joins the others.
    args.device = tp.process_device(args.device)
    tp.silence_other_ranks()
    model = load_model(args.checkpoint, args.device, dtype, shard=tp.shard)
    tp.init_process_group(args.device)
    generator = None if args.seed is not None else tp.shared_generator(args.device)
    tokenizer = load_tokenizer(args.tokenizer or find_tokenizer(args.checkpoint))
    print(f"Loaded {args.checkpoint} on {args.device} ({dtype}) in {time.perf_counter() - start:.1f} s", flush=True)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_ids=tokenizer.eos_ids,
                    seed=args.seed, generator=generator, compile=args.compile, compile_prefill=args.compile_prefill)
    if args.interactive:
        return chat_loop(model, tokenizer, args.max_new_tokens, sampling)

    def encode(text):
        if args.chat:
            return tokenizer.encode_chat([{"role": "user", "content": text}])
        ids = tokenizer.encode(text, bos=True)
        if ids:
            return ids
        # An empty prompt starts from BOS, also for models (SmolLM2, Qwen3) whose prompts carry none.
        if tokenizer.bos_id is None:
            raise ValueError("the prompt is empty and the tokenizer has no BOS token to start from")
        return [tokenizer.bos_id]

    if args.prompts_file:
        texts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    else:
        texts = [args.prompt] * args.batch_size  # "" is fine: the model starts from BOS
    prompts = [torch.tensor(encode(t)) for t in texts]
    for i in range(args.num_samples):
        if len(prompts) == 1:  # one row: echo the prompt, then stream the text as it is generated
            print(texts[0], end="\n" if args.chat else "", flush=True)
            stream = TextStream(tokenizer)
            result = generate(model, prompts, args.max_new_tokens, on_tokens=stream, **sampling)
            print(flush=True)
        else:
            result = generate(model, prompts, args.max_new_tokens, progress=not args.compile and tp.is_main_process(),
                              **sampling)
            for row in result.new_tokens:
                print(tokenizer.decode([t for t in row.tolist() if t not in tokenizer.eos_ids]), flush=True)
                print("-" * 40)
        compiled_note = " (includes compilation)" if args.compile and i == 0 else ""
        print(f"sample {i + 1}{compiled_note}:")
        print_stats(model, result, args.device)


class TextStream:
    """generate()'s on_tokens for one row: prints the text of the ids as they grow, up to the first
    EOS. The whole row is decoded each time and only the new end printed, since a token's text can
    depend on its neighbours (a multi-byte character split over two tokens is held back until whole)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.printed = tokenizer, ""

    def __call__(self, tokens: Tensor):
        ids = []
        for t in tokens[0].tolist():
            if t in self.tokenizer.eos_ids:
                break
            ids.append(t)
        text = self.tokenizer.decode(ids)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text


def chat_loop(model, tokenizer, max_new_tokens, sampling):
    """A multi-turn chat: every turn re-encodes the whole conversation with the chat template."""
    if tokenizer.chat_template is None:
        raise ValueError("--interactive needs a model whose tokenizer has a chat template")
    messages = []
    while True:
        try:
            text = tp.input_on_main_process("you> ").strip()
        except EOFError:
            return
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        prompt = torch.tensor(tokenizer.encode_chat(messages))
        result = generate(model, [prompt], max_new_tokens, **sampling)
        reply_ids = [t for t in result.new_tokens[0].tolist() if t not in tokenizer.eos_ids]
        reply = tokenizer.decode(reply_ids)
        print(f"assistant> {reply}")
        print_stats(model, result, model.tok_embeddings.weight.device)
        messages.append({"role": "assistant", "content": reply})


def print_stats(model, result: GenerationResult, device):
    rows, steps = len(result.prompt_lengths), result.decode_steps
    step_bytes = bytes_read_per_step(model, rows)
    if steps:
        per_second = steps / result.decode_s
        # Rows leave the batch at their EOS, so the batch's rate counts the tokens each row kept.
        decoded = sum(len(row) for row in result.new_tokens) - rows  # the first token of each came from the prefill
        print(f"  decode: {steps} steps in {result.decode_s:.2f} s = {per_second:.1f} tok/s per sequence, "
              f"{decoded / result.decode_s:.1f} tok/s over {rows} rows")
        print(f"  bandwidth: {step_bytes['total'] / 1e9:.3g} GB read per step (weights {step_bytes['weights'] / 1e9:.3g}, "
              f"KV cache {step_bytes['kv_cache'] / 1e9:.3g} over all {model.max_seq_length} slots, as the masked "
              f"attention reads them) x {per_second:.1f} steps/s = {step_bytes['total'] * per_second / 1e9:.3g} GB/s")
        if any(getattr(m, "runs_expanded", False) for m in model.modules()):
            print("  (the sparse layers run expanded to dense weights here, without the Triton kernels, so a step "
                  "reads what the dense model's does)")
    print(f"  prefill: {max(result.prompt_lengths)} x {rows} tokens in {result.prefill_s:.3f} s")
    print(f"  peak memory: {peak_memory_bytes(device) / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
