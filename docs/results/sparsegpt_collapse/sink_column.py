"""Layer-11 w2 column 1229 (the position-0 massive-activation channel): rel change and kept fraction per checkpoint."""
import sys, torch
sys.path.insert(0, '/work/main')
from checkpoint import load_checkpoint
from sparse import unpack
W = load_checkpoint('/work/evalrun/smollm2/model.pth', mmap=True)[0]['layers.11.feed_forward.w2.weight'].float()
for path in sys.argv[1:]:
    sd = load_checkpoint(path, mmap=True)[0]
    Wp = unpack(sd['layers.11.feed_forward.w2.values'].float(), sd['layers.11.feed_forward.w2.mask']).float()
    j = 1229
    print(f'{path.split("/")[-1]:50s} column {j}: rel change {((Wp[:, j] - W[:, j]).norm() / W[:, j].norm()).item():.2f}, '
          f'nonzero {int((Wp[:, j] != 0).sum())}/{W.shape[0]}, kept |w| share {(Wp[:, j].norm() / W[:, j].norm()).item():.2f}')
