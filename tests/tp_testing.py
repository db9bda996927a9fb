"""Tensor-parallel test harness: tiny models, a greedy run that records every step's logits, and
a launcher that starts W processes on the CPU (gloo) the way torchrun does, by its environment
variables. Run as a script it is one such process: it shards every tiny model, runs it and saves
what it saw for the test to compare with the single-process model.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tests/tp_testing.py OUT_DIR
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from model import Attention, ModelArgs, Transformer  # noqa: E402

# Shapes that split 2 and 4 ways, packed too: wo's 128 and w2's 128 input columns give each of 4
# ranks 32 (one bitmask word). A vocabulary of 98 leaves 4 ranks uneven (the lm_head pads).
SHAPE = dict(block_size=64, vocab_size=98, n_layer=2, n_head=8, n_local_heads=4, dim=128, head_dim=16,
             intermediate_size=128)
KINDS = {
    "dense": dict(),  # with a q/k/v bias, as Qwen2 has
    "qwen3": dict(architecture="qwen3", qk_norm=True, tie_embeddings=True),
    "2:4": dict(),
    "8:16": dict(),
}
BATCHES = {1: [[5, 17, 3, 60, 2, 9]], 3: [[5, 17, 3, 60, 2], [7, 1, 90, 33, 21, 8, 14, 4, 6], [11, 12, 13]]}
DECODE_STEPS = 5


def tiny_model(kind: str, **shape_changes) -> Transformer:
    """The same random model in every process (seeded), packed for the N:M kinds."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**{**SHAPE, **shape_changes}, **KINDS[kind])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        if kind == "dense":
            for module in model.modules():
                if isinstance(module, Attention):
                    biased = nn.Linear(module.wqkv.in_features, module.wqkv.out_features, bias=True)
                    biased.weight.copy_(module.wqkv.weight)
                    biased.bias.normal_(0, 0.5)
                    module.wqkv = biased
    if ":" in kind:
        import sparse

        sparse.swap_to_sparse(model, kind)
    return model


@torch.no_grad()
def greedy_logits(model: Transformer, prompts: list, steps: int):
    """Left-padded prefill, then `steps` greedy decode steps: (logits of the prefill and of each
    step, the tokens chosen)."""
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    model.setup_caches(len(prompts), width + steps + 1)
    model.set_left_padding(torch.tensor([width - len(p) for p in prompts]))
    logits = [model(tokens, torch.arange(width))]
    chosen = [logits[-1][:, -1].argmax(-1)]
    for step in range(steps):
        logits.append(model(chosen[-1][:, None], torch.tensor([width + step])))
        chosen.append(logits[-1][:, -1].argmax(-1))
    model.set_left_padding(None)
    return logits, torch.stack(chosen, dim=1)


def run_every_case(model_of_kind) -> dict:
    """{(kind, batch): {"logits": [...], "tokens": ..., "generated": [...]}}: greedy_logits and
    generate.generate's greedy tokens for each kind and batch."""
    import generate

    results = {}
    for kind in KINDS:
        model = model_of_kind(kind)
        for batch, prompts in BATCHES.items():
            logits, tokens = greedy_logits(model, prompts, DECODE_STEPS)
            generated = generate.generate(model, [torch.tensor(p) for p in prompts], DECODE_STEPS + 1).new_tokens
            results[kind, batch] = dict(logits=logits, tokens=tokens, generated=generated)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, command: list, timeout: float = 300, **env) -> list:
    """Run `command` in world_size processes with torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT); their CompletedProcess results, by rank."""
    common = {**os.environ, "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **env}
    procs = [subprocess.Popen(command, env={**common, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for r in range(world_size)]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return done


def main(out_dir: str):
    import tp

    tp.init_process_group("cpu")
    results = run_every_case(lambda kind: tp.shard(tiny_model(kind)))
    # Sampling without a seed: rank 0's seed, and each call's noise following on from the last.
    import generate

    model, generator = tp.shard(tiny_model("dense")), tp.shared_generator("cpu")
    results["sampled"] = [generate.generate(model, [torch.tensor(p) for p in BATCHES[3]], DECODE_STEPS,
                                            temperature=1.0, generator=generator).new_tokens for _ in range(2)]
    torch.save(results, Path(out_dir) / f"rank{tp.rank()}.pt")
    tp.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
