"""Is the first position (the attention sink; never a counted position under decode-aware
calibration) what seed 1 breaks? Per layer: relative error vs dense of the block output at position
0 and over positions >= 1; and attention mass on position 0 at layer 12, on the 12 held-out texts."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from evaluation.diagnostics import block_outputs, relative_discrepancy
from evaluation.generation import load_model
torch.set_grad_enabled(False)
refs = [tuple(r) for r in json.loads(Path('/work/evalrun/grid_8k_seq/dense_references_12x96.json').read_text())]
refs = [r for r in refs if r[1]]
dense = load_model('/work/evalrun/smollm2/model.pth', 'cpu')
D = [block_outputs(dense, p + g) for p, g in refs]
paths = {f's{s}': f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-decode-seed{s}.pth' for s in (0, 1, 2)}
paths['c4s0'] = '/work/evalrun/grid_8k_seq/sparsegpt-2of4-text-seed0.pth'
ratio = torch.stack([d[:, 0].norm(dim=-1) / d[:, 1:].norm(dim=-1).mean(-1) for d in D]).mean(0)
print('dense block-output norm at position 0 / mean norm at positions >= 1, per layer:', ' '.join(f'{v:.0f}' for v in ratio.tolist()))
for name, path in paths.items():
    m = load_model(path, 'cpu')
    e0, e1 = [], []
    for (p, g), d in zip(refs, D):
        r = relative_discrepancy(block_outputs(m, p + g), d)  # [layers, T]
        e0.append(r[:, 0]); e1.append(r[:, 1:].mean(1))
    print(name, 'pos0  ', ' '.join(f'{v:.2f}' for v in torch.stack(e0).mean(0).tolist()))
    print(name, 'pos>=1', ' '.join(f'{v:.2f}' for v in torch.stack(e1).mean(0).tolist()), flush=True)
