"""A faster detokenizer for byte-level BPE tokenizers (GPT-2, Qwen, Llama 3).

It owns :class:`ByteLevelDetokenizer`, its state :class:`BytesState`, and
:func:`bytes_to_unicode` (the GPT-2 table from bytes to printable characters). Each id maps to
its bytes once, at construction; a step appends bytes and emits everything but an incomplete
UTF-8 tail, so no decode call is made per token. Byte-level decoding is
``String::from_utf8_lossy`` over the concatenated bytes, and Python's ``errors="replace"``
follows the same rule (one U+FFFD per maximal invalid subpart), so the pieces concatenate to
the tokenizer's own decode, invalid bytes included.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import TokenizerError


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_bytes(token: str, char_bytes: Mapping[str, int]) -> bytes:
    """A token's bytes as the ByteLevel decoder gives them: via the table when every
    character is in it, else the token's own UTF-8 (added tokens like ``"<think>"``)."""
    try:
        return bytes(char_bytes[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, Mapping):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    return isinstance(parts, list) and bool(parts) and all(_is_byte_level(p) for p in parts)


@attrs.frozen
class BytesState:
    """Bytes selected but not yet emitted: at most an incomplete UTF-8 character."""

    pending: bytes = b""


def _split_complete(data: bytes) -> tuple[str, bytes]:
    """Decode ``data`` except for an incomplete trailing character, which is returned raw."""
    if not data or data[-1] < 0x80:
        return data.decode("utf-8", errors="replace"), b""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(data, final=False)
    return text, decoder.getstate()[0]


class ByteLevelDetokenizer:
    """Streams byte-level BPE output from a per-id byte table; no decode call per token.

    Satisfies :class:`pipeline.contracts.text.Detokenizer` with :class:`BytesState`; stateless
    and shareable. ``token_bytes[i]`` is the bytes of id ``i``; ids in ``special_ids``
    contribute nothing when ``skip_special_tokens``; ids outside the table are ignored, as a
    decode ignores ids it does not know.

    Example::

        detok = ByteLevelDetokenizer.from_tokenizer_json("model/tokenizer.json")
        st = detok.start(prompt_ids)
        st, piece = detok.step(st, token_id)
        tail = detok.finish(st)
    """

    def __init__(self, token_bytes: Sequence[bytes], special_ids: frozenset[int] = frozenset(),
                 skip_special_tokens: bool = True) -> None:
        table = list(token_bytes)
        if skip_special_tokens:
            for i in special_ids:
                if 0 <= i < len(table):
                    table[i] = b""
        self._table = tuple(table)
        self.skip_special_tokens = skip_special_tokens

    @classmethod
    def from_vocab(cls, id_to_token: Mapping[int, str], special_ids: frozenset[int] = frozenset(),
                   skip_special_tokens: bool = True) -> ByteLevelDetokenizer:
        """Build from token strings in GPT-2's byte alphabet (``id -> token``). A token with a
        character outside the alphabet (an added token) stands for its own UTF-8 bytes."""
        char_bytes = {c: b for b, c in bytes_to_unicode().items()}
        size = max(id_to_token, default=-1) + 1
        table = [b""] * size
        for i, token in id_to_token.items():
            table[i] = _token_bytes(token, char_bytes)
        return cls(table, special_ids, skip_special_tokens)

    @classmethod
    def from_tokenizer_json(cls, path: str | Path,
                            skip_special_tokens: bool = True) -> ByteLevelDetokenizer:
        """Build from a ``tokenizer.json`` whose decoder is ByteLevel.

        Raises :class:`~pipeline.errors.TokenizerError` for an unreadable file or another
        decoder (use :class:`IncrementalDetokenizer` for those).
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            vocab: dict[str, int] = dict(data["model"]["vocab"])
            added: list[dict[str, Any]] = list(data.get("added_tokens") or [])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TokenizerError(f"cannot read byte-level vocabulary from {path}: {e}") from e
        if not _is_byte_level(data.get("decoder")):
            raise TokenizerError(f"{path}: decoder is not ByteLevel: {data.get('decoder')!r}")
        id_to_token = {i: t for t, i in vocab.items()}
        id_to_token.update({int(a["id"]): str(a["content"]) for a in added})
        specials = frozenset(int(a["id"]) for a in added if a.get("special"))
        return cls.from_vocab(id_to_token, specials, skip_special_tokens)

    def start(self, prompt_ids: Sequence[int]) -> BytesState:
        """Nothing pending; the prompt is not decoded (the contract is decode(output_ids))."""
        return BytesState()

    def step(self, state: BytesState, token_id: int) -> tuple[BytesState, str]:
        """Append the token's bytes; emit all but an incomplete trailing character."""
        extra = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        if not extra:
            return state, ""
        text, pending = _split_complete(state.pending + extra)
        return BytesState(pending), text

    def finish(self, state: BytesState) -> str:
        """The pending bytes; an incomplete character decodes as one U+FFFD."""
        return state.pending.decode("utf-8", errors="replace")
