"""Tokenizers for every model we load, behind one small interface, plus the instruct models' chat templates.

    tok = load_tokenizer("checkpoints/SmolLM2-135M-Instruct")   # a folder or a tokenizer file
    ids = tok.encode("Hello", bos=False)
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])  # ends with the assistant header
    text = tok.decode(ids); stop = tok.eos_ids

Backends, chosen by file: tokenizer.json (Hugging Face `tokenizers`: Qwen3, SmolLM2, Llama-3 HF repos),
tokenizer.model (sentencepiece for Llama-2; Llama-3's original file is a tiktoken BPE list instead),
tok*.bin (llama2.c).

Which chat template applies is read from what the conversion copied next to the tokenizer
(tokenizer_config.json's `chat_template`, or chat_template.jinja), by the markers each template
writes: "<|start_header_id|>" -> llama3 (llama3.1 if it adds the "Cutting Knowledge Date" system
header), "<|im_start|>" with "<think>" -> qwen3, other "<|im_start|>" -> chatml, "[INST]" with
"<<SYS>>" -> llama2. A sentencepiece tokenizer with no template of its own gets llama2 when the
checkpoint's config.json beside it is one of model.py's Llama-2 configs (Meta's original files carry
no template). We render these in Python rather than running Jinja; the tests check each against
transformers' apply_chat_template on the published templates.
"""
import base64
import json
import re
import struct
from pathlib import Path
from typing import Optional

# Llama-3's pre-tokenizer split, and its 256 special tokens that follow the 128000 BPE ranks.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NAMED_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                         "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                         "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_N_SPECIALS = 256

CHAT_END_TOKENS = {"llama3": "<|eot_id|>", "llama3.1": "<|eot_id|>", "qwen3": "<|im_end|>", "chatml": "<|im_end|>",
                   "llama2": "</s>"}
# Llama-3.1/3.3 open every chat with this system header. Their template's default date; Llama-3.2's
# template uses today's date instead, which we do not follow (a prompt should not change by the day).
LLAMA31_SYSTEM_PREAMBLE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


class Tokenizer:
    """What all backends share: special ids, the chat template, and encode_chat on top of `_encode`."""

    def __init__(self, bos_id: Optional[int], eos_ids: set, chat_template: Optional[str] = None,
                 default_system_prompt: Optional[str] = None, add_bos: bool = False):
        self.bos_id = bos_id
        self.eos_ids = set(eos_ids)
        self.chat_template = chat_template  # "llama3", "llama3.1", "qwen3", "chatml", "llama2" or None
        self.default_system_prompt = default_system_prompt  # ChatML templates that insert one (SmolLM2)
        self.add_bos = add_bos and bos_id is not None  # the model was trained with BOS at the start

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """bos=True says the text starts a sequence: it then gets the BOS token if the model was trained
        with one (Llama, llama2.c) and nothing if not (Qwen3, SmolLM2, whose configs name a "bos" token
        that their own tokenizers never prepend)."""
        ids = self._encode(text)
        return [self.bos_id] + ids if bos and self.add_bos else ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (a base model?); use a plain prompt")
        return self._encode(render_chat(self.chat_template, messages, add_generation_prompt,
                                        self.default_system_prompt))

    def decode(self, ids) -> str:
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        """Text -> ids, with special-token strings such as "<|im_start|>" read as those tokens."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """tokenizer.json through the `tokenizers` package; special ids from tokenizer_config.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Backend
        self.backend = Backend.from_file(str(path))
        config = read_tokenizer_config(path.parent)
        template = chat_template_name(config.get("chat_template"))
        bos_id = self.token_id(config.get("bos_token"))
        eos_ids = {self.token_id(config.get("eos_token")), self.token_id(CHAT_END_TOKENS.get(template))}
        eos_ids |= set(config.get("generation_eos_ids", []))
        # Whether plain text gets a BOS: the config says so, or the tokenizer's post-processor adds one (Llama-3).
        with_specials = self.backend.encode("a", add_special_tokens=True).ids
        add_bos = config.get("add_bos_token", bos_id is not None and with_specials[:1] == [bos_id])
        super().__init__(bos_id, eos_ids - {None}, template, default_system_prompt(config.get("chat_template")),
                         bool(add_bos))

    def token_id(self, token) -> Optional[int]:
        if isinstance(token, dict):  # older configs store AddedToken objects as dicts
            token = token.get("content")
        return self.backend.token_to_id(token) if token else None

    def _encode(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.backend.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self):
        return self.backend.get_vocab_size()


