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
             for name, file in [("llama3", "llama3"), ("llama3.1", "llama31"), ("qwen3", "qwen3"), ("chatml", "smollm2"),
                                ("llama2", "llama2")]}
# The special tokens each template writes through its bos_token / eos_token variables.
TEMPLATE_SPECIALS = {"llama2": dict(bos_token="<s>", eos_token="</s>")}

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


def jinja_renderer(template):
    """transformers' apply_chat_template on a bare tokenizer: only the template and special tokens matter."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    specials = TEMPLATE_SPECIALS.get(template, dict(bos_token="<|begin_of_text|>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), **specials)


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_match_published_jinja(template, add_generation_prompt):
    jinja, renderer = TEMPLATES[template], jinja_renderer(template)
    assert chat_template_name(jinja) == template
    for messages in CONVERSATIONS:
        expected = renderer.apply_chat_template(messages, chat_template=jinja, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, enable_thinking=False)
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


def write_tiny_sentencepiece_model(folder: Path, sentences, vocab_size=60, **options):
    """A BPE sentencepiece model trained on `sentences`, as folder/tokenizer.model; returns its processor."""
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, model_type="bpe",
                                             vocab_size=vocab_size, bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
                                             **options)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def test_sentencepiece_model_loads(tmp_path):
    sentences = ["the quick brown fox jumps over the lazy dog", "hello world", "a tiny sentencepiece model"] * 20
    reference = write_tiny_sentencepiece_model(tmp_path, sentences)
    tok = load_tokenizer(tmp_path / "tokenizer.model")
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.encode("hello world", bos=True) == [1] + reference.encode("hello world")
    assert tok.decode(tok.encode("the lazy fox")) == "the lazy fox"
    assert tok.eos_ids == {2} and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def meta_llama2_chat_ids(processor, messages) -> list[int]:
    """Llama-2-chat's prompt as Meta's reference chat_completion assembles it, from the sentencepiece
    processor directly: BOS + encode("[INST] {user} [/INST] {answer} ") + EOS per exchange, then
    BOS + encode("[INST] {last user} [/INST]"); a system message opens the first user message."""
    if messages[0]["role"] == "system":
        first = f"<<SYS>>\n{messages[0]['content']}\n<</SYS>>\n\n{messages[1]['content']}"
        messages = [{"role": "user", "content": first}] + messages[2:]
    ids = []
    for user, answer in zip(messages[::2], messages[1::2]):
        text = f"[INST] {user['content'].strip()} [/INST] {answer['content'].strip()} "
        ids += [processor.bos_id()] + processor.encode(text) + [processor.eos_id()]
    if len(messages) % 2:
        ids += [processor.bos_id()] + processor.encode(f"[INST] {messages[-1]['content'].strip()} [/INST]")
    return ids


@pytest.fixture
def llama2_style_sentencepiece(tmp_path):
    """A tiny tokenizer.model normalised the way Llama-2's is: no whitespace folding, byte fallback."""
    sentences = [m["content"] for conversation in CONVERSATIONS for m in conversation] * 10
    sentences += ["[INST] <<SYS>> [/INST] <</SYS>>", "the quick brown fox jumps over the lazy dog"] * 10
    processor = write_tiny_sentencepiece_model(tmp_path, sentences, vocab_size=400, byte_fallback=True,
                                               remove_extra_whitespaces=False, normalization_rule_name="identity")
    return tmp_path, processor


def test_llama2_chat_ids_match_metas_reference(llama2_style_sentencepiece):
    folder, processor = llama2_style_sentencepiece
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES["llama2"]}))
    tok = load_tokenizer(folder)
    assert tok.chat_template == "llama2" and tok.eos_ids == {processor.eos_id()}
    for messages in CONVERSATIONS:
        assert tok.encode_chat(messages) == meta_llama2_chat_ids(processor, messages), messages
    assert tok.encode("hello world", bos=True) == [processor.bos_id()] + processor.encode("hello world")
    with pytest.raises(ValueError, match="alternating"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_llama2_template_comes_from_a_llama2_checkpoint_config(llama2_style_sentencepiece):
    """Meta's original Llama-2 files have no tokenizer_config.json; the checkpoint's config.json says Llama-2."""
    from model import ModelArgs
    folder, _ = llama2_style_sentencepiece
    assert load_tokenizer(folder).chat_template is None
    for name, expected in [("Llama-2-7b", "llama2"), ("Llama-2-70b", "llama2"), ("Meta-Llama-3-8B", None)]:
        config = ModelArgs.from_name(name).to_dict()
        config["norm_eps"] = 1e-6
        (folder / "config.json").write_text(json.dumps(config))
        assert load_tokenizer(folder).chat_template == expected, name
    # A template of its own that we do not render wins over the config: no guessing llama2 then.
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert load_tokenizer(folder).chat_template is None


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
