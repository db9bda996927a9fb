"""Per seed of the cached 8192-token decode calibrations: sequence lengths, the longest run of one
repeated token, distinct-token fractions and the most frequent 4-gram count."""
import torch, glob, collections
for f in sorted(glob.glob('/work/evalrun/grid_8k/calibration-decode-8192tok-seed*.pt')):
    s = torch.load(f, weights_only=True)
    seqs, cnt = s['sequences'], s['counted']
    n = len(seqs); ctok = sum(int(c.sum()) for c in cnt)
    # longest run of identical token within counted positions, and fraction of counted tokens in runs >=8
    longest=[]; rep_frac=0; distinct=[]
    allgen=[]
    for q,c in zip(seqs,cnt):
        g = q[c].tolist(); allgen += g
        best=1; run=1; inrun=0
        for i in range(1,len(g)):
            run = run+1 if g[i]==g[i-1] else 1
            best=max(best,run)
        longest.append(best)
        distinct.append(len(set(g))/max(len(g),1))
        # 4-gram repetition
    ng = collections.Counter(tuple(allgen[i:i+4]) for i in range(len(allgen)-3))
    top = ng.most_common(3)
    lengths=[int(c.sum()) for c in cnt]
    print(f.split('/')[-1], 'seqs',n,'counted',ctok,'len min/med/max',min(lengths),sorted(lengths)[n//2],max(lengths),
          'longest same-token run max',max(longest),'seqs with run>=8',sum(l>=8 for l in longest),
          'min distinct frac %.2f'%min(distinct), 'mean distinct %.2f'%(sum(distinct)/n),
          'top4gram', top[0][1], 'uniq tokens', len(set(allgen)))
    print('  info', {k:v for k,v in s['info'].items() if k not in ('prompt_file',)})