class SentencePieceTokenizer(Tokenizer):
    """Llama-2's tokenizer.model. Chat template: llama2 where tokenizer_config.json names it or, with no
    template there, where the checkpoint beside it is a Llama-2 model."""

    def __init__(self, path: Path):
        import sentencepiece
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        bos_id, eos_id = self.processor.bos_id(), self.processor.eos_id()
        self.special_ids = {self.processor.id_to_piece(i): i for i in (bos_id, eos_id) if i >= 0}  # "<s>", "</s>"
        jinja = read_tokenizer_config(path.parent).get("chat_template")
        template = chat_template_name(jinja) or ("llama2" if not jinja and is_llama2_checkpoint(path.parent) else None)
        super().__init__(bos_id, {eos_id}, chat_template=template, add_bos=True)

    def _encode(self, text):
        # BOS/EOS written as text ("<s>", "</s>": the llama2 template does) become their ids, and each
        # stretch between them is encoded on its own, with its own leading dummy-prefix space. That is
        # how Meta's reference builds a Llama-2 chat prompt: BOS + encode(turn) + EOS, turn by turn.
        pieces = re.split("(" + "|".join(map(re.escape, self.special_ids)) + ")", text) if self.special_ids else [text]
        ids = []
        for piece in pieces:
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids += self.processor.encode(piece)
        return ids

    def decode(self, ids):
        return self.processor.decode(list(ids))

    @property
    def vocab_size(self):
        return self.processor.vocab_size()


class TiktokenTokenizer(Tokenizer):
    """Llama-3's original tokenizer.model: lines of "<base64 token> <rank>", then 256 special tokens."""

    def __init__(self, path: Path):
        import tiktoken
        ranks = read_tiktoken_ranks(path)
        names = LLAMA3_NAMED_SPECIALS + [f"<|reserved_special_token_{i}|>"
                                         for i in range(2, 2 + LLAMA3_N_SPECIALS - len(LLAMA3_NAMED_SPECIALS))]
        specials = {name: len(ranks) + i for i, name in enumerate(names)}
        self.encoding = tiktoken.Encoding(path.name, pat_str=LLAMA3_SPLIT, mergeable_ranks=ranks,
                                          special_tokens=specials)
        eos = {specials["<|end_of_text|>"], specials["<|eot_id|>"], specials["<|eom_id|>"]}
        # Llama-3 and 3.1 share this file; a tokenizer_config.json beside it tells their templates apart.
        template = chat_template_name(read_tokenizer_config(path.parent).get("chat_template")) or "llama3"
        super().__init__(specials["<|begin_of_text|>"], eos, chat_template=template, add_bos=True)

    def _encode(self, text):
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids):
        return self.encoding.decode(list(ids))

    @property
    def vocab_size(self):
        return self.encoding.n_vocab


