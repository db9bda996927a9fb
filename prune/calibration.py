"""Calibration data: which token sequences the pruned model is fitted on, and which positions count.

Sources (SOURCES; each counts the same budget of tokens, so they differ only in what is counted):
- text: teacher-forced windows of L tokens (the C4 baseline of SparseGPT and Wanda) cut from a
  local jsonl/txt corpus, or from a C4 shard on the hub when online. Every position counts.
- decode (the paper's method): the dense model generates continuations of a prompt set with
  generate.generate(), in the model's chat template, and only the *decode-step* positions count:
  positions prompt_len .. len(sequence) - 2, the tokens the KV-cached decode fed back. The prompt
  is what the user wrote; what the sparse model must reproduce is the decode.
- decode_first: the same sequences and decode positions, plus each sequence's first position
  (the attention sink; CalibrationSet.with_first_positions).
- generated: the same generated sequences with every position counted, prompt included, cut at
  the budget (CalibrationSet.with_every_position): against decode it isolates the prompt rule.
- reference: teacher-forced human text of the prompts' domain: each prompt in the chat template
  followed by its reference answer where the prompt file has one (MBPP's solutions), every
  position counted: against decode it isolates self-generated vs human text, against text the
  domain.
- cross-model: decode with generations from another checkpoint with the same tokenizer (the
  generator model is passed in; nothing here depends on which model it is).

Every set records its mix (CalibrationSet.mix): counted tokens per domain (the prompt file's
`domain` field, or the corpus' name) and how many of them are prompt positions.

Replay: a causal model run teacher-forced over prompt + generation computes, at every position,
the same layer inputs the KV-cached decode computed when it fed that token (attention sees the
same prefix either way). So the layer-by-layer protocol of SparseGPT/Wanda runs unchanged on the
replayed sequences, with the `counted` mask selecting which positions enter the statistics.

InputStatistics accumulates, per linear-layer input, Σ x xᵀ over the counted positions; SparseGPT
uses H = 2 X X^T / n, Wanda the diagonal (||X_j||^2), so every backend prunes from the same
calibration pass.
"""
import gzip
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

C4_SHARD = ("allenai/c4", "en/c4-train.00000-of-01024.json.gz")
PROMPT_FIELDS = ("prompt", "input", "text")
REFERENCE_FIELDS = ("reference", "answer", "code")  # a human-written answer to the prompt (MBPP: code)
# python -m prune --calib names: teacher-forced corpus, then the four prompt-based sources.
SOURCES = ("text", "decode", "decode_first", "generated", "reference")
DECODE_SOURCES = ("decode", "decode_first", "generated")  # derived from one generation


class CalibrationError(Exception):
    """Calibration data that cannot be produced; the message says what is missing."""


