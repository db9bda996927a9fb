"""LongBench-Write length score S_l (LongWriter, Bai et al. 2024).

The length of a reply is counted as its CJK characters plus its words of other scripts (the
benchmark mixes Chinese and English prompts). With required length l and output length l':

    S_l = 100 * max(0, 1 - (l'/l - 1) / 3)   if l' > l   (overshooting is penalised more gently)
    S_l = 100 * max(0, 1 - (l/l' - 1) / 2)   otherwise

so S_l = 100 at the exact length and 0 at a third of it or at four times it. An empty reply scores 0.

CLI: python -m evaluation.longbench_write --checkpoint model.pth [--prompts longbench_write_en.jsonl]
         [--limit 20] [--max_new_tokens 2048] [--out lbw.json]
"""
import re
from typing import Callable

import cli_args
from evaluation.data import data_path, read_jsonl
from evaluation.generation import add_generation_args, load_generate_fn, run_cli

CJK_CHARACTER = re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff]")
WORD = re.compile(r"[A-Za-z0-9\u00c0-\u024f'’-]+")


def count_length(text: str) -> int:
    return len(CJK_CHARACTER.findall(text)) + len(WORD.findall(CJK_CHARACTER.sub(" ", text)))


def length_score(required: int, produced: int) -> float:
    if required <= 0:
        raise ValueError(f"required length must be positive, got {required}")
    if produced <= 0:
        return 0.0
    if produced > required:
        return 100.0 * max(0.0, 1.0 - (produced / required - 1.0) / 3.0)
    return 100.0 * max(0.0, 1.0 - (required / produced - 1.0) / 2.0)


def evaluate(rows: list[dict], generate_fn: Callable[[list[str]], list[str]]) -> dict:
    """rows: {"prompt", "length"} dicts as in LongBench-Write; returns mean S_l and per-prompt detail."""
    replies = generate_fn([row["prompt"] for row in rows])
    per_prompt = []
    for row, reply in zip(rows, replies, strict=True):
        produced = count_length(reply)
        per_prompt.append({"required": row["length"], "produced": produced,
                           "S_l": length_score(row["length"], produced), "reply": reply})
    mean = sum(p["S_l"] for p in per_prompt) / max(len(per_prompt), 1)
    return {"S_l": mean, "n": len(per_prompt), "prompts": per_prompt}


def main():
    parser = cli_args.ArgumentParser(description="LongBench-Write length score S_l.")
    parser.add_argument("--prompts", help="jsonl with prompt/length (default: shared longbench_write_en.jsonl)")
    add_generation_args(parser, max_new_tokens=2048, batch_size=4)
    args = parser.parse_args()  # prompts needing more words than --max_new_tokens cannot reach S_l = 100
    if not args.checkpoint:
        parser.error("--checkpoint is required")

    def run():
        rows = read_jsonl(args.prompts or data_path("longbench_write_en.jsonl"))[: args.limit]
        return evaluate(rows, load_generate_fn(args.checkpoint, args.device, args.max_new_tokens, args.batch_size))

    run_cli(run, lambda r: f"LongBench-Write S_l = {r['S_l']:.2f} over {r['n']} prompts", args.out)


if __name__ == "__main__":
    main()
