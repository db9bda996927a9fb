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

With the prompts' domains (e.g. writing and code) every metric is also reported per domain, as
`<metric>_<domain>`.

CLI: python -m evaluation.fidelity --dense dense.pth --pruned pruned.pth [--prompts FILE] [--limit N]
         [--max_new_tokens 256] [--out fidelity.json]
Without --prompts it evaluates evaluation.compare's held-out prompts (writing and code), none of which
any of its calibrations reads; prompts the pruned checkpoint records as calibration prompts are
refused before any work.
"""
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import cli_args
from checkpoint import load_checkpoint
from evaluation.data import count_to_evaluate, prompt_rows, read_jsonl, read_prompts, refuse_overlap
from evaluation.generation import (encode_prompt, forward_logits, greedy_token_ids, load_model,
                                   load_model_and_tokenizer, run_cli)


def step_metrics(dense_logits: torch.Tensor, pruned_logits: torch.Tensor, dense_tokens: torch.Tensor) -> dict:
    """dense/pruned_logits [T, vocab] at the T decode steps; dense_tokens [T] the dense model's choices."""
    log_p = F.log_softmax(dense_logits.double(), dim=-1)
    log_q = F.log_softmax(pruned_logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)  # clamp: rounding can make ~0 slightly negative
    dense_choice, pruned_choice = dense_logits.argmax(-1), pruned_logits.argmax(-1)
    dense_tokens = dense_tokens.to(pruned_choice.device)
    departs = (pruned_choice != dense_tokens).nonzero()
    divergence = int(departs[0, 0]) if len(departs) else len(dense_tokens)
    # The references come from batched KV-cached decoding, the logits from one unpadded forward:
    # near-ties can flip between the two, so how often the dense model re-picks its own token is kept.
    return {"kl": kl.cpu(), "top1_agree": (dense_choice == pruned_choice).cpu(), "tokens_to_divergence": divergence,
            "diverged": bool(len(departs)), "dense_self_agree": (dense_choice == dense_tokens).cpu()}


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
            "dense_self_agreement": torch.cat([s["dense_self_agree"] for s in per_sequence]).double().mean().item(),
            "decode_tokens": len(kl), "sequences": len(per_sequence), "kl_by_step": kl_by_step}


def decode_step_logits(model, references) -> list[torch.Tensor]:
    """Teacher-forced logits [len(generated), vocab] at the decode steps of each (prompt, generated) pair."""
    rows = []
    for prompt, generated in tqdm(references, desc="teacher-forced logits", leave=False):
        steps = slice(len(prompt) - 1, len(prompt) + len(generated) - 1)  # positions predicting generated tokens
        rows.append(forward_logits(model, torch.tensor([prompt + generated]))[0, steps])
    return rows


DOMAIN_METRICS = ("kl", "top1_agreement", "tokens_to_divergence_mean", "decode_tokens", "sequences")


def decode_fidelity(dense_model, pruned_model, references: list[tuple[list[int], list[int]]],
                    dense_logits: list[torch.Tensor] | None = None, domains: list[str] | None = None) -> dict:
    """references: (prompt ids, dense greedy generation ids) pairs, e.g. from dense_references().
    dense_logits: decode_step_logits(dense_model, references), when already computed (a grid of
    pruned models compares against the same dense model). domains: one per reference; the summary
    then also holds DOMAIN_METRICS per domain as `<metric>_<domain>`."""
    domains = domains or [None] * len(references)
    kept = [(r, d) for r, d in zip(references, domains, strict=True) if r[1]]
    if not kept:
        raise ValueError("every dense reference generation is empty; nothing to compare")
    references, domains = [r for r, _ in kept], [d for _, d in kept]
    if dense_logits is None:
        dense_logits = decode_step_logits(dense_model, references)
    pruned_logits = decode_step_logits(pruned_model, references)
    per_sequence = [step_metrics(d, p, torch.tensor(generated))
                    for d, p, (_, generated) in zip(dense_logits, pruned_logits, references, strict=True)]
    summary = summarize(per_sequence)
    for domain in dict.fromkeys(d for d in domains if d is not None):
        part = summarize([s for s, d in zip(per_sequence, domains) if d == domain])
        summary.update({f"{metric}_{domain}": part[metric] for metric in DOMAIN_METRICS})
    return summary


