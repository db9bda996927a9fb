"""Decode fidelity: how closely a pruned model follows the dense model along the dense model's own
free-running (greedy) generations on held-out prompts - the text the paper cares about.

Both models are run teacher-forced over prompt + dense generation. At each decode step t (the
position that predicts generated token t) we compare the next-token distributions:
- KL(dense || pruned), in nats, per token;
- top-1 agreement: both models' argmax tokens are the same;
- tokens to divergence: the first t at which the pruned model's argmax differs from the dense
  token. Both decode greedily and agree on every earlier token, so this is exactly where the pruned
  model's own greedy output would first leave the dense one; a sequence that never diverges counts
  its full length (censored; `never_diverged` says how often).

CLI: python -m evaluation.fidelity --dense dense.pth --pruned pruned.pth [--prompts FILE] [--limit 20]
         [--max_new_tokens 256] [--out fidelity.json]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from tqdm import tqdm

from evaluation.data import data_path, read_prompts
from evaluation.generation import (encode_prompt, forward_logits, greedy_token_ids, load_model,
                                   load_model_and_tokenizer, run_cli)


def step_metrics(dense_logits: torch.Tensor, pruned_logits: torch.Tensor, dense_tokens: torch.Tensor) -> dict:
    """dense/pruned_logits [T, vocab] at the T decode steps; dense_tokens [T] the dense model's choices."""
    log_p = F.log_softmax(dense_logits.double(), dim=-1)
    log_q = F.log_softmax(pruned_logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)  # clamp: rounding can make ~0 slightly negative
    pruned_choice = pruned_logits.argmax(-1)
    agree = dense_logits.argmax(-1) == pruned_choice
    departs = (pruned_choice != dense_tokens.to(pruned_choice.device)).nonzero()
    divergence = int(departs[0, 0]) if len(departs) else len(dense_tokens)
    return {"kl": kl.cpu(), "top1_agree": agree.cpu(), "tokens_to_divergence": divergence,
            "diverged": bool(len(departs))}


def summarize(per_sequence: list[dict]) -> dict:
    """Token-weighted KL and agreement; divergence averaged over sequences; KL per decode step."""
    kl = torch.cat([s["kl"] for s in per_sequence])
    agree = torch.cat([s["top1_agree"] for s in per_sequence]).double()
    divergence = [s["tokens_to_divergence"] for s in per_sequence]
    longest = max(len(s["kl"]) for s in per_sequence)
    kl_by_step = []
    for t in range(longest):
        at_t = [float(s["kl"][t]) for s in per_sequence if len(s["kl"]) > t]
        kl_by_step.append(sum(at_t) / len(at_t))
    return {"kl": kl.mean().item(), "top1_agreement": agree.mean().item(),
            "tokens_to_divergence_mean": statistics.mean(divergence),
            "tokens_to_divergence_median": statistics.median(divergence),
            "never_diverged": sum(not s["diverged"] for s in per_sequence) / len(per_sequence),
            "decode_tokens": len(kl), "sequences": len(per_sequence), "kl_by_step": kl_by_step}


def decode_fidelity(dense_model, pruned_model, references: list[tuple[list[int], list[int]]], progress=True) -> dict:
    """references: (prompt ids, dense greedy generation ids) pairs, e.g. from dense_references()."""
    per_sequence = []
    for prompt, generated in tqdm(references, desc="decode fidelity", disable=not progress, leave=False):
        if not generated:
            continue
        idx = torch.tensor([prompt + generated])
        steps = slice(len(prompt) - 1, len(prompt) + len(generated) - 1)  # positions predicting generated tokens
        dense = forward_logits(dense_model, idx)[0, steps]
        pruned = forward_logits(pruned_model, idx)[0, steps]
        per_sequence.append(step_metrics(dense, pruned, torch.tensor(generated)))
    if not per_sequence:
        raise ValueError("every dense reference generation is empty; nothing to compare")
    return summarize(per_sequence)


def dense_references(dense_model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 8):
    """The dense model's greedy generations: [(prompt ids, generated ids without EOS)]."""
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    generated = greedy_token_ids(dense_model, prompt_ids, max_new_tokens, tuple(tokenizer.eos_ids), batch_size)
    return [(p, [t for t in g if t not in tokenizer.eos_ids]) for p, g in zip(prompt_ids, generated)]


def main():
    parser = argparse.ArgumentParser(description="Decode fidelity of a pruned checkpoint against its dense source.")
    parser.add_argument("--dense", required=True, help="dense checkpoint")
    parser.add_argument("--pruned", required=True, help="pruned checkpoint (packed or dense-zeros)")
    parser.add_argument("--prompts", help="held-out prompts, .jsonl or .txt (default: shared longbench_write_en.jsonl)")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out")
    args = parser.parse_args()

    def run():
        prompts = read_prompts(args.prompts or data_path("longbench_write_en.jsonl"))[: args.limit]
        dense, tokenizer = load_model_and_tokenizer(args.dense, args.device)
        pruned = load_model(args.pruned, args.device)
        return decode_fidelity(dense, pruned, dense_references(dense, tokenizer, prompts, args.max_new_tokens,
                                                               args.batch_size))

    run_cli(run, lambda r: f"KL(dense||pruned) {r['kl']:.4f} nats/token | top-1 agreement {r['top1_agreement']:.4f} | "
                           f"tokens to divergence mean {r['tokens_to_divergence_mean']:.1f}, median "
                           f"{r['tokens_to_divergence_median']:.1f} | {r['decode_tokens']} decode tokens", args.out)


if __name__ == "__main__":
    main()
