"""Re-runs prune/'s sequential SparseGPT 2:4 on a seed's cached decode calibration (nothing saved)
and logs, per linear, what the solver saw: the relative reconstruction error on its own calibration
inputs, tr(dW H dWᵀ) / tr(W H Wᵀ), H's condition number, dead inputs, and trace(H)."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from prune.calibration import CalibrationSet
import prune.run as run
from prune.sparsegpt import sparsegpt_prune
seed, tag = int(sys.argv[1]), sys.argv[2]
saved = torch.load(f'/work/evalrun/grid_8k/calibration-decode-8192tok-seed{seed}-{tag}.pt', weights_only=True)
log = []
def logged(weight, stats, pattern):
    H = stats.hessian.double()
    pruned, keep = sparsegpt_prune(weight, stats.hessian, pattern)
    dW = (pruned - weight).double(); W = weight.double()
    ev = torch.linalg.eigvalsh(H)
    log.append(dict(rel_err=(torch.trace(dW @ H @ dW.T) / torch.trace(W @ H @ W.T)).item(),
                    cond=(ev[-1] / ev[0].clamp(min=1e-30)).item(), dead=int((torch.diagonal(H) == 0).sum()),
                    trace=torch.trace(H).item(), min_eig=ev[0].item()))
    return pruned, keep
run.METHODS['sparsegpt'] = logged
model, config, _ = run.load_model_on_cpu('/work/evalrun/smollm2/model.pth')
names = run.selected_linears(model, '2:4', ('layers.*',), ())
cal = CalibrationSet(saved['sequences'], saved['counted'], saved['info'])
result = run.prune_layers(model, cal, 'sparsegpt', '2:4', names, device='cpu', one_shot=False)
out = {n: l for n, l in zip(result.names, log)}
Path(f'/work/evalrun/diag_collapse/solver_log_seed{seed}.json').write_text(json.dumps(out, indent=1))
print('done', seed)