@dataclass
class CalibrationSet:
    sequences: list  # 1-D LongTensors of token ids
    counted: list  # 1-D bool tensors, one per sequence: positions whose layer inputs enter the statistics
    info: dict = field(default_factory=dict)  # source description, stored in the checkpoint's metadata
    domains: list = None  # per sequence: the domain of its prompt or corpus (default: info's kind)
    prompt_lengths: list = None  # per sequence: how many leading positions are the prompt (default 0)

    def __post_init__(self):
        if self.domains is None:
            self.domains = [self.info.get("kind", "text")] * len(self.sequences)
        if self.prompt_lengths is None:
            self.prompt_lengths = [0] * len(self.sequences)

    @property
    def counted_tokens(self) -> int:
        return sum(int(c.sum()) for c in self.counted)

    def mix(self) -> dict:
        """What the counted tokens are: {"counted_tokens": N, "domains": {domain: {"tokens": n,
        "prompt_tokens": p}}}, p of the n at prompt positions (the rest generated, reference or
        corpus text)."""
        domains = {}
        for counted, domain, prompt_len in zip(self.counted, self.domains, self.prompt_lengths, strict=True):
            entry = domains.setdefault(domain, {"tokens": 0, "prompt_tokens": 0})
            entry["tokens"] += int(counted.sum())
            entry["prompt_tokens"] += int(counted[:prompt_len].sum())
        return {"counted_tokens": self.counted_tokens, "domains": domains}

    def _recounted(self, counted: list, sequences=None, **info) -> "CalibrationSet":
        n = len(counted)
        return CalibrationSet(sequences or self.sequences[:n], counted, dict(self.info, **info), self.domains[:n],
                              self.prompt_lengths[:n])

    def with_first_positions(self) -> "CalibrationSet":
        """The same set with each sequence's first position counted too. Decode-only statistics
        never see that position, yet models with an attention sink write a massive activation
        there that every decode step attends to (its keys and values come from the pruned
        prefill): on SmolLM2 a 2:4 mask that ignores it can break the sink and collapse the model
        (docs/RESULTS.md). One position per sequence, so the budget barely moves."""
        counted = [c.clone() for c in self.counted]
        for c in counted:
            c[:1] = True
        return self._recounted(counted, kind="decode_first", first_position_counted=True)

    def with_every_position(self, n_tokens: int) -> "CalibrationSet":
        """The same sequences, in order, with every position counted (prompt included) until n_tokens
        are counted: the last sequence kept is cut there, later ones dropped. A decode set holds
        n_tokens decode positions plus its prompts, so this fits the same budget into a prefix of the
        same text."""
        sequences, counted, total = [], [], 0
        for sequence in self.sequences:
            if total == n_tokens:
                break
            sequence = sequence[:n_tokens - total]
            sequences.append(sequence)
            counted.append(torch.ones(len(sequence), dtype=torch.bool))
            total += len(sequence)
        return self._recounted(counted, sequences, kind="generated", every_position_counted=True)

    def padded_batches(self, max_tokens: int):
        """(tokens [B, T], counted [B, T]) batches of similar-length sequences, right-padded, each
        at most max_tokens in B·T (one sequence at least). Right padding is harmless under causal
        attention: real tokens never see the pad after them, and pad positions never count."""
        order = sorted(range(len(self.sequences)), key=lambda i: len(self.sequences[i]))
        batches, group = [], []
        for i in order:
            if group and (len(group) + 1) * len(self.sequences[i]) > max_tokens:
                batches.append(self._pad(group))
                group = []
            group.append(i)
        if group:
            batches.append(self._pad(group))
        return batches

    def _pad(self, indices):
        T = max(len(self.sequences[i]) for i in indices)
        tokens = torch.zeros(len(indices), T, dtype=torch.long)
        counted = torch.zeros(len(indices), T, dtype=torch.bool)
        for row, i in enumerate(indices):
            n = len(self.sequences[i])
            tokens[row, :n], counted[row, :n] = self.sequences[i], self.counted[i]
        return tokens, counted


class InputStatistics:
    """H = 2/n · Σ x xᵀ over the counted positions of one linear layer's input.

    The running sum Σ x xᵀ is kept unnormalized in the accumulator's dtype (float32 by default;
    at 1M tokens of activations up to ~1e4 it stays far from float32's range). On CUDA, bf16/fp16
    inputs are multiplied on the tensor cores with float32 accumulation and a float32 result:
    bf16 values are exact in that product, so nothing is lost against an fp32 matmul, which would
    run on the CUDA cores: for an 8B model, X^T X over 1M tokens is ~16 PFLOP, minutes in fp32 and
    seconds on tensor cores.
    """

    def __init__(self, n_features: int, device=None, dtype=torch.float32):
        self.sum = torch.zeros(n_features, n_features, device=device, dtype=dtype)
        self.n_tokens = 0

    def add(self, x: Tensor, counted: Tensor):
        x = x[counted]  # [t, in]: only the positions that count
        if x.shape[0] == 0:
            return
        self.n_tokens += x.shape[0]
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.sum.dtype == torch.float32:
            self.sum += torch.mm(x.T, x, out_dtype=torch.float32)
        else:
            x = x.to(self.sum.dtype)
            self.sum.addmm_(x.T, x)

    @property
    def hessian(self) -> Tensor:
        return self.sum * (2 / max(self.n_tokens, 1))

    @property
    def squared_norms(self) -> Tensor:
        """Σ over counted tokens of x_j², per input feature (Wanda's ||X_j||²)."""
        return torch.diagonal(self.sum).clone()


# ---------------------------------------------------------------------------- reading files

def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _is_jsonl(path: Path) -> bool:
    return ".jsonl" in path.suffixes or path.name.endswith(".json.gz")


def _read_jsonl_field(path: Path, fields) -> list:
    texts = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationError(f"{path}:{line_no} is not valid JSON ({e.msg})") from None
            text = next((record[k] for k in fields if isinstance(record.get(k), str)), None)
            if text is None:
                raise CalibrationError(f"{path}:{line_no} has none of the fields {', '.join(fields)}")
            texts.append(text)
    return texts


