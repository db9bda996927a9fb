"""Layer-11 w2: the input channels that carry the position-0 massive activation, how much energy the
decode-aware calibration statistics give them (diag of H from the sequential re-run is not stored, so
the dense model's decode-position inputs stand in), and how much of W's column norm each pruned model
kept on them."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from evaluation.generation import load_model, forward_logits
from checkpoint import load_checkpoint
from sparse import unpack
torch.set_grad_enabled(False)
L = 11
m = load_model('/work/evalrun/smollm2/model.pth', 'cpu')
lin = m.layers[L].feed_forward.w2
W = lin.weight.float()
refs = [tuple(r) for r in json.loads(Path('/work/evalrun/grid_8k_seq/dense_references_12x96.json').read_text())]
refs = [r for r in refs if r[1]]
x0 = []
h = lin.register_forward_pre_hook(lambda mod, a: (x0.append(a[0][0, 0]), None)[-1])
for p, g in refs[:3]: forward_logits(m, torch.tensor([p + g]))
h.remove()
x0 = torch.stack(x0).mean(0)
top = x0.abs().topk(4).indices
print('position-0 input, top channels', top.tolist(), 'values', [round(v, 1) for v in x0[top].tolist()],
      f'share of ||x0||^2: {(x0[top].pow(2).sum() / x0.pow(2).sum()).item():.3f}')
TAGS = {0: 'd9471777abc6', 1: '6e5f75f94956', 2: '064b032804cd'}
for s in (0, 1, 2):
    cal = torch.load(f'/work/evalrun/grid_8k/calibration-decode-8192tok-seed{s}-{TAGS[s]}.pt', weights_only=True)
    acc = torch.zeros(W.shape[1], dtype=torch.float64); n = 0; mx = torch.zeros(W.shape[1])
    cur = {}
    h = lin.register_forward_pre_hook(lambda mod, a: (cur.setdefault('x', []).append(a[0][0]), None)[-1])
    for q, c in zip(cal['sequences'], cal['counted']):
        cur['x'] = []; forward_logits(m, q[None]); x = cur['x'][0][c]
        acc += x.double().pow(2).sum(0); n += x.shape[0]; mx = torch.maximum(mx, x.abs().max(0).values)
    h.remove()
    d = acc / n
    sd, _, _ = load_checkpoint(f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-decode-seed{s}.pth', mmap=True)
    Wp = unpack(sd[f'layers.{L}.feed_forward.w2.values'].float(), sd[f'layers.{L}.feed_forward.w2.mask']).float()
    kept = [((Wp[:, j] - W[:, j]).norm() / W[:, j].norm()).item() for j in top.tolist()]
    print(f'seed {s}: decode-position E[x_j^2] on those channels / median channel',
          [f'{(d[j] / d.median()).item():.2g}' for j in top.tolist()], 'max |x_j| at decode positions',
          [round(mx[j].item(), 2) for j in top.tolist()], '| pruned column rel change', [f'{k:.2f}' for k in kept])
sd, _, _ = load_checkpoint('/work/evalrun/grid_8k_seq/sparsegpt-2of4-text-seed0.pth', mmap=True)
Wp = unpack(sd[f'layers.{L}.feed_forward.w2.values'].float(), sd[f'layers.{L}.feed_forward.w2.mask']).float()
print('C4 seed 0: pruned column rel change', [f'{((Wp[:, j] - W[:, j]).norm() / W[:, j].norm()).item():.2f}' for j in top.tolist()])
