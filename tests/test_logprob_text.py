"""Logprob records carry each token's exact bytes and its text (as OpenAI shows tokens), in
the library's results and in the OpenAI dialect's ``logprobs`` (chat's, streamed and not, and
the legacy object of ``/v1/completions``, which spells tokens as chat does).

Oracles: the ``tokenizers`` library's id-to-token mapping read through transformers' own
copy of GPT-2's byte table (the exact bytes), ``tokenizers``' decode of the single id (the
text of a token that is whole UTF-8), and the generated text itself (the tokens' bytes
concatenate to it). SentencePiece-style tokenizers are built in memory with ``tokenizers``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pipeline import TokenLogprob, build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.testing import ByteTokenizer
from stages.tokenize import HFTokenizer
from tests.http_support import config, running
from transports.http import Gateway

KEY = "sk-logprobs"
RAW = tokenizers.Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
CHAR_BYTE = {c: b for b, c in bytes_to_unicode().items()}
ESCAPE = re.compile(r"\\x[0-9a-f]{2}")


def oracle_bytes(token_id: int) -> bytes:
    """The token's bytes from the id-to-token mapping (special tokens: their text)."""
    token = RAW.id_to_token(token_id)
    if token_id in RAW.get_added_tokens_decoder():
        return token.encode()
    return bytes(CHAR_BYTE[c] for c in token)


ID_OF_BYTES = {oracle_bytes(i): i for i in reversed(range(RAW.get_vocab_size()))}


def whole(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def unescape(text: str) -> bytes:
    """The bytes a token's text spells: each ``\\xNN`` is a byte, the rest is UTF-8."""
    out = bytearray()
    for piece in re.split(r"(\\x[0-9a-f]{2})", text):
        out += bytes([int(piece[2:], 16)]) if ESCAPE.fullmatch(piece) else piece.encode()
    return bytes(out)


def check_record(token_id: int, text: str, data: bytes) -> None:
    """``text``/``data`` are right for ``token_id`` by the oracles."""
    assert data == oracle_bytes(token_id)
    if whole(data):
        assert text == RAW.decode([token_id], skip_special_tokens=False)
    else:  # part of a character: tokenizers shows U+FFFD; the text spells the exact bytes
        assert "\ufffd" in RAW.decode([token_id])
        assert ESCAPE.search(text) and unescape(text) == data


def partial_ids(n: int) -> list[int]:
    """``n`` ids of tokens that are part of a UTF-8 character (single bytes >= 0x80)."""
    return [RAW.token_to_id(bytes_to_unicode()[b]) for b in range(0xE4, 0xE4 + n)]


def test_every_record_and_alternative_has_the_tokens_bytes_and_text() -> None:
    with build("tiny") as pipe:
        done = pipe.generate("Write a word in Chinese.", max_tokens=12, temperature=0.9,
                             top_k=0, top_p=1.0, seed=4, logprobs=True, top_logprobs=5)
    assert done.logprobs is not None and len(done.logprobs) == done.usage.completion_tokens
    for lp in done.logprobs:
        assert lp.text is not None and lp.token_bytes is not None
        check_record(lp.token_id, lp.text, lp.token_bytes)
        assert len(lp.top) == 5
        for alt in lp.top:
            assert alt.text is not None and alt.token_bytes is not None
            check_record(alt.token_id, alt.text, alt.token_bytes)
    spoken = [lp for lp in done.logprobs if lp.token_id not in RAW.get_added_tokens_decoder()]
    assert b"".join(lp.token_bytes or b"" for lp in spoken).decode(
        "utf-8", errors="replace") == done.text


def test_partial_characters_show_as_escapes_with_exact_bytes() -> None:
    allowed = partial_ids(3)  # only "\xe4", "\xe5", "\xe6": every output byte is partial
    with build("tiny") as pipe:
        done = pipe.generate("hi", max_tokens=6, temperature=1.0, seed=1, logprobs=True,
                             top_logprobs=3, allowed_token_ids=allowed)
    assert done.logprobs is not None
    for lp in done.logprobs:
        byte = oracle_bytes(lp.token_id)
        assert lp.token_bytes == byte and len(byte) == 1 and byte[0] >= 0xE4
        assert lp.text == f"\\x{byte[0]:02x}"
        assert sorted(a.token_id for a in lp.top) == sorted(allowed)
        for alt in lp.top:
            assert alt.text == f"\\x{oracle_bytes(alt.token_id)[0]:02x}"
    joined = b"".join(lp.token_bytes or b"" for lp in done.logprobs)
    assert joined.decode("utf-8", errors="replace") == done.text  # what the stream showed


def test_forced_and_streamed_records_are_labelled_too() -> None:
    with build("tiny") as pipe:
        prefix = pipe.stages.tokenizer.encode_text("日本")  # type: ignore[union-attr]
        deltas = list(pipe.stream("hi", max_tokens=len(prefix), temperature=0, logprobs=True,
                                  forced_prefix=prefix))
    records = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in records] == prefix
    assert b"".join(lp.token_bytes or b"" for lp in records) == "日本".encode()
    for lp in records:
        check_record(lp.token_id, lp.text or "", lp.token_bytes or b"")


