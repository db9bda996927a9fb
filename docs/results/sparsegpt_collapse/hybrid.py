"""Dense model with only layer L's <linear> taken from each seed's pruned model: relative error of
layer L's attention output (wo input) vs dense on the 12 held-out texts, all positions; isolates
that one pruned matrix's effect."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from evaluation.generation import load_model, forward_logits
from checkpoint import load_checkpoint
from sparse import unpack
torch.set_grad_enabled(False)
L, linear = int(sys.argv[1]), sys.argv[2]
refs = [tuple(r) for r in json.loads(Path('/work/evalrun/grid_8k_seq/dense_references_12x96.json').read_text())]
refs = [r for r in refs if r[1]]
m = load_model('/work/evalrun/smollm2/model.pth', 'cpu')
target = m.get_submodule(f'layers.{L}.{linear}')
dense_w = target.weight.data.clone()
def wo_in():
    xs = []
    h = m.layers[L].attention.wo.register_forward_pre_hook(lambda mod, a: xs.append(a[0][0]))
    for p, g in refs: forward_logits(m, torch.tensor([p + g]))
    h.remove(); return torch.cat(xs)
Xd = wo_in()
for s in (0, 1, 2):
    sd, _, _ = load_checkpoint(f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-decode-seed{s}.pth', mmap=True)
    target.weight.data = unpack(sd[f'layers.{L}.{linear}.values'].float(), sd[f'layers.{L}.{linear}.mask']).float()
    X = wo_in()
    per_head = [((X[:, sl] - Xd[:, sl]).norm() / Xd[:, sl].norm()).item() for sl in (slice(64 * h, 64 * h + 64) for h in range(9))]
    print(f'seed {s}: layer {L} {linear} alone -> wo input rel err {((X - Xd).norm() / Xd.norm()).item():.3f}; per head',
          ' '.join(f'{v:.2f}' for v in per_head), flush=True)
    target.weight.data = dense_w
