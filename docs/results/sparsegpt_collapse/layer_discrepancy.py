"""Per-layer relative discrepancy ||h_pruned - h_dense|| / ||h_dense|| of each block output, at the
decode positions of the 12 dense reference generations (teacher-forced on the dense text)."""
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
dense_h = [block_outputs(dense, p + g)[:, len(p) - 1:len(p) - 1 + len(g)] for p, g in refs]
paths = {f's{s}': f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-decode-seed{s}.pth' for s in (0, 1, 2)}
paths.update({f'c4s{s}': f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-text-seed{s}.pth' for s in (0, 1)})
for extra in sys.argv[1:]:
    paths[Path(extra).stem.split('seed1-')[-1]] = extra
curves = {}
for name, path in paths.items():
    m = load_model(path, 'cpu')
    d = [relative_discrepancy(block_outputs(m, p + g)[:, len(p) - 1:len(p) - 1 + len(g)], h).mean(1) for (p, g), h in zip(refs, dense_h)]
    curves[name] = torch.stack(d).mean(0).tolist()
    print(name, ' '.join(f'{v:.2f}' for v in curves[name]), flush=True)
Path('/work/evalrun/diag_collapse/layers.json').write_text(json.dumps(curves))
