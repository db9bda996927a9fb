"""Per pruned linear of the three decode-aware sequential 8192-token checkpoints: ||W_pruned - W||/||W||
and max|W_pruned| / max|W| (a weight blow-up would show here)."""
import torch
from checkpoint import load_checkpoint
from sparse import unpack
dense,_,_ = load_checkpoint('/work/evalrun/smollm2/model.pth', mmap=True)
res = {}
for seed in (0,1,2):
    sd,_,_ = load_checkpoint(f'/work/evalrun/grid_8k_seq/sparsegpt-2of4-decode-seed{seed}.pth', mmap=True)
    r = {}
    for k in sd:
        if k.endswith('.values'):
            name = k[:-7]
            W = unpack(sd[k].float(), sd[name+'.mask']).float()
            D = dense[name+'.weight'].float()
            r[name] = ((W-D).norm()/D.norm()).item(), W.abs().max().item()/D.abs().max().item()
    res[seed]=r
names = list(res[0])
print('name  relchange s0 s1 s2 | maxratio s0 s1 s2')
for n in names:
    a=[res[s][n][0] for s in (0,1,2)]; b=[res[s][n][1] for s in (0,1,2)]
    flag = ' <<' if a[1] > 1.5*max(a[0],a[2]) or b[1] > 2*max(b[0],b[2]) else ''
    print(f'{n:32s} {a[0]:.3f} {a[1]:.3f} {a[2]:.3f} | {b[0]:6.2f} {b[1]:6.2f} {b[2]:6.2f}{flag}')