def read_prompts(path) -> list:
    """Prompts from a jsonl(.gz) file (field prompt, input or text) or a text file (one per line)."""
    return [row["prompt"] for row in read_prompt_rows(path)]


def read_prompt_rows(path) -> list:
    """[{"prompt", "domain", "reference"}] from a prompt file: a jsonl(.gz) row's prompt (field
    prompt, input or text), its `domain` (default: the file's name) and its reference answer (field
    reference, answer or code; None where absent); a text file's lines, with no references."""
    path = Path(path)
    prompts = _read_texts(path, PROMPT_FIELDS, "prompt file")
    if not prompts:
        raise CalibrationError(f"no prompts in {path}")
    default_domain = path.name.split(".")[0]
    if not _is_jsonl(path):
        return [dict(prompt=p, domain=default_domain, reference=None) for p in prompts]
    with _open_text(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [dict(prompt=p, domain=str(r.get("domain") or default_domain),
                 reference=next((r[k] for k in REFERENCE_FIELDS if isinstance(r.get(k), str)), None))
            for p, r in zip(prompts, records, strict=True)]


def prompt_digest(prompt: str) -> str:
    """A short fingerprint of a prompt (surrounding whitespace ignored), recorded in a pruned
    checkpoint so an evaluation can refuse prompts the model was calibrated on."""
    return hashlib.sha256(prompt.strip().encode("utf-8")).hexdigest()[:16]


def read_documents(path) -> list:
    """Documents from a jsonl(.gz) file (field text) or a text file, one per non-empty line (a
    paragraph: text_windows then tokenizes only as many as its budget needs, not a whole corpus)."""
    return _read_texts(path, ("text",), "text file")


def _read_texts(path, fields, what: str) -> list:
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{what} not found: {path}")
    if _is_jsonl(path):
        return _read_jsonl_field(path, fields)
    with _open_text(path) as f:
        return [line.strip() for line in f if line.strip()]


def download_c4_shard() -> Path:
    """The first C4 train shard from the hub (cached by huggingface_hub); a clear error offline."""
    try:
        from huggingface_hub import hf_hub_download
        return Path(hf_hub_download(C4_SHARD[0], C4_SHARD[1], repo_type="dataset"))
    except Exception as e:  # offline, no huggingface_hub, gated: all mean "use a local file"
        raise CalibrationError(f"cannot download {C4_SHARD[0]}/{C4_SHARD[1]} ({type(e).__name__}); "
                               f"pass a local file with --text, e.g. c4_sample.jsonl") from None


# ---------------------------------------------------------------------------- sources

def text_windows(tokenizer, path, n_tokens: int, window_len: int, seed: int) -> CalibrationSet:
    """ceil(n_tokens / window_len) non-overlapping windows of window_len tokens, drawn at random
    (seeded) from the documents in shuffled order, every position counted."""
    documents = read_documents(path)
    n_windows = math.ceil(n_tokens / window_len)
    generator = torch.Generator().manual_seed(seed)
    stream = []
    for i in torch.randperm(len(documents), generator=generator).tolist():
        stream.extend(tokenizer.encode(documents[i], bos=True))
        if len(stream) >= 2 * n_windows * window_len:  # twice the need leaves room to pick from
            break
    n_slots = len(stream) // window_len
    if n_slots < n_windows:
        raise CalibrationError(f"{path} holds {len(stream)} tokens, fewer than the {n_windows} x {window_len} "
                               f"calibration windows asked for")
    slots = torch.randperm(n_slots, generator=generator)[:n_windows].sort().values.tolist()
    stream = torch.tensor(stream, dtype=torch.long)
    sequences = [stream[s * window_len:(s + 1) * window_len] for s in slots]
    counted = [torch.ones(window_len, dtype=torch.bool) for _ in sequences]
    info = dict(kind="text", text_file=str(path), windows=n_windows, window_len=window_len, seed=seed)
    return CalibrationSet(sequences, counted, info, domains=[Path(path).name.split(".")[0]] * len(sequences))


def encode_prompt(tokenizer, text: str) -> list:
    """The prompt as the model sees it in use: its chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text, bos=True)


def decode_calibration(model, tokenizer, prompts: list, n_tokens: int, max_new_tokens: int, domains=None,
                       **options) -> CalibrationSet:
    """Decoding-aware calibration on prompt texts, each in the model's chat template (see
    generation_calibration for the options)."""
    encoded = [torch.tensor(encode_prompt(tokenizer, p), dtype=torch.long) for p in prompts]
    return generation_calibration(model, encoded, n_tokens, max_new_tokens, domains=domains,
                                  eos_ids=tuple(getattr(tokenizer, "eos_ids", ())), **options)


def reference_calibration(tokenizer, rows: list, n_tokens: int) -> CalibrationSet:
    """Teacher-forced human text of the prompts' domain: for each row of read_prompt_rows, in file
    order, the prompt in the chat template (as decode calibration feeds it) followed by its reference
    answer where it has one, every position counted, until n_tokens are counted (the last sequence
    cut there). Each prompt is read once: repeating text would only reweight it."""
    sequences, domains, prompt_lengths, total = [], [], [], 0
    for row in rows:
        if total == n_tokens:
            break
        prompt = encode_prompt(tokenizer, row["prompt"])
        answer = tokenizer.encode(row["reference"]) if row["reference"] else []
        sequence = torch.tensor(prompt + answer, dtype=torch.long)[:n_tokens - total]
        sequences.append(sequence)
        domains.append(row["domain"])
        prompt_lengths.append(min(len(prompt), len(sequence)))
        total += len(sequence)
    if total < n_tokens:
        raise CalibrationError(f"the {len(rows)} prompts and their references hold {total} tokens, fewer than "
                               f"the {n_tokens} asked for")
    counted = [torch.ones(len(s), dtype=torch.bool) for s in sequences]
    info = dict(kind="reference", prompts=len(rows), references=sum(row["reference"] is not None for row in rows),
                sequences_with_reference=sum(row["reference"] is not None for row in rows[:len(sequences)]))
    return CalibrationSet(sequences, counted, info, domains, prompt_lengths)


def generation_calibration(model, prompts: list, n_tokens: int, max_new_tokens: int, *, domains=None, eos_ids=(),
                           temperature: float = 0.7, top_k=20, top_p=0.8, seed: int = 0, batch_size: int = 16,
                           compile: bool = False) -> CalibrationSet:
    """Generate with `model` from `prompts` (1-D token-id tensors) until n_tokens decode steps
    are collected (cycling through the prompts, each batch with a fresh seed), counting only
    decode-step positions. The last sequence is cut so the count is exact. Greedy decoding would
    repeat itself, so it stops after one pass over the prompts.

    With compile=True every generate() call has the same shape (batch_size rows, max_new_tokens
    steps, one KV cache sized for the longest prompt up front), so the CUDA-graphed decode step is
    compiled once: a new batch size or cache length, or even a shorter output buffer (its stride
    is part of the compiled step's guards), would recompile it (minutes for an 8B model). Rows and
    steps past what is needed are generated and dropped, which costs little next to a compile.
    Without compile a batch is no larger, and runs no longer, than the remaining budget needs.
    `domains` (one per prompt) label each sequence by its prompt's domain (default "prompts")."""
    from generate import generate  # imported here: text calibration must not need the generation stack
    if max_new_tokens < 2:
        raise CalibrationError("decode calibration needs max_new_tokens >= 2 (the first token comes from the prefill)")
    greedy = temperature == 0
    if compile:
        longest = max(len(p) for p in prompts)
        model.setup_caches(batch_size, min(model.config.block_size, longest + max_new_tokens))
    domains = domains or ["prompts"] * len(prompts)
    sequences, counted, sequence_domains, prompt_lengths, total = [], [], [], [], 0
    started, n_batches, empty_batches = 0, 0, 0  # started: prompts generated so far, counting repeats
    progress = tqdm(total=n_tokens, desc="decode calibration", unit="tok")
    eos = torch.tensor(sorted(eos_ids), device=next(model.parameters()).device)  # made once, read by show_progress
    while total < n_tokens:
        if greedy and started == len(prompts):
            tqdm.write(f"greedy decoding of {len(prompts)} prompts gave {total} decode tokens, fewer than "
                       f"{n_tokens}; sampling (or more prompts) would give more")
            break
        remaining = n_tokens - total
        # Rows whose output is kept; no more than the remaining budget (or a greedy pass) can use.
        useful = min(batch_size, math.ceil(remaining / (max_new_tokens - 1)),
                     len(prompts) - started if greedy else batch_size)
        size = batch_size if compile else useful
        # Nor more steps than that budget needs (sequences may still end early at EOS).
        steps = max_new_tokens if compile else min(max_new_tokens, math.ceil(remaining / useful) + 1)
        indices = [(started + j) % len(prompts) for j in range(size)]
        batch = [prompts[i] for i in indices]
        started += useful

        def show_progress(tokens, total_before=total, budget=remaining, rows=useful):
            # While the batch runs: its kept rows' decode steps so far, each row up to its first EOS
            # (a bar that counted ended rows would overshoot, then fall back when the batch ends).
            kept = tokens[:rows]
            lengths = torch.full((kept.shape[0], ), kept.shape[1], device=kept.device)
            if eos_ids:
                is_eos = torch.isin(kept, eos)
                lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, lengths)
            progress.n = total_before + min(budget, int((lengths - 1).sum()))
            progress.update(0)  # redraws at tqdm's usual pace, not every step

        result = generate(model, batch, steps, temperature=temperature, top_k=top_k, top_p=top_p,
                          eos_ids=eos_ids, seed=seed + n_batches, compile=compile, on_tokens=show_progress)
        n_batches += 1
        total_before = total
        for sequence, prompt_len, index in list(zip(result.sequences, result.prompt_lengths, indices))[:useful]:
            # Decode steps fed positions prompt_len .. len-2; the last token was never fed back.
            n_decode = min(len(sequence) - 1 - prompt_len, n_tokens - total)
            if n_decode <= 0:
                continue
            sequence = sequence[:prompt_len + n_decode].cpu()
            is_decode = torch.zeros(len(sequence), dtype=torch.bool)
            is_decode[prompt_len:] = True
            sequences.append(sequence)
            counted.append(is_decode)
            sequence_domains.append(domains[index])
            prompt_lengths.append(int(prompt_len))
            total += n_decode
        progress.n = total
        progress.refresh()
        empty_batches = empty_batches + 1 if total == total_before else 0
        if empty_batches * batch_size >= len(prompts) + batch_size:
            tqdm.write(f"stopping at {total} decode tokens: a whole pass over the prompts gave none (all ended at once)")
            break
    progress.close()
    if total == 0:
        raise CalibrationError("generation produced no decode tokens (every prompt ended at once)")
    sampling = dict(greedy=True) if temperature == 0 else dict(temperature=temperature, top_k=top_k, top_p=top_p)
    info = dict(kind="decode", decode_tokens=total, sequences=len(sequences), prompts=len(prompts),
                max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, batch_size=batch_size)
    return CalibrationSet(sequences, counted, info, sequence_domains, prompt_lengths)