class Llama2cTokenizer(Tokenizer):
    """llama2.c's tok*.bin: int32 max_token_length, then per token float32 score, int32 length, bytes.

    Encoding follows llama2.c's `encode`: a leading space (sentencepiece's dummy prefix), one token per
    UTF-8 character (unknown characters fall back to byte tokens <0x00>.. at ids 3..258), then merge the
    adjacent pair whose merged piece scores best, until no pair merges.
    """
    BOS, EOS, FIRST_BYTE_TOKEN = 1, 2, 3

    def __init__(self, path: Path):
        data = path.read_bytes()
        self.pieces, self.scores = [], []
        offset = 4  # skip max_token_length
        while offset < len(data):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            self.pieces.append(data[offset:offset + length])
            self.scores.append(score)
            offset += length
        self.piece_ids = {piece: i for i, piece in enumerate(self.pieces)}
        super().__init__(self.BOS, {self.EOS}, add_bos=True)

    def _encode(self, text):
        if not text:
            return []
        ids = []
        for char in " " + text:
            piece = char.encode("utf-8")
            if piece in self.piece_ids:
                ids.append(self.piece_ids[piece])
            else:
                ids.extend(self.FIRST_BYTE_TOKEN + b for b in piece)
        while True:
            best = None  # (score, position, merged id)
            for i in range(len(ids) - 1):
                merged = self.piece_ids.get(self.pieces[ids[i]] + self.pieces[ids[i + 1]])
                if merged is not None and (best is None or self.scores[merged] > best[0]):
                    best = (self.scores[merged], i, merged)
            if best is None:
                return ids
            _, i, merged = best
            ids[i:i + 2] = [merged]

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            if i in (self.BOS, self.EOS):
                continue
            piece = self.pieces[i]
            byte_token = re.fullmatch(rb"<0x([0-9A-Fa-f]{2})>", piece)
            out += bytes([int(byte_token[1], 16)]) if byte_token else piece
        text = out.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text  # drop the dummy prefix, like sentencepiece

    @property
    def vocab_size(self):
        return len(self.pieces)


# ---------------------------------------------------------------------------------------------
# Finding and loading


def load_tokenizer(path) -> Tokenizer:
    """A tokenizer file, or a folder holding tokenizer.json, tokenizer.model or tok*.bin (in that order)."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "tokenizer.json", path / "tokenizer.model", *sorted(path.glob("tok*.bin"))]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"no tokenizer.json, tokenizer.model or tok*.bin in {path}")
        path = found
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.suffix == ".bin":
        return Llama2cTokenizer(path)
    if path.suffix == ".model":
        return TiktokenTokenizer(path) if is_tiktoken_file(path) else SentencePieceTokenizer(path)
    raise ValueError(f"unknown tokenizer file type: {path}")


def find_tokenizer(checkpoint_path, metadata: Optional[dict] = None) -> Path:
    """The tokenizer for a checkpoint: beside it, else in metadata["tokenizer_dir"] (pruned checkpoints
    written elsewhere point back to their source). Pass metadata if already loaded."""
    checkpoint_path = Path(checkpoint_path)
    folders = [checkpoint_path.parent]
    if metadata is None and checkpoint_path.is_file():
        from checkpoint import load_checkpoint
        _, _, metadata = load_checkpoint(checkpoint_path)
    if metadata and metadata.get("tokenizer_dir"):
        folders.append(Path(metadata["tokenizer_dir"]))
    for folder in folders:
        if any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model")) or any(folder.glob("tok*.bin")):
            return folder
    raise FileNotFoundError(f"no tokenizer beside {checkpoint_path} or in its metadata's tokenizer_dir")


def is_tiktoken_file(path: Path) -> bool:
    """A tiktoken BPE file is text lines "<base64> <rank>"; a sentencepiece model is a binary protobuf."""
    with open(path, "rb") as f:
        first_line = f.readline(200)
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", first_line) is not None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def is_llama2_checkpoint(folder: Path) -> bool:
    """Whether the config.json that save_checkpoint wrote in `folder` is one of model.py's Llama-2
    configs. norm_eps is left out of the comparison: early Hugging Face Llama-2 configs said 1e-6."""
    from model import ModelArgs, transformer_configs

    def without_norm_eps(config: dict) -> dict:
        return {k: v for k, v in ModelArgs(**config).to_dict().items() if k != "norm_eps"}

    try:
        ours = without_norm_eps(json.loads((folder / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, TypeError, ValueError):  # absent, or not our config format
        return False
    return any(without_norm_eps(config) == ours for name, config in transformer_configs.items()
               if name.startswith("Llama-2"))


def read_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, with chat_template.jinja (newer HF repos) and generation_config.json's
    eos ids folded in."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if (folder / "chat_template.jinja").is_file():
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
    if isinstance(config.get("chat_template"), list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in config["chat_template"]}
        config["chat_template"] = named.get("default")
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text()).get("eos_token_id")
        config["generation_eos_ids"] = [eos] if isinstance(eos, int) else list(eos or [])
    return config


# ---------------------------------------------------------------------------------------------
# Chat templates


def chat_template_name(jinja: Optional[str]) -> Optional[str]:
    if not jinja:
        return None
    if "<|start_header_id|>" in jinja:
        return "llama3.1" if "Cutting Knowledge Date" in jinja else "llama3"
    if "<|im_start|>" in jinja:
        return "qwen3" if "<think>" in jinja else "chatml"
    if "[INST]" in jinja and "<<SYS>>" in jinja:  # Mistral's [INST] templates have no <<SYS>> block
        return "llama2"
    return None


def default_system_prompt(jinja: Optional[str]) -> Optional[str]:
    """The system message a ChatML template writes when the conversation has none (SmolLM2's)."""
    found = re.search(r"""['"]<\|im_start\|>system(?:\n|\\n)([^'"{}]+?)<\|im_end\|>""", jinja or "")
    return found[1].replace("\\n", "\n") if found else None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                default_system: Optional[str] = None) -> str:
    if template in ("llama3", "llama3.1"):
        text = "<|begin_of_text|>"
        if template == "llama3.1":  # the system turn is always there, its message after the preamble
            system = ""
            if messages and messages[0]["role"] == "system":
                system, messages = messages[0]["content"].strip(), messages[1:]
            text += f"<|start_header_id|>system<|end_header_id|>\n\n{LLAMA31_SYSTEM_PREAMBLE}{system}<|eot_id|>"
        text += "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                        for m in messages)
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")
    if template == "chatml":
        if default_system and messages and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": default_system}] + list(messages)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    if template == "qwen3":
        return render_qwen3(messages, add_generation_prompt)
    if template == "llama2":
        return render_llama2(messages)
    raise ValueError(f"unknown chat template '{template}'")