def test_the_fake_tokenizer_has_token_bytes() -> None:
    tok = ByteTokenizer()
    assert tok.token_bytes(0xE4) == b"\xe4" and tok.token_bytes(256) == b"<|endoftext|>"
    lp = TokenLogprob(0xE4, -1.0, [(ord("a"), -2.0)]).with_text(tok.token_bytes)
    assert (lp.text, lp.token_bytes) == ("\\xe4", b"\xe4")
    assert (lp.top[0].text, lp.top[0].token_bytes) == ("a", b"a")


# --- SentencePiece-style tokenizers (not byte-level) ---------------------------------------


def _spm(tmp: Path, llama2: bool) -> HFTokenizer:
    """A tiny BPE over "▁" word starts; ``llama2``: byte fallback with the Llama-2 decoder
    (Replace, ByteFallback, Fuse, Strip), else a Metaspace decoder."""
    vocab = {"<unk>": 0, "▁": 1, "h": 2, "i": 3, "▁h": 4, "▁hi": 5, "é": 6}
    vocab.update({f"<0x{b:02X}>": 7 + b for b in range(256)})
    merges = [("▁", "h"), ("▁h", "i")]
    raw = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>",
                                          byte_fallback=llama2))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    raw.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)]) if llama2 else decoders.Metaspace(
        replacement="▁", prepend_scheme="always")
    raw.save(str(tmp / "tokenizer.json"))
    return HFTokenizer.from_dir(tmp)


@pytest.mark.parametrize("llama2", [True, False])
def test_sentencepiece_tokens_keep_their_word_start_space(tmp_path: Path, llama2: bool) -> None:
    tok = _spm(tmp_path, llama2)
    assert tok.token_bytes(5) == b" hi"  # "▁hi": the space a decoder drops only at the start
    assert tok.token_bytes(3) == b"i" and tok.token_bytes(6) == "é".encode()
    if llama2:
        assert tok.token_bytes(7 + 0xE4) == b"\xe4"  # "<0xE4>" is that byte, not U+FFFD
        ids = tok.encode_text("hi hé 世")
        assert b"".join(tok.token_bytes(i) for i in ids) == " hi hé 世".encode()
    with pytest.raises(Exception, match="no token"):
        tok.token_bytes(10**6)


# --- the OpenAI dialect --------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    cfg = config(tmp_path_factory.mktemp("usage"), api_keys={KEY})
    with running(Gateway(cfg)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _check_items(items: Sequence[object]) -> None:
    for item in items:
        token, data = item.token, bytes(item.bytes)  # type: ignore[attr-defined]
        check_record(ID_OF_BYTES[data], token, data)


def test_openai_logprobs_carry_exact_bytes_of_partial_tokens(oai: openai.OpenAI) -> None:
    e4, e5 = partial_ids(2)
    out = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2,
        logit_bias={str(e4): 100, str(e5): 90})
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == ["\\xe4"] * 3 and content[0].bytes == [0xE4]
    assert [(t.token, t.bytes) for t in content[0].top_logprobs] == [
        ("\\xe4", [0xE4]), ("\\xe5", [0xE5])]
    for item in content:
        _check_items([item, *item.top_logprobs])


def test_openai_streamed_logprobs_equal_the_whole_answers(oai: openai.OpenAI) -> None:
    args = dict(model="default", messages=[{"role": "user", "content": "Say 日本."}],
                max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    whole_answer = oai.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(oai.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content or []]
    content = whole_answer.choices[0].logprobs.content
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    assert b"".join(bytes(c.bytes) for c in content).decode(
        "utf-8", errors="replace") == whole_answer.choices[0].message.content
    for item in content:
        _check_items([item, *item.top_logprobs])


def test_legacy_completion_logprobs_show_tokens_as_chat_does(oai: openai.OpenAI) -> None:
    e4, e5 = partial_ids(2)
    bias = {str(e4): 100, str(e5): 90}
    legacy = oai.completions.create(model="default", prompt="hi", max_tokens=3, temperature=0,
                                    logprobs=2, logit_bias=bias)
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens == ["\\xe4"] * 3
    assert [list(top) for top in lp.top_logprobs or []] == [["\\xe4", "\\xe5"]] * 3
    chat = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, logit_bias=bias)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert lp.tokens == [c.token for c in content]
    # a text prompt's own answer: every token (and alternative) spelt as the oracle spells it
    free = oai.completions.create(model="default", prompt="Say 日本 and 世界.", max_tokens=10,
                                  temperature=0, logprobs=3).choices[0].logprobs
    assert free is not None and free.tokens and free.top_logprobs
    for token, top in zip(free.tokens, free.top_logprobs, strict=True):
        for text in (token, *top):
            data = unescape(text)
            check_record(ID_OF_BYTES[data], text, data)
