"""Time GPT-Fast's own dense decode of a named shape, the way bench_decode.py times ours.

GPT-Fast (pytorch-labs/gpt-fast) is not part of this repository: put a copy of it in a folder
(`.gptfast` is ignored by git) and point --gptfast_dir at it, e.g. from the fetch tool's mirror:

    mkdir -p .gptfast && git --git-dir=/work/.mirror/pytorch-labs+gpt-fast/repo archive HEAD | tar -x -C .gptfast

This script imports GPT-Fast's generate.py (which sets its Inductor options on import, as its CLI
does), builds its Transformer with random bf16 weights on the device, compiles its
decode_one_token with mode="reduce-overhead" and fullgraph=True as its main() does, and runs its
math-SDPA decode loop: one warm-up generation, then one in which every step is timed with CUDA
events. The last line printed is JSON: median step time over the steps after --warmup_steps,
the steps measured, the first call's seconds, peak memory. bench_decode.py --gptfast runs it in a
subprocess (both projects name their modules model.py and generate.py). GPTFAST_PROFILE=PATH
also writes torch.profiler's kernel time per step, as bench_decode.py --profile does for ours.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def random_gptfast_model(gptfast_model, name: str, device: str, dtype):
    import torch

    with torch.device("meta"):
        model = gptfast_model.Transformer.from_name(name)
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():  # random, not zeros: zeros would flatter the hardware
        for param_name, p in model.named_parameters():
            if param_name.endswith("weight") and "norm" in param_name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def main():
    # Plain argparse: this driver keeps our modules off its path (GPT-Fast's have the same names).
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gptfast_dir", type=Path, required=True, help="a copy of pytorch-labs/gpt-fast")
    p.add_argument("--model", required=True, help="a name GPT-Fast's transformer_configs knows, e.g. llama-3.1-8b")
    p.add_argument("--batch_size", type=int, default=1, help="rows decoded together")
    p.add_argument("--prompt_length", type=int, default=512, help="random prompt tokens prefilled first")
    p.add_argument("--new_tokens", type=int, default=256, help="decode steps generated")
    p.add_argument("--warmup_steps", type=int, default=50, help="steps left out of the median")
    p.add_argument("--temperature", type=float, default=0.8, help="GPT-Fast's sampling temperature")
    p.add_argument("--top_k", type=int, default=200, help="0: no top-k")
    p.add_argument("--device", default="cuda", help="torch device")
    p.add_argument("--no_compile", action="store_true", help="eager (a CPU smoke test of this script)")
    args = p.parse_args()

    sys.path.insert(0, str(args.gptfast_dir.resolve()))
    import torch
    import generate as gptfast  # GPT-Fast's generate.py (its Inductor options are set on import)
    import model as gptfast_model

    on_cuda = args.device.startswith("cuda")
    model = random_gptfast_model(gptfast_model, args.model, args.device, torch.bfloat16)
    with torch.device(args.device):
        model.setup_caches(max_batch_size=args.batch_size, max_seq_length=args.prompt_length + args.new_tokens)
    decode_one_token = gptfast.decode_one_token
    if not args.no_compile:
        decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    sampling = dict(temperature=args.temperature, top_k=args.top_k or None)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch_size, args.prompt_length), device=args.device)

    # GPT-Fast's generate() is @torch.no_grad(); without it autograd keeps every step's activations
    # and CUDA-graph trees re-record each step.
    @torch.no_grad()
    def generation(timed: bool):
        input_pos = torch.arange(0, args.prompt_length, device=args.device)
        token = gptfast.prefill(model, prompt, input_pos, **sampling).clone()
        input_pos = torch.tensor([args.prompt_length], device=args.device, dtype=torch.int)
        step_times = []
        for _ in range(args.new_tokens - 1):
            if timed and on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            wall = time.perf_counter()
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # as GPT-Fast's decode loop
                next_token, probs = decode_one_token(model, token, input_pos, **sampling)
            assert probs.grad_fn is None, "GPT-Fast's decode ran with autograd on"
            input_pos += 1
            token = next_token.clone()
            if timed:
                if on_cuda:
                    end.record()
                    end.synchronize()
                    step_times.append(start.elapsed_time(end) / 1e3)
                else:
                    step_times.append(time.perf_counter() - wall)
        return step_times

    start = time.perf_counter()
    generation(timed=False)  # compiles and records the CUDA graph
    first_call_s = time.perf_counter() - start
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    step_times = generation(timed=True)[args.warmup_steps:]
    if os.environ.get("GPTFAST_PROFILE") and on_cuda:
        from kernel_profile import profile_steps  # beside this script (GPT-Fast has a `scripts` of its own)

        profile_steps(lambda: generation(timed=False), args.new_tokens - 1, Path(os.environ["GPTFAST_PROFILE"]))
    print(json.dumps(dict(median_step_s=statistics.median(step_times), measured_steps=len(step_times),
                          first_call_s=round(first_call_s, 1),
                          peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if on_cuda else None)))


if __name__ == "__main__":
    main()
