"""GPU benchmark of the decode-attention kernel (sparse/kernels/decode_attention.py) alone, as a
decode step calls it.

A whole-model A/B of one attention setting costs a fresh compiled process; this times the kernel
for many settings of its tuning constants in one: the grid's program target (`PROGRAMS_TARGET`:
how many splits the cache is cut into), the slots a program walks per block (`BLOCK_SLOTS`) and the
block loop's pipeline stages (`PIPELINE_STAGES`), at each batch size and cache length, with RoPE and
the KV write inside (`decode_attention_with_cache_write`, the model's path). Every slot of the cache is in use (the new token at the last slot), the worst case of a
decode step at that length.

Timing as for the SpMV (sparse/kernels/tuning.py's time_in_cuda_graph): calls recorded into one CUDA graph,
rotating over enough copies of the KV cache ("layers") to miss the 60 MB L2, as a step's 32 layers
do. GB/s counts the K and V bytes read (batch x KV heads x slots x head_dim x 2 x 2 bytes).
Each setting's output is checked against float32 attention over the cache it wrote.

    python scripts/bench_attention.py --batches 1,4,8,16 --slots 768,4096 --out-md runs/attention.md
"""
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli_args  # noqa: E402
from model import ModelArgs, apply_rope, precompute_rope  # noqa: E402
from sparse.kernels import decode_attention  # noqa: E402
from sparse.kernels.tuning import copies_for, time_in_cuda_graph  # noqa: E402


def attention_case(batch: int, n_heads: int, n_kv_heads: int, head_dim: int, slots: int, device="cuda",
                   dtype=torch.bfloat16, seed: int = 0, rope_base: float = 500000.0) -> tuple:
    """One layer's decode-step operands, in decode_attention_with_cache_write's order (the heads
    q, k, v in one [B, H + 2 H_kv, D] tensor), with every slot attended (no left padding) and the
    new token written at the last one."""
    generator = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=dtype)  # noqa: E731
    cos, sin = (table.to(device) for table in precompute_rope(slots, head_dim, rope_base))
    left_pad = torch.zeros(batch, dtype=torch.long, device=device)
    write_slot = torch.tensor([slots - 1], device=device)
    return (randn(batch, n_heads + 2 * n_kv_heads, head_dim), cos, sin, left_pad, write_slot,
            randn(batch, n_kv_heads, slots, head_dim), randn(batch, n_kv_heads, slots, head_dim))


def new_token_rope(case: tuple) -> tuple:
    """The cos and sin rows [B, D] the new token is rotated with (position: the last slot)."""
    qkv, cos, sin, _, write_slot, _, _ = case
    return (table[int(write_slot)].expand(qkv.shape[0], -1) for table in (cos, sin))


def reference_attention(case: tuple) -> torch.Tensor:
    """float32 softmax attention of the RoPE-rotated q over the caches as the kernel left them."""
    k_cache, v_cache = case[5:7]
    q = decode_attention.split_heads(case[0], k_cache)[0]
    n_heads, n_kv_heads = q.shape[1], k_cache.shape[1]
    cos, sin = new_token_rope(case)
    q = apply_rope(q[:, None], cos[:, None], sin[:, None])[:, 0].float()
    k = k_cache.float().repeat_interleave(n_heads // n_kv_heads, dim=1)
    v = v_cache.float().repeat_interleave(n_heads // n_kv_heads, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(dim=-1), v)


# decode_attention's tuning constants, in the order of a setting tuple
SETTINGS = ("PROGRAMS_TARGET", "BLOCK_SLOTS", "PIPELINE_STAGES")


def with_settings(*values):
    """Set the kernel's tuning constants SETTINGS (read at every call); return the previous values."""
    previous = tuple(getattr(decode_attention, name) for name in SETTINGS)
    for name, value in zip(SETTINGS, values):
        setattr(decode_attention, name, value)
    return previous


def bench(models, batches, slot_counts, targets, blocks, stages) -> list:
    rows = []
    for model in models:
        config = ModelArgs.from_name(model)
        n_heads, n_kv_heads, head_dim = config.n_head, config.n_local_heads, config.head_dim
        for slots in slot_counts:
            for batch in batches:
                kv_bytes = 2 * batch * n_kv_heads * slots * head_dim * 2
                layers = [attention_case(batch, n_heads, n_kv_heads, head_dim, slots, seed=layer,
                                         rope_base=config.rope_base)
                          for layer in range(copies_for(kv_bytes))]
                for setting in itertools.product(targets, blocks, stages):
                    target, block, pipeline = setting
                    previous = with_settings(*setting)
                    try:
                        out = decode_attention.decode_attention_with_cache_write(*layers[0]).float()
                        reference = reference_attention(layers[0])
                        error = float((out - reference).norm() / reference.norm())
                        if not error < 1e-2:
                            raise AssertionError(f"{model} b{batch} {slots} slots, target {target}, block "
                                                 f"{block}, stages {pipeline}: relative error {error:.2e}")
                        us = time_in_cuda_graph(
                            [lambda c=c: decode_attention.decode_attention_with_cache_write(*c) for c in layers])
                    finally:
                        with_settings(*previous)
                    row = dict(model=model, batch=batch, slots=slots, programs_target=target, block_slots=block,
                               pipeline_stages=pipeline, us=round(us, 2), gb_s=round(kv_bytes / us / 1e3), error=error)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del layers
                torch.cuda.empty_cache()
    return rows


def markdown_table(rows: list) -> str:
    """One line per (model, slots, batch): the committed setting's time, and the fastest setting."""
    keys = ("programs_target", "block_slots", "pipeline_stages")
    committed = tuple(getattr(decode_attention, name) for name in SETTINGS)
    lines = ["| model | slots | batch | committed µs (GB/s) | fastest µs (GB/s) "
             "| its target / block / stages |", "|---|---|---|---|---|---|"]
    cases = sorted({(r["model"], r["slots"], r["batch"]) for r in rows})
    for case in cases:
        group = [r for r in rows if (r["model"], r["slots"], r["batch"]) == case]
        best = min(group, key=lambda r: r["us"])
        base = [r for r in group if tuple(r[key] for key in keys) == committed]
        base_text = f"{base[0]['us']:.2f} ({base[0]['gb_s']})" if base else "not timed"
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {base_text} | {best['us']:.2f} ({best['gb_s']}) | "
                     f"{' / '.join(str(best[key]) for key in keys)} |")
    return "\n".join(lines)


def main():
    p = cli_args.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="Llama-3.1-8B", help="comma-separated model.py config names")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--slots", default="768,4096", help="cache lengths (all slots in use)")
    p.add_argument("--targets", default="132,264,528,1056", help="PROGRAMS_TARGET values")
    p.add_argument("--blocks", default="32,64,128", help="BLOCK_SLOTS values")
    p.add_argument("--stages", default="2", help="PIPELINE_STAGES values, e.g. 1,2,3")
    p.add_argument("--out-md", type=Path)
    p.add_argument("--out-json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py: needs a CUDA GPU")
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    for model in args.models.split(","):
        try:
            ModelArgs.from_name(model)
        except ValueError as e:
            sys.exit(f"bench_attention.py: {e}")
    rows = bench(args.models.split(","), ints(args.batches), ints(args.slots), ints(args.targets), ints(args.blocks),
                 ints(args.stages))
    table = markdown_table(rows)
    print(table)
    for path, text in ((args.out_json, json.dumps(rows, indent=1)), (args.out_md, table + "\n")):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


if __name__ == "__main__":
    main()
