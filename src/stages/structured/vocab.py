"""A tokenizer's vocabulary as a grammar engine needs it: every token id's exact bytes.

Owns :func:`token_table` (the bytes of each id, from :meth:`Tokenizer.token_bytes`, so any of
our tokenizers works: a ``tokenizer.json``, a GGUF file's vocabulary) and :func:`ll_tokenizer`,
the llguidance tokenizer built from it. Building either walks the whole vocabulary (tens of
milliseconds at V = 152k), so :mod:`stages.structured.compiler` keeps one per tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance

from pipeline.errors import InvalidValueError
from pipeline.contracts.text import Tokenizer


def token_table(tok: Tokenizer) -> list[bytes]:
    """The bytes of every id below ``tok.vocab_size``; an id with no token gets ``b""``, which
    no grammar can match (so it is never allowed)."""
    table: list[bytes] = []
    for i in range(tok.vocab_size):
        try:
            table.append(tok.token_bytes(i))
        except InvalidValueError:
            table.append(b"")
    return table


ENCODED_KEPT = 4096
"""Texts whose encoding :class:`_Wrapped` keeps at most (the grammar engine asks for the same forced
texts, ``":"`` or ``"}``, at every step of every closing search)."""


class _Wrapped:
    """The duck-typed object ``llguidance.TokenizerWrapper`` reads: token bytes, the special
    ids (matched only by name, never by their text), an EOS id and an encoder (which keeps
    up to :data:`ENCODED_KEPT` texts' ids, starting over when full: encoding is a pure
    function of the text)."""

    def __init__(self, tok: Tokenizer, tokens: Sequence[bytes]) -> None:
        self.tokens = list(tokens)
        self.eos_token_id = min(tok.eos_token_ids) if tok.eos_token_ids else None
        self.bos_token_id = None
        self.special_token_ids = sorted(tok.special_token_ids)
        self._tok = tok
        self._encoded: dict[str | bytes, tuple[int, ...]] = {}

    def __call__(self, text: str | bytes) -> list[int]:
        found = self._encoded.get(text)
        if found is None:
            plain = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
            found = tuple(self._tok.encode_text(plain))
            if len(self._encoded) >= ENCODED_KEPT:
                self._encoded.clear()
            self._encoded[text] = found
        return list(found)


def ll_tokenizer(tok: Tokenizer, tokens: Sequence[bytes] | None = None, *,
                 n_vocab: int | None = None) -> Any:
    """An ``llguidance.LLTokenizer`` over ``tok``'s vocabulary (``tokens``: its
    :func:`token_table`, when already built); ``n_vocab`` widens it to a model vocabulary
    padded beyond the tokenizer's (the extra ids are never allowed)."""
    table = list(token_table(tok) if tokens is None else tokens)
    if n_vocab is not None and n_vocab > len(table):
        table += [b""] * (n_vocab - len(table))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tok, table)))
