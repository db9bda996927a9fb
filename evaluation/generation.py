"""The model-facing glue every evaluation shares: load a checkpoint with its tokenizer, turn text
prompts into greedy replies, and run a teacher-forced forward pass.

Built on the engine's contracts: generate.load_model / generate.generate and tokenizer.py.
"""
import argparse
from typing import Callable

import torch

import cli_args
from checkpoint import CheckpointError
from model import Transformer

# What bad user input raises in the evaluation code; the CLIs turn these into one error line.
USER_ERRORS = (FileNotFoundError, ValueError, KeyError, CheckpointError)


def load_model(checkpoint, device="cpu", dtype=torch.float32) -> Transformer:
    import generate  # imported here so the metric modules stay usable without the engine

    return generate.load_model(checkpoint, device, dtype)


def load_model_and_tokenizer(checkpoint, device="cpu", dtype=torch.float32):
    from tokenizer import find_tokenizer, load_tokenizer

    return load_model(checkpoint, device, dtype), load_tokenizer(find_tokenizer(checkpoint))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Chat models get their chat template (one user turn); base models the raw text after BOS."""
    if tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text, bos=True)


# Padded prompt tokens one batch may prefill: the CPU's attention holds rows x heads x T x T scores,
# so one long prompt (MBPP has one of 3753 tokens) must not set the width of a whole batch.
PREFILL_TOKEN_BUDGET = 16384


def length_batches(lengths: list[int], batch_size: int, token_budget: int = PREFILL_TOKEN_BUDGET) -> list[list[int]]:
    """Prompt indices in batches of similar lengths, shortest first: at most batch_size rows and, past
    the first row, at most token_budget padded tokens (rows x the batch's longest prompt)."""
    batches, current = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) == batch_size or (len(current) + 1) * lengths[i] > token_budget):
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def greedy_token_ids(model: Transformer, prompt_ids: list[list[int]], max_new_tokens: int, eos_ids=(),
                     batch_size: int = 8, progress: bool = True) -> list[list[int]]:
    """Greedy generated ids (prompt excluded, cut after the first EOS) for each prompt, in the
    prompts' order. Batches are made of prompts of similar lengths (length_batches): a batch is
    left-padded to its longest prompt, and the padding costs as much to prefill as real tokens."""
    import generate

    out = [None] * len(prompt_ids)
    for rows in length_batches([len(p) for p in prompt_ids], batch_size):
        batch = [torch.tensor(prompt_ids[i], dtype=torch.long) for i in rows]
        result = generate.generate(model, batch, max_new_tokens, temperature=0.0, eos_ids=eos_ids, progress=progress)
        for i, new in zip(rows, result.new_tokens):
            out[i] = new.tolist()
    return out


def make_generate_fn(model, tokenizer, max_new_tokens: int, batch_size: int = 8) -> Callable[[list[str]], list[str]]:
    def generate_fn(prompts: list[str]) -> list[str]:
        ids = [encode_prompt(tokenizer, p) for p in prompts]
        new = greedy_token_ids(model, ids, max_new_tokens, tuple(tokenizer.eos_ids), batch_size)
        return [tokenizer.decode([t for t in seq if t not in tokenizer.eos_ids]) for seq in new]
    return generate_fn


def load_generate_fn(checkpoint, device="cpu", max_new_tokens=512, batch_size=8):
    model, tokenizer = load_model_and_tokenizer(checkpoint, device)
    return make_generate_fn(model, tokenizer, max_new_tokens, batch_size)


@torch.no_grad()  # not inference_mode: caches allocated here must stay usable by generate()
def forward_logits(model: Transformer, idx: torch.Tensor, compile: bool = False) -> torch.Tensor:
    """Teacher-forced logits [B, T, vocab] (fp32) for token ids idx [B, T], all positions at once.
    compile: through torch.compile (dynamic shapes, made once per process: generate.compiled)."""
    B, T = idx.shape
    model.setup_caches(max(B, model.max_batch_size), max(T, model.max_seq_length))
    model.set_left_padding(None)
    device = model.tok_embeddings.weight.device
    run = call_model
    if compile:
        import generate
        run = generate.compiled(call_model, fullgraph=True, dynamic=True)
    return run(model, idx.to(device), torch.arange(T, device=device)).float()


def call_model(model: Transformer, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(idx, input_pos)


def add_generation_args(parser: argparse.ArgumentParser, max_new_tokens: int, batch_size: int):
    """The flags every task CLI shares: which model, how much to generate, where to write. Budgets
    are checked as they are parsed (cli_args), before a model is loaded."""
    parser.add_argument("--checkpoint", help="model checkpoint (dense or packed-sparse)")
    parser.add_argument("--limit", type=cli_args.positive_int, help="first N items only")
    parser.add_argument("--max_new_tokens", type=cli_args.positive_int, default=max_new_tokens)
    parser.add_argument("--batch_size", type=cli_args.positive_int, default=batch_size)
    parser.add_argument("--device", type=cli_args.device, default="cpu")
    parser.add_argument("--out", help="write detailed results as JSON")


def run_cli(evaluate_fn, summary_fn, out_path):
    """Run an evaluation, print its one-line summary, write its JSON; bad input exits 2 with one line."""
    try:
        result = evaluate_fn()
    except USER_ERRORS as e:
        cli_args.exit_with_error(e)
    print(summary_fn(result))
    if out_path:
        from evaluation.data import write_json_atomic
        write_json_atomic(out_path, result)
    return result
