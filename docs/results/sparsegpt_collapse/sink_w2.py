"""Layer-L feed_forward.w2 (where the dense model's position-0 massive activation is written) on the
dense model's own inputs: the position-0 input against the decode-position inputs, and how much each
pruned w2 alone changes its output there vs elsewhere."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from evaluation.generation import load_model, forward_logits
from checkpoint import load_checkpoint
from sparse import unpack
torch.set_grad_enabled(False)
L, linear = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else 'feed_forward.w2'
refs = [tuple(r) for r in json.loads(Path('/work/evalrun/grid_8k_seq/dense_references_12x96.json').read_text())]
refs = [r for r in refs if r[1]]
m = load_model('/work/evalrun/smollm2/model.pth', 'cpu')
W = m.get_submodule(f'layers.{L}.{linear}').weight.float()
x0, xr = [], []
h = m.get_submodule(f'layers.{L}.{linear}').register_forward_pre_hook(lambda mod, a: (x0.append(a[0][0, 0]), xr.append(a[0][0, 1:]), None)[-1])
for p, g in refs: forward_logits(m, torch.tensor([p + g]))
h.remove()
x0, xr = torch.stack(x0), torch.cat(xr)
print(f'layer {L} {linear}: ||x|| at position 0 / mean ||x|| elsewhere = {(x0.norm(dim=1).mean() / xr.norm(dim=1).mean()).item():.1f}; '
      f'||W x|| ratio = {((x0 @ W.T).norm(dim=1).mean() / (xr @ W.T).norm(dim=1).mean()).item():.1f}')
for name in ['decode-seed0', 'decode-seed1', 'decode-seed2', 'text-seed0', 'text-seed1']:
    sd, _, _ = load_checkpoint(f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-{name}.pth', mmap=True)
    Wp = unpack(sd[f'layers.{L}.{linear}.values'].float(), sd[f'layers.{L}.{linear}.mask']).float()
    e0 = ((x0 @ (Wp - W).T).norm() / (x0 @ W.T).norm()).item()
    er = ((xr @ (Wp - W).T).norm() / (xr @ W.T).norm()).item()
    print(f'  {name}: output rel err at position 0 {e0:.3f}, at positions >= 1 {er:.3f}')
