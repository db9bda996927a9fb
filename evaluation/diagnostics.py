"""The paper's diagnostics: activation drift along decoding (Figure 1(a)) and how well calibration
Hessians match decode-time Hessians (Appendix A.2, Tables 6-7).

activation - relative discrepancy ||h_pruned - h_dense|| / ||h_dense|| of each block's output, per
  layer and decode step, in two modes:
    teacher-forced: the pruned model reads the dense model's greedy text (the reference), so errors
      cannot compound through the tokens;
    autoregressive: each model reads its own greedy text, as in real decoding, so a wrong token
      changes every later input.
  Step t is the position that predicts generated token t (t = 0 is the last prompt position).

hessian - for every linear layer, the input second-moment H = E[x xᵀ] from three sources, all read
  from the dense model: DEC (decode-step inputs on held-out prompts: what the layer sees when it
  serves), AR (decode-step inputs on calibration prompts: decoding-aware calibration) and C4
  (teacher-forced text windows, all positions), AR and C4 with the same token budget. With U_k the
  top-k eigenvectors of H_DEC (k = fraction * d),
      eps(H_cal) = ||U_kᵀ (H_cal - H_DEC) U_k||_F / ||U_kᵀ H_DEC U_k||_F,
  the calibration's relative error inside the subspace that carries the decode-time energy (the
  paper's text is not at hand; this is our reading of its epsilon, stated so it can be checked).
  Tables 6-7: per fraction, the number of modules with eps_AR < eps_C4 and the median eps_AR/eps_C4.

CLI: python -m evaluation.diagnostics activation --dense D.pth --pruned P.pth --out_dir DIR [--prompts F]
     python -m evaluation.diagnostics hessian --dense D.pth --out_dir DIR [--calib_prompts F --heldout_prompts F
         --text c4_sample.jsonl --tokens 8192]
"""
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

import cli_args
from evaluation.data import count_to_evaluate, data_path, prompt_split, read_prompts, refuse_overlap, write_json_atomic
from evaluation.fidelity import calibration_prompt_digests, dense_references
from evaluation.generation import USER_ERRORS, forward_logits, load_model, load_model_and_tokenizer
from evaluation.perplexity import read_text
from prune.calibration import prompt_digest

FRACTIONS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


@contextmanager
def capture_block_outputs(model):
    """Collects each transformer block's output [B, T, dim] during forwards run inside the block."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda _m, _in, out: outputs.append(out.detach().float()))
             for layer in model.layers]
    try:
        yield outputs
    finally:
        for h in hooks:
            h.remove()


def block_outputs(model, ids: list[int]) -> torch.Tensor:
    """[n_layer, T, dim] block outputs for one teacher-forced sequence."""
    with capture_block_outputs(model) as outputs:
        forward_logits(model, torch.tensor([ids]))
    return torch.stack([o[0] for o in outputs])


def relative_discrepancy(pruned: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """||pruned - dense|| / ||dense|| over the feature dimension: [..., dim] -> [...]."""
    return (pruned - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-12)


def activation_discrepancy(dense_model, pruned_model, dense_refs, pruned_refs) -> dict:
    """dense_refs / pruned_refs: (prompt ids, greedy generation ids) of each model on the same prompts.
    Returns mean discrepancy [n_layer, steps] per mode, over the sequences long enough for each step."""
    modes = {"teacher_forced": [], "autoregressive": []}
    for (prompt, dense_gen), (_, pruned_gen) in tqdm(list(zip(dense_refs, pruned_refs)), desc="activations", leave=False):
        steps = min(len(dense_gen), len(pruned_gen))
        if steps == 0:
            continue
        at_steps = slice(len(prompt) - 1, len(prompt) - 1 + steps)
        dense_h = block_outputs(dense_model, prompt + dense_gen)[:, at_steps]
        modes["teacher_forced"].append(relative_discrepancy(block_outputs(pruned_model, prompt + dense_gen)[:, at_steps], dense_h))
        modes["autoregressive"].append(relative_discrepancy(block_outputs(pruned_model, prompt + pruned_gen)[:, at_steps], dense_h))
    if not modes["teacher_forced"]:
        raise ValueError("no generated tokens to compare (every generation was empty)")
    return {mode: _mean_ragged(curves).tolist() for mode, curves in modes.items()}


def _mean_ragged(curves: list[torch.Tensor]) -> torch.Tensor:
    """Mean over sequences of [n_layer, steps_i] tensors of different lengths, per step."""
    longest = max(c.shape[1] for c in curves)
    total = torch.zeros(curves[0].shape[0], longest)
    count = torch.zeros(longest)
    for c in curves:
        total[:, : c.shape[1]] += c
        count[: c.shape[1]] += 1
    return total / count


# ---- Hessians ----

def linear_layers(model) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "output"}


@torch.no_grad()
def input_second_moments(model, sequences: list[tuple[list[int], int]], progress=True) -> dict[str, torch.Tensor]:
    """E[x xᵀ] (float64) of every linear layer's input over the positions from each sequence's start
    index on: sequences are (ids, first kept position) pairs."""
    sums, count, keep = {}, 0, {}

    def hook(name):
        def accumulate(_module, inputs, _output):
            x = inputs[0][0, keep["from"]:].double()
            sums[name] = sums.get(name, 0) + x.T @ x
        return accumulate

    handles = [m.register_forward_hook(hook(name)) for name, m in linear_layers(model).items()]
    try:
        for ids, first in tqdm(sequences, desc="hessians", disable=not progress, leave=False):
            keep["from"] = first
            forward_logits(model, torch.tensor([ids]))
            count += len(ids) - first
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ValueError("no positions to accumulate")
    return {name: s / count for name, s in sums.items()}


def decode_sequences(references, max_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Decode-step inputs of (prompt, generation) pairs: the generated tokens fed back, at positions
    len(prompt) .. end-1 (the last generated token is never fed back), up to max_tokens in total."""
    sequences, total = [], 0
    for prompt, generated in references:
        fed_back = generated[:-1]
        if max_tokens is not None:
            fed_back = fed_back[: max_tokens - total]
        if fed_back:
            sequences.append((prompt + fed_back, len(prompt)))
            total += len(fed_back)
    return sequences