def prompts_and_domains(path) -> tuple[list[str], list[str | None]]:
    """A prompt file's prompts and each row's `domain` field (None where absent, and for text files)."""
    prompts = read_prompts(path)
    if ".jsonl" not in Path(path).suffixes:
        return prompts, [None] * len(prompts)
    return prompts, [row.get("domain") for row in read_jsonl(path)]


def calibration_prompt_digests(checkpoint) -> list[str]:
    """The digests of the prompts a pruned checkpoint was calibrated on (none for text windows)."""
    metadata = load_checkpoint(checkpoint, mmap=True)[2]
    return metadata.get("calibration", {}).get("prompt_sha256", [])


def dense_references(dense_model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 8,
                     stop_at_eos: bool = True):
    """The model's greedy generations: [(prompt ids, generated ids)], EOS removed. stop_at_eos=False
    decodes all max_new_tokens even past an EOS (fixed-length runs for the drift diagnostic)."""
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    eos_ids = tuple(tokenizer.eos_ids) if stop_at_eos else ()
    generated = greedy_token_ids(dense_model, prompt_ids, max_new_tokens, eos_ids, batch_size)
    if not stop_at_eos:
        return list(zip(prompt_ids, generated))
    return [(p, [t for t in g if t not in tokenizer.eos_ids]) for p, g in zip(prompt_ids, generated)]


def main():
    parser = cli_args.ArgumentParser(description="Decode fidelity of a pruned checkpoint against its dense source.")
    parser.add_argument("--dense", required=True, help="dense checkpoint")
    parser.add_argument("--pruned", required=True, help="pruned checkpoint (packed or dense-zeros)")
    parser.add_argument("--prompts", help="held-out prompts, .jsonl (field prompt, optional domain) or .txt "
                        "(default: evaluation.compare's held-out writing and code prompts)")
    parser.add_argument("--limit", type=cli_args.positive_int, help="evaluate only the first N prompts (default: all)")
    parser.add_argument("--max_new_tokens", type=cli_args.positive_int, default=256)
    parser.add_argument("--batch_size", type=cli_args.positive_int, default=8)
    parser.add_argument("--device", type=cli_args.device, default="cpu")
    parser.add_argument("--out")
    args = parser.parse_args()

    def run():
        if args.prompts:
            prompts, domains = prompts_and_domains(args.prompts)
        else:
            rows = prompt_rows()[1]
            prompts, domains = [row["prompt"] for row in rows], [row["domain"] for row in rows]
        count = count_to_evaluate(len(prompts), args.limit, args.prompts or "evaluation.compare's held-out prompts")
        prompts, domains = prompts[:count], domains[:count]
        refuse_overlap(calibration_prompt_digests(args.pruned), prompts, f"prompts {args.pruned} was calibrated on")
        dense, tokenizer = load_model_and_tokenizer(args.dense, args.device)
        pruned = load_model(args.pruned, args.device)
        return decode_fidelity(dense, pruned, dense_references(dense, tokenizer, prompts, args.max_new_tokens,
                                                               args.batch_size), domains=domains)

    run_cli(run, summary_line, args.out)


def summary_line(result: dict) -> str:
    """The metrics overall, then per domain where the prompts have domains."""
    text = (f"KL(dense||pruned) {result['kl']:.4f} nats/token | top-1 agreement {result['top1_agreement']:.4f} | "
            f"tokens to divergence mean {result['tokens_to_divergence_mean']:.1f}, median "
            f"{result['tokens_to_divergence_median']:.1f} | {result['decode_tokens']} decode tokens")
    for key in result:
        if key.startswith("sequences_"):
            domain = key.removeprefix("sequences_")
            text += (f"\n  {domain}: KL {result[f'kl_{domain}']:.4f} | top-1 {result[f'top1_agreement_{domain}']:.4f} | "
                     f"tokens to divergence mean {result[f'tokens_to_divergence_mean_{domain}']:.1f} | "
                     f"{result[f'decode_tokens_{domain}']} decode tokens")
    return text


if __name__ == "__main__":
    main()
