"""Pruning for sparse decoding: SparseGPT, Wanda and magnitude backends over shared calibration
statistics, teacher-forced or decoding-aware calibration, and a layer-sequential driver that
writes packed checkpoints. Command line: `python -m prune --help`; driver: prune/run.py."""
