"""Pruning for sparse decoding: SparseGPT, Wanda and magnitude backends over shared calibration
statistics, teacher-forced or decoding-aware calibration, and a layer-sequential driver that
writes packed checkpoints. Command line: `python -m prune --help`.

    source = read_source("model.pth")                      # the one read of the checkpoint
    calibration = text_windows(tokenizer, "c4_sample.jsonl", 32768, 2048, seed=0)  # or calibrate_by_decoding
    pruned = prune_model(source.model, calibration, "sparsegpt", "2:4", metadata=source.provenance())
    pruned.save("pruned.pth")                              # atomically
"""
from prune.calibration import CalibrationError, CalibrationSet, text_windows
from prune.run import METHODS, PrunedCheckpoint, Source, calibrate_by_decoding, prune_model, read_source

__all__ = ["CalibrationError", "CalibrationSet", "METHODS", "PrunedCheckpoint", "Source", "calibrate_by_decoding",
           "prune_model", "read_source", "text_windows"]