def text_sequences(token_ids: list[int], seq_len: int, max_tokens: int) -> list[tuple[list[int], int]]:
    n = min(len(token_ids), max_tokens) // seq_len
    return [(token_ids[i * seq_len:(i + 1) * seq_len], 0) for i in range(n)]


def eigenbasis(h: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric matrix as columns, largest eigenvalue first."""
    eigenvalues, eigenvectors = torch.linalg.eigh(h)
    return eigenvectors[:, eigenvalues.argsort(descending=True)]


def subspace_error(h_cal: torch.Tensor, h_dec: torch.Tensor, fractions=FRACTIONS, basis=None) -> list[float]:
    """eps for each fraction of H_DEC's eigenvectors kept; basis = eigenbasis(h_dec) if already known."""
    u = eigenbasis(h_dec) if basis is None else basis
    dec_rotated, diff_rotated = u.T @ h_dec @ u, u.T @ (h_cal - h_dec) @ u
    d = h_dec.shape[0]
    errors = []
    for f in fractions:
        k = max(1, round(f * d))
        errors.append((diff_rotated[:k, :k].norm() / dec_rotated[:k, :k].norm().clamp(min=1e-30)).item())
    return errors


def hessian_tables(h_dec: dict, h_ar: dict, h_c4: dict, fractions=FRACTIONS) -> dict:
    per_module = {}
    for name in tqdm(h_dec, desc="eigendecompositions", leave=False):
        basis = eigenbasis(h_dec[name])
        per_module[name] = {"ar": subspace_error(h_ar[name], h_dec[name], fractions, basis),
                            "c4": subspace_error(h_c4[name], h_dec[name], fractions, basis)}
    summary = []
    for i, f in enumerate(fractions):
        ratios = [m["ar"][i] / m["c4"][i] for m in per_module.values() if m["c4"][i] > 0]
        summary.append({"fraction": f, "modules": len(per_module),
                        "ar_below_c4": sum(m["ar"][i] < m["c4"][i] for m in per_module.values()),
                        "median_ratio_ar_over_c4": statistics.median(ratios) if ratios else None,
                        "median_eps_ar": statistics.median(m["ar"][i] for m in per_module.values()),
                        "median_eps_c4": statistics.median(m["c4"][i] for m in per_module.values())})
    return {"fractions": list(fractions), "summary": summary, "per_module": per_module}


# ---- plots ----

def plot_activation(result: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in (("autoregressive", "-"), ("teacher_forced", "--")):
        curves = torch.tensor(result[mode])
        n = curves.shape[0]
        for layer, color in ((0, "tab:blue"), (n // 2, "tab:orange"), (n - 1, "tab:green")):
            ax.plot(curves[layer], style, color=color, label=f"layer {layer}, {mode.replace('_', '-')}")
    ax.set_xlabel("decode step")
    ax.set_ylabel("relative discrepancy ||h_pruned - h_dense|| / ||h_dense||")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hessian(tables: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = tables["summary"]
    ax.plot([r["fraction"] for r in rows], [r["median_eps_ar"] for r in rows], "o-", label="AR (decode-aware)")
    ax.plot([r["fraction"] for r in rows], [r["median_eps_c4"] for r in rows], "s--", label="C4 (teacher-forced)")
    ax.set_xscale("log")
    ax.set_xlabel("fraction of decode-Hessian eigenvectors retained")
    ax.set_ylabel("median epsilon over modules")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = cli_args.ArgumentParser(description="Figure 1(a) activation drift and Appendix A.2 Hessian epsilon.")
    sub = parser.add_subparsers(dest="command", required=True)
    act = sub.add_parser("activation", help="per-layer discrepancy vs decode step")
    act.add_argument("--pruned", required=True)
    act.add_argument("--prompts", help="held-out prompts (default: the held-out split of evaluation.compare)")
    act.add_argument("--limit", type=cli_args.positive_int, help="only the first N prompts (default: all)")
    hes = sub.add_parser("hessian", help="AR vs C4 calibration Hessians against decode-time Hessians")
    hes.add_argument("--calib_prompts", help="decoding-aware calibration prompts (default: evaluation.compare's calibration split)")
    hes.add_argument("--heldout_prompts", help="prompts standing in for deployment (default: compare's held-out split)")
    hes.add_argument("--text", default="c4_sample.jsonl", help="teacher-forced calibration text")
    hes.add_argument("--tokens", type=cli_args.positive_int, default=8192, help="token budget of AR and of C4 (equal)")
    hes.add_argument("--seq_len", type=cli_args.positive_int, default=512, help="C4 window length")
    hes.add_argument("--limit", type=cli_args.positive_int, help="only the first N held-out prompts (default: all)")
    for p in (act, hes):
        p.add_argument("--dense", required=True)
        p.add_argument("--max_new_tokens", type=cli_args.positive_int, default=128)
        p.add_argument("--device", type=cli_args.device, default="cpu")
        p.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    try:
        if args.command == "activation":  # the prompts are checked before any model loads
            prompts = read_prompts(args.prompts) if args.prompts else prompt_split()[1]
            prompts = prompts[: count_to_evaluate(len(prompts), args.limit, args.prompts or "compare's held-out split")]
            refuse_overlap(calibration_prompt_digests(args.pruned), prompts, f"prompts {args.pruned} was calibrated on")
            dense, tokenizer = load_model_and_tokenizer(args.dense, args.device)
            pruned = load_model(args.pruned, args.device)
            # Fixed-length runs past EOS: a pruned model that ends at once would leave no steps to compare.
            result = activation_discrepancy(
                dense, pruned, dense_references(dense, tokenizer, prompts, args.max_new_tokens, stop_at_eos=False),
                dense_references(pruned, tokenizer, prompts, args.max_new_tokens, stop_at_eos=False))
            write_json_atomic(out_dir / "activation_discrepancy.json", result)
            plot_activation(result, out_dir / "activation_discrepancy.png")
            last = torch.tensor(result["autoregressive"])[:, -1].mean().item()
            print(f"mean over layers at the last step: autoregressive {last:.4f}, "
                  f"teacher-forced {torch.tensor(result['teacher_forced'])[:, -1].mean().item():.4f}")
        else:
            heldout, calib = hessian_prompts(args)
            dense, tokenizer = load_model_and_tokenizer(args.dense, args.device)
            result = hessian_study(dense, tokenizer, heldout, calib, args)
            write_json_atomic(out_dir / "hessian_epsilon.json", result)
            plot_hessian(result, out_dir / "hessian_epsilon.png")
            for row in result["summary"]:
                print(f"fraction {row['fraction']:>5}: AR < C4 in {row['ar_below_c4']}/{row['modules']} modules, "
                      f"median eps_AR/eps_C4 {row['median_ratio_ar_over_c4']:.3f}")
    except USER_ERRORS as e:
        cli_args.exit_with_error(e)


def hessian_prompts(args) -> tuple[list[str], list[str]]:
    """(held-out prompts, calibration prompts), disjoint: DEC stands for deployment, and a held-out
    prompt that AR also calibrates on would flatter AR."""
    calib_default, heldout_default = prompt_split()
    heldout = read_prompts(args.heldout_prompts) if args.heldout_prompts else heldout_default
    heldout = heldout[: count_to_evaluate(len(heldout), args.limit, args.heldout_prompts or "compare's held-out split")]
    calib = read_prompts(args.calib_prompts) if args.calib_prompts else calib_default
    refuse_overlap({prompt_digest(p) for p in calib}, heldout, "calibration prompts (--calib_prompts)")
    return heldout, calib


def hessian_study(dense, tokenizer, heldout: list[str], calib: list[str], args) -> dict:
    dec_refs = dense_references(dense, tokenizer, heldout, args.max_new_tokens)
    ar_refs, used = [], 0
    for start in range(0, len(calib), 16):  # generate only as many calibration prompts as the budget needs
        batch = dense_references(dense, tokenizer, calib[start:start + 16], args.max_new_tokens, batch_size=16)
        ar_refs += batch
        used += sum(max(len(g) - 1, 0) for _, g in batch)
        if used >= args.tokens:
            break
    text_path = Path(args.text) if Path(args.text).exists() else data_path(args.text)
    c4_ids = tokenizer.encode(read_text(text_path, max_chars=8 * args.tokens))
    sources = {"dec": decode_sequences(dec_refs), "ar": decode_sequences(ar_refs, args.tokens),
               "c4": text_sequences(c4_ids, args.seq_len, args.tokens)}
    h = {name: input_second_moments(dense, sequences) for name, sequences in sources.items()}
    tables = hessian_tables(h["dec"], h["ar"], h["c4"])
    tables["tokens"] = {name: sum(len(ids) - first for ids, first in s) for name, s in sources.items()}
    return tables


if __name__ == "__main__":
    main()
