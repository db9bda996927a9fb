"""Perplexity over a text, in non-overlapping windows of seq_len tokens.

Each window is scored on its own (no context carried across windows), and the first token of a
window is never predicted, as in the SparseGPT/Wanda evaluation code: perplexity = exp(mean NLL)
over the (seq_len - 1) predicted tokens of every window.

Sources: a local file (wikitext2_test.raw as raw text, c4_sample.jsonl by its "text" fields, any
.txt/.raw/.jsonl[.gz]), or a file of a hub dataset when online (`--hub allenai/c4:en/c4-validation.00000-of-00008.json.gz`).

CLI: python -m evaluation.perplexity --checkpoint model.pth --data wikitext2_test.raw [--seq_len 512] [--max_tokens 65536]
"""
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import cli_args
from evaluation.data import data_path, open_text
from evaluation.generation import forward_logits, load_model_and_tokenizer, run_cli


def read_text(path, max_chars: int | None = None) -> str:
    """A text file as is, or the "text" fields of a jsonl joined by blank lines (up to max_chars)."""
    path = Path(path)
    with open_text(path) as f:
        if ".jsonl" not in path.suffixes and ".json" not in path.suffixes:
            return f.read(max_chars) if max_chars else f.read()
        docs, total = [], 0
        for line in f:
            if line.strip():
                docs.append(json.loads(line)["text"])
                total += len(docs[-1])
                if max_chars and total >= max_chars:
                    break
        return "\n\n".join(docs)


def download_hub_file(spec: str) -> Path:
    """`owner/name:path/in/repo` of a hub dataset -> local cached path; a clear error when offline."""
    repo_id, _, filename = spec.partition(":")
    if not filename:
        raise ValueError(f"--hub expects owner/name:path/in/repo, got '{spec}'")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, filename, repo_type="dataset"))
    except Exception as e:  # huggingface_hub raises many types when offline; all mean the same here
        raise FileNotFoundError(f"cannot fetch {filename} from hub dataset {repo_id} (offline?): "
                                f"{type(e).__name__}") from None


@torch.no_grad()
def perplexity(model, token_ids, seq_len: int, max_windows: int | None = None, progress: bool = True) -> dict:
    tokens = torch.as_tensor(token_ids, dtype=torch.long)
    n_windows = len(tokens) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of {seq_len}")
    total_nll, count = 0.0, 0
    for w in tqdm(range(n_windows), desc="perplexity", disable=not progress, leave=False):
        window = tokens[w * seq_len:(w + 1) * seq_len][None]
        logits = forward_logits(model, window)[0, :-1]
        targets = window[0, 1:].to(logits.device)
        total_nll += F.cross_entropy(logits.double(), targets, reduction="sum").item()
        count += len(targets)
    return {"perplexity": math.exp(total_nll / count), "nll": total_nll / count, "tokens": count, "windows": n_windows}


def text_perplexity(model, tokenizer, text: str, seq_len: int, max_tokens: int | None = None) -> dict:
    ids = tokenizer.encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    return perplexity(model, ids, seq_len)


def main():
    parser = cli_args.ArgumentParser(description="Perplexity of a checkpoint on a text file or hub dataset file.")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", default="wikitext2_test.raw",
                        help="a file path, or a file name in the shared data folder")
    parser.add_argument("--hub", help="hub dataset file instead of --data: owner/name:path/in/repo")
    parser.add_argument("--seq_len", type=cli_args.positive_int, default=2048)
    parser.add_argument("--max_tokens", type=cli_args.positive_int, help="score only the first N tokens")
    parser.add_argument("--device", type=cli_args.device, default="cpu")
    parser.add_argument("--out", help="write the result as JSON")
    args = parser.parse_args()

    def run():
        path = download_hub_file(args.hub) if args.hub else (
            Path(args.data) if Path(args.data).exists() else data_path(args.data))
        # Characters are cheaper to bound than tokens; 8 a token leaves slack for any tokenizer.
        text = read_text(path, max_chars=8 * args.max_tokens if args.max_tokens else None)
        model, tokenizer = load_model_and_tokenizer(args.checkpoint, args.device)
        return text_perplexity(model, tokenizer, text, args.seq_len, args.max_tokens)

    run_cli(run, lambda r: f"perplexity {r['perplexity']:.4f} over {r['tokens']} tokens "
                           f"({r['windows']} windows of {args.seq_len})", args.out)


if __name__ == "__main__":
    main()