def from_decode(calibration: CalibrationSet, source: str, n_tokens: int) -> CalibrationSet:
    """One of the DECODE_SOURCES from a decode set of n_tokens decode positions, on its very
    sequences: decode as it is, decode_first with the first positions, generated every position."""
    if source == "decode":
        return calibration
    if source == "decode_first":
        return calibration.with_first_positions()
    if source == "generated":
        return calibration.with_every_position(n_tokens)
    raise ValueError(f"'{source}' is not made from generations (expected one of {', '.join(DECODE_SOURCES)})")


def mix_label(mixes: list) -> str:
    """'code 69% · writing 31%; prompt 0%': each domain's share of the counted tokens and the share
    at prompt positions, of CalibrationSet.mix() records (means over several, e.g. seeds)."""
    domains = sorted({d for mix in mixes for d in mix["domains"]})
    share = {d: sum(mix["domains"].get(d, {"tokens": 0})["tokens"] / mix["counted_tokens"] for mix in mixes) / len(mixes)
             for d in domains}
    prompt = sum(sum(e["prompt_tokens"] for e in mix["domains"].values()) / mix["counted_tokens"]
                 for mix in mixes) / len(mixes)
    return " · ".join(f"{d} {share[d]:.0%}" for d in domains) + f"; prompt {prompt:.0%}"


def prompt_file_record(path, rows: list) -> dict:
    """What a calibration records about its prompt file: where it was and each prompt's digest."""
    return dict(prompt_file=str(path), prompt_sha256=[prompt_digest(row["prompt"]) for row in rows])
