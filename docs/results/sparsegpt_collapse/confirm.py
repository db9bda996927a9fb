"""Diagnostic re-prune (not a grid cell) of SparseGPT 2:4, decode-aware, sequential, 8192 tokens, on a seed's
cached calibration with one sequence left out, a larger dampening and/or each sequence's first position
counted (prune's --count_first_token), evaluated as evaluation.compare
does (KL, top-1 on the 12 held-out references; WikiText-2 perplexity, 2048 tokens in 512 windows).
Usage: confirm.py VARIANT [SEED]"""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, '/work/main')
from prune.calibration import CalibrationSet
import prune.run as run
from prune.sparsegpt import sparsegpt_prune
from evaluation.compare import evaluate_checkpoint
from evaluation.data import data_path
from evaluation.fidelity import decode_step_logits
from evaluation.generation import load_model, load_model_and_tokenizer
from evaluation.perplexity import read_text

variant = sys.argv[1]  # drop<k>, damp<f>, first, joined by '+', or orig (evaluate the published checkpoint)
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
TAGS = {0: 'd9471777abc6', 1: '6e5f75f94956', 2: '064b032804cd'}
DENSE = '/work/evalrun/smollm2/model.pth'
out = Path(f'/work/evalrun/diag_collapse/sparsegpt-2of4-decode-seed{seed}-{variant}.pth')
saved = torch.load(f'/work/evalrun/grid_8k/calibration-decode-8192tok-seed{seed}-{TAGS[seed]}.pt', weights_only=True)
seqs, counted = saved['sequences'], saved['counted']
for part in variant.split('+'):
    if part.startswith('drop'):  # leave out calibration sequence k
        k = int(part[4:])
        seqs, counted = seqs[:k] + seqs[k + 1:], counted[:k] + counted[k + 1:]
    if part.startswith('damp'):  # SparseGPT's dampening, a fraction of mean(diag H); prune/ uses 0.01
        f = float(part[4:])
        run.METHODS['sparsegpt'] = lambda w, s, p: sparsegpt_prune(w, s.hessian, p, damp_fraction=f)
if variant != 'orig':
    cal = CalibrationSet(seqs, counted, dict(saved['info'], diagnostic=variant))
    if 'first' in variant.split('+'):  # the attention-sink position enters the statistics too
        cal = cal.with_first_positions()
    t = time.time()
    run.prune_model(DENSE, cal, 'sparsegpt', '2:4', out, device='cpu', one_shot=False, seed=seed)
    print(f'{variant}: {cal.counted_tokens} counted tokens, pruned in {time.time()-t:.0f} s', flush=True)
else:
    out = Path('/work/evalrun/grid_8k_seq/sparsegpt-2of4-decode-seed1.pth')
dense, tokenizer = load_model_and_tokenizer(DENSE, 'cpu')
refs = [tuple(r) for r in json.loads(Path('/work/evalrun/grid_8k_seq/dense_references_12x96.json').read_text())]
refs = [r for r in refs if r[1]]
class A:  # the one evaluation.compare flag evaluate_checkpoint reads
    seq_len = 512
wikitext = read_text(data_path('wikitext2_test.raw'), max_chars=8 * 2048)
ctx = dict(dense=dense, tokenizer=tokenizer, references=refs, wikitext_ids=tokenizer.encode(wikitext)[:2048],
           dense_logits=decode_step_logits(dense, refs))
m = evaluate_checkpoint(A, load_model(out, 'cpu'), ctx)
res = {k: m[k] for k in ('kl', 'top1_agreement', 'wikitext2_ppl')}
print(seed, variant, json.dumps(res), flush=True)
Path(f'/work/evalrun/diag_collapse/seed{seed}-{variant}.json').write_text(json.dumps(res, indent=1))
