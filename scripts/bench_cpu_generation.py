"""What a HumanEval / MBPP pass of one model costs on this CPU: prefill and decode-step time of the
generate() loop on chat-templated code prompts, and the projected time of a full pass.

    python scripts/bench_cpu_generation.py --checkpoint checkpoints/Qwen2.5-Coder-0.5B-Instruct/model.pth \
        --batch_sizes 16,32 --out docs/results/speed/qwen_coder_cpu.json

Each time is taken twice: wall clock, and the CPU time of this process (all its threads). On a
machine shared with other jobs the wall clock measures the sharing; CPU time / threads is what the
same work takes when the process has its cores to itself, which is what the projection uses (it
says so, and records the load average beside every number).

Prefill: the first `--prefill_prompts` HumanEval prompts in the chat template, as one left-padded
batch; its cost per prompt token scales to the benchmark's prompts. Decode: generate.decode_one_token,
as the loop calls it, at each batch size, with a KV cache sized as generate() sizes it (prompt width
plus `--max_new_tokens`), halfway through the reply (the average step's attention). Projection of a pass of N tasks at
batch B: ceil(N / B) batches, each prefilling B prompts of the benchmark's mean length and
decoding `--max_new_tokens` steps (an upper bound: a batch stops once every reply has ended).
"""
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import cli_args  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402


def timed(fn):
    """(result, wall seconds, CPU seconds of this process) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None):
    p = cli_args.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--batch_sizes", type=lambda s: [cli_args.positive_int(b) for b in s.split(",")], default=[16])
    p.add_argument("--max_new_tokens", type=cli_args.positive_int, default=384)
    p.add_argument("--prefill_prompts", type=cli_args.positive_int, default=4)
    p.add_argument("--decode_steps", type=cli_args.positive_int, default=6, help="timed steps per batch size")
    p.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = p.parse_args(argv)

    from evaluation.code_tasks import humaneval_tasks, mbpp_tasks
    from evaluation.generation import encode_prompt, load_model_and_tokenizer
    from generate import decode_one_token, prefill

    try:
        model, tokenizer = load_model_and_tokenizer(args.checkpoint)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        cli_args.exit_with_error(e)
    threads = torch.get_num_threads()
    lengths = {name: [len(encode_prompt(tokenizer, t.prompt)) for t in tasks()]
               for name, tasks in (("humaneval", humaneval_tasks), ("mbpp", mbpp_tasks))}
    humaneval = [torch.tensor(encode_prompt(tokenizer, t.prompt)) for t in humaneval_tasks()[:args.prefill_prompts]]
    width = max(len(p) for p in humaneval)
    tokens = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in humaneval])
    slots = width + args.max_new_tokens
    record = dict(checkpoint=str(args.checkpoint), threads=threads, cpu=os.cpu_count(), torch=torch.__version__,
                  max_new_tokens=args.max_new_tokens, prompt_tokens={k: dict(mean=sum(v) / len(v), max=max(v), n=len(v))
                                                                    for k, v in lengths.items()})
    with torch.no_grad():
        model.setup_caches(max(args.batch_sizes + [len(humaneval)]), slots)
        model.set_left_padding(torch.tensor([width - len(p) for p in humaneval]))
        _, wall, cpu = timed(lambda: prefill(model, tokens, torch.arange(width), None))
        model.set_left_padding(None)
        record["prefill"] = dict(prompts=len(humaneval), padded_tokens=tokens.numel(), wall_s=wall, cpu_s=cpu,
                                 cpu_s_per_token=cpu / tokens.numel(), load=os.getloadavg()[0])
        print(f"prefill {tuple(tokens.shape)}: {wall:.1f} s wall, {cpu:.1f} s CPU "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        record["decode"] = []
        for batch in args.batch_sizes:
            token, position = torch.zeros(batch, 1, dtype=torch.long), torch.tensor([width + args.max_new_tokens // 2])
            decode_one_token(model, token, position, None)  # warm-up
            steps = [timed(lambda: decode_one_token(model, token, position + i, None))
                     for i in range(args.decode_steps)]
            wall, cpu = (sum(s[k] for s in steps) / len(steps) for k in (1, 2))
            record["decode"].append(dict(batch_size=batch, wall_s_per_step=wall, cpu_s_per_step=cpu,
                                         load=os.getloadavg()[0]))
            print(f"decode batch {batch}: {wall:.2f} s/step wall, {cpu:.2f} s/step CPU "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    record["projection"] = []
    for step in record["decode"]:
        batch = step["batch_size"]
        for name, v in lengths.items():
            batches = math.ceil(len(v) / batch)
            prefill_s = record["prefill"]["cpu_s_per_token"] * batch * (sum(v) / len(v)) / threads
            decode_s = args.max_new_tokens * step["cpu_s_per_step"] / threads
            total = batches * (prefill_s + decode_s)
            record["projection"].append(dict(task=name, tasks=len(v), batch_size=batch, minutes=total / 60,
                                             tokens_per_s=batch / (step["cpu_s_per_step"] / threads)))
            print(f"{name} ({len(v)} tasks) at batch {batch}: at most {total / 60:.0f} min with {threads} idle "
                  f"cores ({batch / (step['cpu_s_per_step'] / threads):.1f} decode tok/s)", flush=True)
    if args.out:
        from evaluation.data import write_json_atomic
        write_json_atomic(args.out, record)


if __name__ == "__main__":
    main()
