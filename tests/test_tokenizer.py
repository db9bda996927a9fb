"""tokenizer.py against independent references: transformers' GGUF tokenizer and apply_chat_template,
sentencepiece and tiktoken themselves, and llama2.c's tokenizer file."""
import base64
import json
import io
from pathlib import Path

import pytest

from tokenizer import (Llama2cTokenizer, SentencePieceTokenizer, TiktokenTokenizer, chat_template_name,
                       default_system_prompt, find_tokenizer, load_tokenizer, render_chat)

DATA = Path(__file__).parent / "data"
TEMPLATES = {name: (DATA / f"{file}_chat_template.jinja").read_text()
             for name, file in [("llama3", "llama3"), ("llama3.1", "llama31"), ("qwen3", "qwen3"), ("chatml", "smollm2")]}

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Numbers: 3.14159, 2026-11-29, 1234567890 and 42nd.",
    "Unicode: naïve café, Straße, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά.",
    "def f(x):\n\treturn {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
    "tabs\tand\r\nwindows\nnewlines\n\n\n",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hi there!  "}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\n"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer one"}, {"role": "user", "content": "q2"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nstep\n</think>\n\nfinal"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "plain answer"}],
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_checkpoint):
    return load_tokenizer(smollm2_checkpoint.parent)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_json_matches_transformers(smollm2_tokenizer, hf_gguf_tokenizer, text):
    expected = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.encode(text) == expected
    assert smollm2_tokenizer.decode(expected) == hf_gguf_tokenizer.decode(expected)
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_smollm2_special_ids_and_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.chat_template == "chatml"
    assert tok.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert tok.encode("<|im_end|>") == [2] and 2 in tok.eos_ids
    assert tok.add_bos is False and tok.vocab_size == 49152
    assert tok.encode("Hi", bos=True) == tok.encode("Hi")  # SmolLM2 is not trained with a BOS token


def test_smollm2_encode_chat_matches_transformers(smollm2_tokenizer, hf_gguf_tokenizer):
    for messages in CONVERSATIONS:
        expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False)
        assert smollm2_tokenizer.encode_chat(messages) == list(expected)


@pytest.fixture(scope="module")
def jinja_renderer():
    """transformers' apply_chat_template on a bare tokenizer: only the template and bos_token matter."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()),
                                                bos_token="<|begin_of_text|>")


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_match_published_jinja(jinja_renderer, template, add_generation_prompt):
    jinja = TEMPLATES[template]
    assert chat_template_name(jinja) == template
    for messages in CONVERSATIONS:
        expected = jinja_renderer.apply_chat_template(messages, chat_template=jinja, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      enable_thinking=False)
        got = render_chat(template, messages, add_generation_prompt, default_system_prompt(jinja))
        assert got == expected, f"{template}: {messages}"


def test_template_names_and_default_system_prompt():
    assert chat_template_name(None) is None and chat_template_name("{{ messages }}") is None
    assert default_system_prompt(TEMPLATES["qwen3"]) is None
    assert default_system_prompt(TEMPLATES["llama3"]) is None and default_system_prompt(TEMPLATES["llama3.1"]) is None
    qwen25_style = "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\\n' }}"
    assert default_system_prompt(qwen25_style) == "You are Qwen, created by Alibaba Cloud."


def write_tiny_tiktoken_file(path: Path):
    """256 single bytes, then a few merges, in tiktoken's "<base64> <rank>" format."""
    tokens = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b" wor", b" world"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return len(tokens)


def test_tiktoken_file_loads_and_round_trips(tmp_path):
    n_ranks = write_tiny_tiktoken_file(tmp_path / "tokenizer.model")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == n_ranks + 256
    assert tok.bos_id == n_ranks  # <|begin_of_text|> is the first special token after the BPE ranks
    assert tok.encode("hello world") == [n_ranks - 4, n_ranks - 1]
    assert tok.encode("hello", bos=True) == [n_ranks, n_ranks - 4]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    eot = n_ranks + 9
    assert eot in tok.eos_ids and n_ranks + 1 in tok.eos_ids
    chat = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert chat[:2] == [n_ranks, n_ranks + 6]  # <|begin_of_text|><|start_header_id|>
    assert tok.decode(chat) == render_chat("llama3", [{"role": "user", "content": "hello"}])
    # Llama-3.1 ships the same file; its tokenizer_config.json beside it selects the 3.1 template.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES["llama3.1"]}))
    assert load_tokenizer(tmp_path).chat_template == "llama3.1"


def test_sentencepiece_model_loads(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentences = ["the quick brown fox jumps over the lazy dog", "hello world", "a tiny sentencepiece model"] * 20
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=60,
                                             model_type="bpe", bos_id=1, eos_id=2, unk_id=0)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    tok = load_tokenizer(tmp_path / "tokenizer.model")
    reference = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.encode("hello world", bos=True) == [1] + reference.encode("hello world")
    assert tok.decode(tok.encode("the lazy fox")) == "the lazy fox"
    assert tok.eos_ids == {2} and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_llama2c_tokenizer(stories260k_dir):
    tok = load_tokenizer(stories260k_dir)
    assert isinstance(tok, Llama2cTokenizer) and tok.vocab_size == 512 and tok.bos_id == 1 and tok.eos_ids == {2}
    for text in ["Once upon a time, there was a little girl named Lily.", "She said: \"Wow!\" 123", "naïve ☃"]:
        ids = tok.encode(text, bos=True)
        assert ids[0] == 1 and tok.decode(ids) == text
    # The merges are greedy by score: a whole common word ends up as few tokens, not letters.
    assert len(tok.encode("Once upon a time")) < len("Once upon a time") / 2


def test_find_tokenizer(tmp_path):
    folder = tmp_path / "source"
    folder.mkdir()
    write_tiny_tiktoken_file(folder / "tokenizer.model")
    assert find_tokenizer(folder / "model.pth", metadata={}) == folder
    elsewhere = tmp_path / "pruned.pth"
    assert find_tokenizer(elsewhere, metadata={"tokenizer_dir": str(folder)}) == folder
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        find_tokenizer(elsewhere, metadata={})


def test_hf_folder_of_a_llama31_style_model(tmp_path):
    """tokenizer.json whose post-processor adds BOS, tokenizer_config.json with the chat template,
    generation_config.json with several eos ids: the layout of the Llama-3.1 hub repos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    vocab = {c: i for i, c in enumerate(["\n"] + [chr(c) for c in range(32, 127)])}  # one token per character
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    bos, eos, eot = (backend.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATES["llama3.1"]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, eot]}))

    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == "llama3.1" and tok.add_bos and tok.bos_id == bos
    assert tok.eos_ids == {eos, eot}
    assert tok.encode("hi", bos=True) == [bos, vocab["h"], vocab["i"]]
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat[0] == bos and chat.count(bos) == 1
    assert tok.decode(chat) == render_chat("llama3.1", [{"role": "user", "content": "hi"}])
