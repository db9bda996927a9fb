"""Our checkpoint (dense, or packed N:M) -> a Hugging Face model folder that transformers loads unchanged.

Packed layers are unpacked to dense weights with exact zeros (the portable hand-off format: any
tool that reads safetensors sees the sparsity), fused q/k/v and gate/up are split back into their
Hugging Face tensors by the names and shapes of the transformers model itself, and transformers
writes the config, the safetensors shards and the generation config. The tokenizer files are
copied from the checkpoint's tokenizer folder. The folder is built under a temporary name beside
`out` and renamed when complete.

The architecture comes from the checkpoint's config through convert/hf.py's HF_ARCHITECTURES, the
one table of Hugging Face classes we read; an architecture that can be imported can be exported.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from checkpoint import load_checkpoint, same_file
from convert.hf import HF_ARCHITECTURES, TOKENIZER_FILES
from convert.writer import ConversionError, hf_sources
from model import ModelArgs

# The shard size the hub's own models use; larger single files are awkward to upload and mirror.
MAX_SHARD_SIZE = "5GB"


def check_export_paths(checkpoint, out):
    """Refuse, before any work, a missing checkpoint and an --out that exists with content, sits
    inside a file, or is the checkpoint itself."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_file():
        raise ConversionError(f"checkpoint not found: {checkpoint}")
    if same_file(out, checkpoint):
        raise ConversionError(f"--out {out} is the input checkpoint; choose a new folder")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConversionError(f"--out {out} already exists and is not an empty folder; choose a new one")
    parent = out.resolve().parent
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ConversionError(f"--out {out} is inside {folder}, which is a file")
            if not os.access(folder, os.W_OK):
                raise ConversionError(f"--out {out}: cannot write in {folder}")
            break


def dense_state_dict(state_dict: dict, config: ModelArgs, metadata: dict, source) -> dict:
    """Our state dict with every packed layer unpacked (masks validated first, as on load)."""
    import sparse
    from generate import model_from_state_dict

    model_state = model_from_state_dict(state_dict, config, metadata, source).state_dict()
    dense = {}
    for name, tensor in tqdm(model_state.items(), desc="unpacking", unit="tensor", leave=False):
        if name.endswith(".values"):
            layer = name[:-len(".values")]
            dense[f"{layer}.weight"] = sparse.unpack(tensor, model_state[f"{layer}.mask"])
        elif not name.endswith(".mask"):
            dense[name] = tensor
    return dense


def hf_class_name(config: ModelArgs) -> str:
    for class_name, architecture in HF_ARCHITECTURES.items():
        if architecture == config.architecture:
            return class_name
    raise ConversionError(f"no Hugging Face class for architecture '{config.architecture}'")


