"""Input second moments of every block linear on each seed's cached decode calibration, read from
the dense model at the counted (decode) positions: top-eigenvalue share of trace(H), and the share
of trace(H) that calibration sequence 10 of seed 1 (63 repeated ' very') contributes."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from evaluation.generation import load_model
from evaluation.diagnostics import linear_layers
from evaluation.generation import forward_logits
torch.set_grad_enabled(False)
model = load_model('/work/evalrun/smollm2/model.pth', 'cpu')
linears = linear_layers(model)
out = {}
for seed, tag in ((0, 'd9471777abc6'), (1, '6e5f75f94956'), (2, '064b032804cd')):
    s = torch.load(f'/work/evalrun/grid_8k/calibration-decode-8192tok-seed{seed}-{tag}.pt', weights_only=True)
    sums = {n: 0 for n in linears}; per_seq = {n: [] for n in linears}
    cur = {}
    def hook(name):
        def f(mod, args):
            x = args[0][0][cur['c']].double()
            sums[name] = sums[name] + x.T @ x
            per_seq[name].append(((x * x).sum().item(), (x * x).sum(-1).max().item()))
        return f
    hooks = [lin.register_forward_pre_hook(hook(n)) for n, lin in linears.items()]
    for q, c in zip(s['sequences'], s['counted']):
        cur['c'] = c
        forward_logits(model, q[None])
    for h in hooks: h.remove()
    res = {}
    for n in linears:
        H = sums[n]; ev = torch.linalg.eigvalsh(H)
        tr = [t for t, _ in per_seq[n]]; total = sum(tr)
        worst = max(range(len(tr)), key=lambda i: tr[i])
        res[n] = dict(top_eig_share=(ev[-1] / ev.sum()).item(), cond=(ev[-1] / ev[0].clamp(min=1e-30)).item(),
                      worst_seq=worst, worst_seq_share=tr[worst] / total, seq10_share=tr[10] / total if seed == 1 else None,
                      max_token_sq_over_mean=max(m for _, m in per_seq[n]) / (total / sum(int(c.sum()) for c in s['counted'])))
    out[seed] = res
    print('seed', seed, 'done', flush=True)
Path('/work/evalrun/diag_collapse/hessians.json').write_text(json.dumps(out))
for n in linears:
    r = [out[s][n] for s in (0, 1, 2)]
    print(f"{n:28s} topeig {r[0]['top_eig_share']:.3f} {r[1]['top_eig_share']:.3f} {r[2]['top_eig_share']:.3f} | worstseq share "
          f"{r[0]['worst_seq_share']:.3f} {r[1]['worst_seq_share']:.3f}(#{r[1]['worst_seq']}) {r[2]['worst_seq_share']:.3f} | seq10 {r[1]['seq10_share']:.3f} "
          f"| max tok/mean {r[0]['max_token_sq_over_mean']:.0f} {r[1]['max_token_sq_over_mean']:.0f} {r[2]['max_token_sq_over_mean']:.0f}")