def render_qwen3(messages: list[dict], add_generation_prompt: bool) -> str:
    """Qwen3's template in non-thinking mode (enable_thinking=False), without tools.

    It is ChatML, except for assistant turns: their <think>..</think> part is dropped from history,
    an assistant turn after the last user message keeps it, and the generation prompt opens with an
    empty think block, which is what switches thinking off."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    text = ""
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] != "assistant":
            text += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
            continue
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_user and (i == len(messages) - 1 or reasoning):
            reasoning, content = reasoning.strip("\n"), content.lstrip("\n")
            text += f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}"
        else:
            text += f"<|im_start|>assistant\n{content}"
        text += "<|im_end|>\n"
    return text + ("<|im_start|>assistant\n<think>\n\n</think>\n\n" if add_generation_prompt else "")


def render_llama2(messages: list[dict]) -> str:
    """Llama-2-chat's format, as Meta's reference chat_completion builds it: each user turn is
    "<s>[INST] {user} [/INST]", each assistant reply " {reply} </s>", and a system message is folded
    into the first user turn between <<SYS>> markers. A prompt ending in [/INST] is already the
    generation prompt, so there is no add_generation_prompt."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    text = ""
    for i, m in enumerate(messages):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise ValueError("Llama-2 chat needs alternating user/assistant turns, starting with the user")
        if m["role"] == "assistant":
            text += f" {m['content'].strip()} </s>"
            continue
        content = m["content"] if i > 0 or system is None else f"<<SYS>>\n{system}\n<</SYS>>\n\n{m['content']}"
        text += f"<s>[INST] {content.strip()} [/INST]"
    return text