def hf_config(config: ModelArgs, dtype: torch.dtype, bos_id, eos_ids):
    """The transformers config of the class `config.architecture` names; transformers fills the
    rest with that class's defaults and writes it in its own current layout."""
    import transformers

    class_name = hf_class_name(config)
    model_type = getattr(transformers, class_name).config_class.model_type
    rope = {"rope_type": "default"} if config.rope_scaling is None else {"rope_type": "llama3", **config.rope_scaling}
    eos = sorted(eos_ids)
    settings = dict(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_local_heads, head_dim=config.head_dim,
        max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps, hidden_act="silu",
        rope_theta=config.rope_base, rope_scaling=rope, tie_word_embeddings=config.tie_embeddings,
        bos_token_id=bos_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
    hf = transformers.AutoConfig.for_model(model_type, **settings)
    hf.architectures = [class_name]
    hf.dtype = dtype
    return hf


def hf_state_dict(dense: dict, config: ModelArgs, hf_shapes: dict) -> dict:
    """Our tensors under Hugging Face's names: each fused tensor split by rows into the tensors it
    was made of (convert.writer.hf_sources), sized as the transformers model's own tensors."""
    tensors = {}
    for key, names in hf_sources(config).items():
        sizes = [hf_shapes[name][0] for name in names]
        for name, part in zip(names, dense[key].split(sizes)):
            tensors[name] = part.contiguous()
    return tensors


def tokenizer_folder(checkpoint: Path, metadata: dict):
    from tokenizer import find_tokenizer

    try:
        folder = find_tokenizer(checkpoint, metadata)
    except FileNotFoundError:
        return None
    # A llama2.c tok*.bin alone has no transformers equivalent.
    return folder if any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model")) else None


def special_ids(folder):
    """(BOS id, EOS ids) from our reading of the tokenizer (None, set() without one)."""
    if folder is None:
        return None, set()
    from tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return tokenizer.bos_id, set(tokenizer.eos_ids)


def copy_tokenizer_files(folder, out: Path) -> list:
    """The Hugging Face tokenizer files of `folder` into `out`. A tokenizer_config.json that names
    no class gets PreTrainedTokenizerFast, so AutoTokenizer loads tokenizer.json exactly as written
    rather than through the model type's own tokenizer class and its defaults."""
    copied = []
    for name in TOKENIZER_FILES:
        if folder is not None and (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
            copied.append(name)
    if "tokenizer.json" in copied:
        path = out / "tokenizer_config.json"
        settings = json.loads(path.read_text()) if path.is_file() else {}
        if "tokenizer_class" not in settings:
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"
            path.write_text(json.dumps(settings, indent=2) + "\n")
            copied = sorted(set(copied) | {"tokenizer_config.json"})
    return copied


def export_to_hf(checkpoint, out, dtype: torch.dtype | None = None) -> Path:
    """Write the Hugging Face folder `out` for `checkpoint`; returns `out`. dtype: of the weights
    (default: the checkpoint's)."""
    import transformers

    checkpoint, out = Path(checkpoint), Path(out)
    check_export_paths(checkpoint, out)
    state_dict, config, metadata = load_checkpoint(checkpoint)
    dense = dense_state_dict(state_dict, config, metadata, checkpoint)
    dtype = dtype or dense["tok_embeddings.weight"].dtype
    folder = tokenizer_folder(checkpoint, metadata)
    bos_id, eos_ids = special_ids(folder)
    settings = hf_config(config, dtype, bos_id, eos_ids)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(settings, dtype=dtype)
    hf_shapes = {name: tensor.shape for name, tensor in hf_model.state_dict().items()}
    tensors = {name: t.to(dtype) for name, t in hf_state_dict(dense, config, hf_shapes).items()}
    if config.tie_embeddings:  # the head is the embedding; transformers saves it once
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    problems = hf_model.load_state_dict(tensors, strict=False, assign=True)
    if problems.missing_keys or problems.unexpected_keys:
        raise ConversionError(f"{checkpoint} does not fit {settings.architectures[0]}: missing "
                              f"{problems.missing_keys[:3]}, unexpected {problems.unexpected_keys[:3]}")
    if config.tie_embeddings:
        hf_model.tie_weights()
    if folder is not None and (folder / "generation_config.json").is_file():
        hf_model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    else:
        hf_model.generation_config = transformers.GenerationConfig.from_model_config(settings)

    tmp = out.resolve().parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        hf_model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
        copied = copy_tokenizer_files(folder, tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above): the complete folder takes its place
        os.rename(tmp, out)
    except BaseException:  # KeyboardInterrupt included: leave nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not copied:
        print(f"warning: no Hugging Face tokenizer files (tokenizer.json, tokenizer.model) beside {checkpoint} "
              f"or in its metadata's tokenizer_dir; {out} has the model only", file=sys.stderr)
    sparsity = (metadata.get("sparsity") or {}).get("pattern")
    print(f"wrote {out}: {settings.architectures[0]}, {dtype}, "
          f"{'dense' if sparsity is None else sparsity + ' sparse as exact zeros'}, "
          f"tokenizer files: {', '.join(copied) or 'none'}")
    return out

