"""Checkpoint files: one `.pth` holding the weights, the model config and metadata.

    {"format": FORMAT, "config": ModelArgs.to_dict(), "state_dict": {...}, "metadata": {...}}

A packed-sparse checkpoint is the same file in which each pruned linear `<name>.weight` is replaced
by `<name>.values` + `<name>.mask`, and `metadata["sparsity"]` says how (see sparse/ and prune/).
A plain GPT-Fast state dict (`model.pth` with a `config.json` beside it) loads too.

Files are written to a temporary name in the same folder and renamed, so an interrupted write
never leaves a half-written checkpoint behind; a temp file left by a killed write is removed by the
next write of the same file. The config travels inside the checkpoint: saving writes that one file
and nothing beside it (a converter writes its own folder's config.json).
"""
import glob
import json
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from model import ModelArgs

FORMAT = "sparsedecoding-checkpoint-v1"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def atomic_write(path, write_fn):
    """Call write_fn(tmp_path), then rename tmp_path to path; remove the temp file on any failure.

    The temp file is named after the process, not made by mkstemp, so write_fn creates it like any
    other file: with the user's umask (mkstemp's would be private, 0600, and stay so after the
    rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path)
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.tmp"))
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt included: never leave the temp file behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_stale_temp_files(path: Path):
    """Remove the temp files of `path` that atomic_write of a process no longer alive left behind
    (SIGKILL or power loss skip its cleanup). Only names atomic_write makes are touched, and a live
    process's temp file is left alone: it may be writing the same target right now."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.tmp")
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        match = pattern.fullmatch(candidate.name)
        if match and not process_alive(int(match.group(1))):
            candidate.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def save_checkpoint(path, state_dict: dict, config: ModelArgs, metadata: dict | None = None):
    """Write one self-describing file (weights, config, metadata) atomically; nothing beside it."""
    payload = {"format": FORMAT, "config": config.to_dict(), "state_dict": state_dict, "metadata": metadata or {}}
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def same_file(a, b) -> bool:
    """Whether paths a and b name one file on disk (the same path, a hard link or a symlink to it)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def checkpoint_file(path) -> Path:
    """The checkpoint a user named: a file as it is, or the one .pth inside a folder (a converted
    model's folder holds model.pth beside its tokenizer). CheckpointError for a folder with none
    or several (listed, so the user can pick one), and for a path that does not exist."""
    path = Path(path)
    if not path.is_dir():
        if not path.is_file():
            raise CheckpointError(f"checkpoint not found: {path}")
        return path
    found = sorted(p for p in path.glob("*.pth") if p.is_file())
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(f"no checkpoint (.pth) in the folder {path}")
    raise CheckpointError(f"the folder {path} holds {len(found)} checkpoints ({', '.join(p.name for p in found)}); "
                          f"pass one of them")


def load_checkpoint(path, mmap: bool = True):
    """Returns (state_dict, ModelArgs, metadata). Raises CheckpointError with one clear line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError) as e:
        if not zipfile.is_zipfile(path):  # torch's error would be about mmap or a pickle opcode
            raise CheckpointError(f"not a checkpoint: {path} (not a torch zip archive, or a truncated one)") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"not a checkpoint: {path} is corrupt or not loadable as weights ({first})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a state dict")
    if obj.get("format") == FORMAT:
        try:
            config = ModelArgs(**obj["config"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} has an invalid config: {e}") from None
        return obj["state_dict"], config, obj.get("metadata", {})
    # A plain state dict (GPT-Fast habit): config.json beside it, else the folder name.
    return obj, config_for_plain_state_dict(path), {}


def config_for_plain_state_dict(path: Path) -> ModelArgs:
    config_path = path.with_name("config.json")
    if config_path.is_file():
        try:
            return ModelArgs(**json.loads(config_path.read_text()))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{config_path} is not a valid model config: {e}") from None
    try:
        return ModelArgs.from_name(path.parent.name)
    except ValueError:
        raise CheckpointError(
            f"{path} is a plain state dict with no config.json beside it, and its folder name "
            f"'{path.parent.name}' names no known model") from None
