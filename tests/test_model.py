"""model.py (through convert_hf.py) against transformers: same logits for the same tokens, for a full
prefill and for token-by-token decode through the KV cache; and the real models we have offline.

Logits are compared in float32 within 1e-4 absolute (+1e-5 relative, which only matters for the
30-layer SmolLM2 whose logits reach ~35: summation order differs between the two implementations).
"""
import pytest
import torch

from checkpoint import load_checkpoint
from model import Transformer
from convert import convert_hf_folder
from conftest import TINY_HF_CONFIGS

TOLERANCE = dict(atol=1e-4, rtol=1e-5)


def load_ours(checkpoint_path, max_seq_length):
    state_dict, config, _ = load_checkpoint(checkpoint_path)
    model = Transformer(config)
    model.load_state_dict(state_dict)
    model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
    return model.eval()


@torch.no_grad()
def assert_logits_match(ours: Transformer, reference, tokens: torch.Tensor):
    """Prefill of the whole sequence, then a fresh cache fed one token at a time, both against
    transformers' logits for the whole sequence."""
    expected = reference(tokens).logits
    positions = torch.arange(tokens.shape[1])
    torch.testing.assert_close(ours(tokens, positions), expected, **TOLERANCE)
    # Decode from the first token on: each step sees the earlier ones only through the KV cache.
    # (Stale cache slots beyond the current position are masked, so the cache needs no reset.)
    single_steps = [ours(tokens[:, t:t + 1], positions[t:t + 1]) for t in range(tokens.shape[1])]
    torch.testing.assert_close(torch.cat(single_steps, dim=1), expected, **TOLERANCE)


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
@pytest.mark.parametrize("name", list(TINY_HF_CONFIGS))
def test_tiny_hf_model_matches_transformers(tiny_hf_folder, tmp_path, name, layout):
    folder, reference = tiny_hf_folder(name, layout)
    convert_hf_folder(folder, tmp_path, dtype=torch.float32)
    ours = load_ours(tmp_path / "model.pth", max_seq_length=64)
    assert ours.config.tie_embeddings == reference.config.tie_word_embeddings
    tokens = torch.randint(0, reference.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours, reference, tokens)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
LONG_ANSWER_CHAT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def test_smollm2_logits_match_transformers_gguf(smollm2_checkpoint, smollm2_reference):
    from tokenizer import load_tokenizer
    tokens = torch.tensor([load_tokenizer(smollm2_checkpoint.parent).encode_chat(CHAT)])
    ours = load_ours(smollm2_checkpoint, max_seq_length=tokens.shape[1])
    assert ours.config.n_layer == 30 and ours.config.dim == 576 and ours.config.tie_embeddings
    assert_logits_match(ours, smollm2_reference, tokens)


def greedy_ours_and_transformers(checkpoint, reference, chat, new_tokens, reference_new_tokens):
    """(tokenizer, our generate() result, transformers' greedy sequence) for one chat prompt."""
    from generate import generate, load_model
    from tokenizer import load_tokenizer
    tokenizer = load_tokenizer(checkpoint.parent)
    prompt = torch.tensor(tokenizer.encode_chat(chat))
    expected = reference.generate(prompt[None], max_new_tokens=reference_new_tokens, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0]
    model = load_model(checkpoint, device="cpu", dtype=torch.float32)
    return tokenizer, generate(model, [prompt], max_new_tokens=new_tokens, eos_ids=tokenizer.eos_ids), expected


def test_smollm2_greedy_matches_transformers_generate(smollm2_checkpoint, smollm2_reference):
    tokenizer, result, expected = greedy_ours_and_transformers(smollm2_checkpoint, smollm2_reference,
                                                               LONG_ANSWER_CHAT, 32, 32)
    assert len(result.new_tokens[0]) == 32  # the story does not end within 32 tokens
    assert result.sequences[0].tolist() == expected.tolist()
    assert "robot" in tokenizer.decode(result.new_tokens[0]).lower()


@pytest.fixture(scope="module")
def qwen_coder_reference(qwen_coder_checkpoint):
    """transformers' own Qwen2 reading the GGUF our checkpoint was converted from."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    gguf_file = next(qwen_coder_checkpoint.parent.glob("*.gguf"))
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()


CODE_CHAT = [{"role": "user", "content": "Write a Python function `running_max(xs)` that returns the list of "
                                         "running maxima of a list of numbers. Reply with a ```python code block."}]


@pytest.mark.slow
def test_qwen_coder_tokenizer_and_chat_template_match_transformers(qwen_coder_checkpoint):
    """Our tokenizer built from the GGUF (Qwen2's pre-tokenizer split) and our ChatML rendering with
    Qwen's default system prompt, against transformers' tokenizer and Jinja template from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    from tokenizer import load_tokenizer
    gguf_file = next(qwen_coder_checkpoint.parent.glob("*.gguf"))
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ours = load_tokenizer(qwen_coder_checkpoint.parent)
    texts = ["def f(x):\n    return x ** 2  # 12345 squared\n\n\n", "Ünïcode café, naïve — 東京 123.45e-6",
             "  leading spaces\tand\r\nCRLF <|im_start|> specials <|endoftext|>", "x=[1,2,3];y={'a':1}"]
    for text in texts:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text
    system_chat = [{"role": "system", "content": "Be brief."}] + CODE_CHAT
    for chat in (CODE_CHAT, system_chat):
        expected = reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert ours.encode_chat(chat) == list(expected)
    assert ours.eos_ids == {reference.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.slow
def test_qwen_coder_logits_match_transformers_gguf(qwen_coder_checkpoint, qwen_coder_reference):
    from tokenizer import load_tokenizer
    tokenizer = load_tokenizer(qwen_coder_checkpoint.parent)
    ours = None
    for chat in (CHAT, CODE_CHAT):
        tokens = torch.tensor([tokenizer.encode_chat(chat)])
        ours = ours or load_ours(qwen_coder_checkpoint, max_seq_length=128)
        assert ours.config.architecture == "qwen2" and ours.config.n_layer == 24 and ours.config.dim == 896
        assert_logits_match(ours, qwen_coder_reference, tokens)


@pytest.mark.slow
def test_qwen_coder_greedy_matches_transformers_and_solves_a_humaneval_task(qwen_coder_checkpoint, qwen_coder_reference):
    """Greedy decoding of HumanEval/7 as evaluation.code_tasks asks it, in the chat template: the first
    24 tokens are transformers' own, and the reply passes the task's own tests in the sandbox."""
    from evaluation.code_tasks import humaneval_tasks, score_replies
    try:
        task = next(t for t in humaneval_tasks() if t.task_id == "HumanEval/7")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tokenizer, result, expected = greedy_ours_and_transformers(
        qwen_coder_checkpoint, qwen_coder_reference, [{"role": "user", "content": task.prompt}], 384, 24)
    assert result.sequences[0][:len(expected)].tolist() == expected.tolist()
    assert result.new_tokens[0][-1].item() in tokenizer.eos_ids  # the reply ended on its own
    reply = tokenizer.decode(result.new_tokens[0][:-1])
    assert score_replies([task], [reply])["passed"] == 1, reply


def test_stories260k_greedy_from_bos(stories260k_dir, tmp_path):
    from generate import generate, load_model
    from convert import convert_llama2c
    from tokenizer import load_tokenizer
    convert_llama2c(stories260k_dir / "stories260K.bin", tmp_path)
    model = load_model(tmp_path / "model.pth", device="cpu", dtype=torch.float32)
    tokenizer = load_tokenizer(tmp_path)
    result = generate(model, [torch.tensor([tokenizer.bos_id])], max_new_tokens=20, eos_ids=tokenizer.eos_ids)
    assert tokenizer.decode(result.sequences[0]).startswith("Once upon a time, there was a little girl named Lily")


def write_tiny_gguf(model, path, add_more=None, quantize=None):
    """A GGUF of a transformers Llama or Qwen2, written the way llama.cpp's converter does: its names
    and, for Llama, q/k rows permuted from rotate-half to interleaved RoPE pairs (Qwen2 keeps them,
    and its q/k/v biases are tensors of their own). The vocabulary is the 256 byte-level characters
    and no merges. quantize(gguf_name, float32 array) may return (bytes as uint8 array, its GGML
    type) to store a tensor quantized, or None to keep it float32. add_more(writer) may add metadata
    and tensors of its own."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import pre_tokenizers
    c = model.config
    architecture = c.model_type  # "llama" or "qwen2": the GGUF keys are named after it

    def to_interleaved(w, n_heads):  # llama.cpp's direction; the converter must undo it
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
             "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for hf_name, weight in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = hf_name.split(".")
        layer = f"blk.{parts[2]}." if parts[1] == "layers" else ""
        if architecture == "llama" and parts[-2] == "q_proj":
            weight = to_interleaved(weight, c.num_attention_heads)
        elif architecture == "llama" and parts[-2] == "k_proj":
            weight = to_interleaved(weight, c.num_key_value_heads)
        name = f"{layer}{names[parts[-2]]}.{parts[-1]}"
        quantized = quantize(name, weight.numpy()) if quantize is not None else None
        if quantized is None:
            writer.add_tensor(name, weight.numpy())
        else:
            writer.add_tensor(name, quantized[0], raw_dtype=quantized[1])
    if add_more is not None:
        add_more(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
def test_tiny_gguf_matches_transformers(tiny_hf_folder, tmp_path, name):
    """The GGUF path without the embedded model: names, the q/k un-permutation and tying."""
    from convert import convert_gguf
    from tokenizer import load_tokenizer
    _, reference = tiny_hf_folder(name)
    write_tiny_gguf(reference, tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", torch.float32)
    ours = load_ours(tmp_path / "out" / "model.pth", max_seq_length=64)
    assert ours.config.tie_embeddings == reference.config.tie_word_embeddings
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    assert_logits_match(ours, reference, tokens)
    tokenizer = load_tokenizer(tmp_path / "out")
    assert tokenizer.decode(tokenizer.encode("byte-level: ünïcode ✓")) == "byte-level: ünïcode ✓"


@torch.no_grad()
def test_last_position_only_gives_the_last_row_of_the_full_logits():
    """What a prefill asks for: the logits of the last position, as the full forward computes them."""
    from model import ModelArgs
    torch.manual_seed(0)
    model = Transformer(ModelArgs(architecture="qwen2", qkv_bias=True, dim=64, n_layer=2, n_head=4, n_local_heads=2,
                                  intermediate_size=96, vocab_size=50, block_size=32)).eval()
    model.setup_caches(2, 32)
    tokens = torch.randint(0, 50, (2, 7))
    last = model(tokens, torch.arange(7), last_position_only=True)
    assert last.shape == (2, 1, 50)
    torch.testing.assert_close(last, model(tokens, torch.arange(7))[:, -1:])


@torch.no_grad()
def test_kv_cache_with_more_rows_than_the_batch_matches_an_exact_cache():
    """A cache set up for 8 rows serving a batch of 3 (generate() keeps a larger cache it already
    has): prefill and decode give the logits of a cache of exactly 3 rows, eager and compiled, and
    the rows past the batch stay untouched."""
    from model import ModelArgs
    torch.manual_seed(0)
    config = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=96, vocab_size=50,
                       block_size=32)
    wide, exact = Transformer(config).eval(), Transformer(config).eval()
    exact.load_state_dict(wide.state_dict())
    wide.setup_caches(8, 32)
    exact.setup_caches(3, 32)
    tokens = torch.randint(0, 50, (3, 7))
    torch.testing.assert_close(wide(tokens[:, :5], torch.arange(5)), exact(tokens[:, :5], torch.arange(5)))
    torch.testing.assert_close(wide(tokens[:, 5:6], torch.tensor([5])), exact(tokens[:, 5:6], torch.tensor([5])))
    compiled = torch.compile(wide, fullgraph=True)
    torch.testing.assert_close(compiled(tokens[:, 6:], torch.tensor([6])), exact(tokens[:, 6:], torch.tensor([6])))
    cache = wide.layers[0].attention.kv_cache
    assert cache.k_cache[:3, :, :7].abs().sum() > 0 and not cache.k_cache[3:].any() and not cache.v_cache[3:].any()
    assert not cache.k_cache[:3, :, 7:].any()


@torch.no_grad()
def test_decode_attention_plug_takes_the_decode_steps_whole():
    """A plug in Attention.decode_attention gets a decode step (one token a row, with a KV cache): the
    qkv projection's output by head, the model's whole RoPE tables and padding, the position, the
    layer's caches and Qwen3's q/k norm weights and eps; the prefill stays plain PyTorch."""
    from model import ModelArgs
    torch.manual_seed(0)
    model = Transformer(ModelArgs(architecture="qwen3", dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=16,
                                  intermediate_size=96, vocab_size=50, block_size=32, qk_norm=True)).eval()
    model.setup_caches(2, 32)
    calls = []

    def plug(qkv, rope_cos, rope_sin, left_pad, input_pos, k_cache, v_cache, q_norm_weight, k_norm_weight, eps):
        calls.append((tuple(qkv.shape), rope_cos is model.rope_cos and rope_sin is model.rope_sin,
                      left_pad is model.left_pad, input_pos.tolist(), k_cache, v_cache, q_norm_weight, eps))
        return qkv.new_zeros(qkv.shape[0], 4, 16)

    for layer in model.layers:
        layer.attention.decode_attention = plug
    tokens = torch.randint(0, 50, (2, 6))
    model(tokens[:, :5], torch.arange(5))
    assert calls == []
    model(tokens[:, 5:], torch.tensor([5]))
    assert [c[:4] for c in calls] == [((2, 4 + 2 * 2, 16), True, True, [5])] * 2
    for call, layer in zip(calls, model.layers):
        attention = layer.attention
        assert call[4] is attention.kv_cache.k_cache and call[5] is attention.kv_cache.v_cache
        assert call[6] is attention.q_norm.weight and call[7] == attention.q_norm.eps
