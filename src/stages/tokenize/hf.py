"""Hugging Face ``tokenizers`` tokenizers: files, encoding by span, decoding, token bytes.

Owns :class:`HFTokenizer`, a :class:`~pipeline.contracts.text.Tokenizer` over ``tokenizer.json``
(with ``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` for EOS ids).

Encoding rule. transformers' ``apply_chat_template`` tokenizes the whole rendered string in
one call, parsing special tokens everywhere and adding no BOS/EOS; we match it token for token
whenever the caller's text spells no special token:

1. spans are cut into *runs*: a CONTENT span that contains a special-token string (an added
   token marked ``special``, such as ``<|im_end|>``) is a run of its own; every other stretch
   of adjacent spans, control and content together, is one run;
2. an ordinary run is encoded in one call with special-token parsing (so it tokenizes exactly
   as the whole string would); if a special token it produced is not inside a CONTROL span
   (a token spelled across a content/control border), the run is encoded span by span;
3. a content run is encoded without special-token parsing, by a second ``tokenizers``
   instance with ``encode_special_tokens = True`` (built once, on first need, and never
   toggled afterwards, so every call is thread-safe). Non-special added tokens (Qwen's
   ``<think>``, ``<tool_call>``) are ordinary vocabulary and match in content too, as with
   transformers' ``split_special_tokens=True``;
4. a run after the first is encoded after a newline that is then dropped (as transformers
   does), so SentencePiece tokenizers add no word-start marker at a run border.

No post-processor runs (``add_special_tokens=False``). Decoding is the library's whole-sequence
decode; :meth:`HFTokenizer.token_bytes` gives the exact bytes one token adds to a text (what
logprobs show).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pipeline.errors import InvalidValueError, TokenizerError
from pipeline.events import digest_bytes, digest_text
from pipeline.contracts.text import Rendered, SpanKind, TokenizedPrompt

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
"""tokenizer_config keys naming special tokens (strings or ``{"content": ...}``): the named
special tokens a chat template gets, as transformers' ``special_tokens_map``."""

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A SentencePiece byte-fallback token, standing for one byte."""

Run = tuple[str, list[tuple[str, SpanKind]], bool]
"""A run of spans: its text, its pieces, and whether it is a content-only run."""


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from exc


def _read_json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(_read_bytes(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"tokenizer file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"tokenizer file {path} does not hold a JSON object")
    return data


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any, path: Path | None) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{path}: eos_token_id must be an id or a list of ids, not {value!r}")
    return values


def _inside(start: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    return any(s <= start and end <= e for s, e in spans)


class HFTokenizer:
    """A ``tokenizers`` tokenizer with span-aware encoding (see the module docstring).

    Immutable after construction and thread-safe. ``raw`` is the underlying
    :class:`tokenizers.Tokenizer`; do not change its settings. Example::

        tok = HFTokenizer.from_dir("model/")
        prompt = tok.encode(renderer.render([Message("user", "hi")]))
        text = tok.decode(prompt.input_ids, skip_special_tokens=False)
    """

    name = "hf"

    def __init__(self, tokenizer_json: bytes, *, config: Mapping[str, Any] | None = None,
                 eos_token_ids: Iterable[int] = (), source: str = "tokenizer.json") -> None:
        """Load ``tokenizer_json`` (the bytes of a tokenizer.json). ``config`` is
        tokenizer_config.json's object; EOS ids are its ``eos_token`` plus ``eos_token_ids``.
        Raises TokenizerError naming ``source`` when the files are unusable."""
        self._json, self._source = tokenizer_json, source
        self.raw = self._load(tokenizer_json)
        self._plain: Any = None
        self._plain_lock = threading.Lock()
        config = dict(config or {})
        added = self.raw.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_token_strings: tuple[str, ...] = tuple(sorted(
            {t.content for t in added.values() if t.special}, key=lambda s: (-len(s), s)))
        self._special_re = re.compile("|".join(map(re.escape, self.special_token_strings))
                                      or "(?!)")
        self.special_token_ids: frozenset[int] = frozenset(
            [i for i, t in added.items() if t.special] + self._named_ids(config))
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids(config, eos_token_ids))
        vocab = self.raw.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        decoders = self._decoder_types()
        self.byte_level = "ByteLevel" in decoders
        self._byte_fallback = "ByteFallback" in decoders
        self._byte_decoder = byte_decoder() if self.byte_level else {}
        self._newline: list[int] = self.raw.encode("\n", add_special_tokens=False).ids
        self.leading_ids: tuple[int, ...] = self._leading_ids()
        """The ids tokenizer.json's post-processor puts before a sequence (a BOS, or none)."""
        settings = json.dumps({"config": config, "eos": sorted(self.eos_token_ids)},
                              sort_keys=True, default=str).encode()
        self.digest = digest_bytes(tokenizer_json + b"\0" + settings)

    # --- construction -----------------------------------------------------------------

    @classmethod
    def from_files(cls, tokenizer_file: str | Path, *, config_file: str | Path | None = None,
                   generation_config_file: str | Path | None = None,
                   model_config_file: str | Path | None = None) -> HFTokenizer:
        """Load from explicit files; EOS ids are the union of tokenizer_config's
        ``eos_token`` and the ``eos_token_id`` (an id or a list) of the two other configs."""
        path = Path(tokenizer_file)
        paths = [None if p is None else Path(p)
                 for p in (config_file, generation_config_file, model_config_file)]
        for p in (path, *paths):
            if p is not None and not p.is_file():
                raise TokenizerError(f"tokenizer file not found: {p}")
        config, gen, model = (_read_json(p) for p in paths)
        eos = _id_list(gen.get("eos_token_id"), paths[1])
        eos += _id_list(model.get("eos_token_id"), paths[2])
        return cls(_read_bytes(path), config=config, eos_token_ids=eos, source=str(path))

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load ``tokenizer.json`` from a model folder, with whichever of
        ``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` it has."""
        folder = Path(path)

        def optional(name: str) -> Path | None:
            return folder / name if (folder / name).is_file() else None

        return cls.from_files(folder / "tokenizer.json",
                              config_file=optional("tokenizer_config.json"),
                              generation_config_file=optional("generation_config.json"),
                              model_config_file=optional("config.json"))

    def _load(self, data: bytes) -> Any:
        try:
            return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises plain Exception for a bad file
            raise TokenizerError(f"cannot load tokenizer {self._source}: {exc}") from exc

    def _token_id(self, text: str, what: str) -> int:
        token = self.raw.token_to_id(text)
        if token is None:
            raise TokenizerError(f"{self._source}: {what} {text!r} is not in the vocabulary")
        return int(token)

    def _named_ids(self, config: Mapping[str, Any]) -> list[int]:
        texts = [(k, token_text(config.get(k))) for k in NAMED_SPECIAL_TOKENS]
        return [self._token_id(t, k) for k, t in texts if t is not None]

    def _eos_ids(self, config: Mapping[str, Any], extra: Iterable[int]) -> set[int]:
        ids = set(extra)
        if (text := token_text(config.get("eos_token"))) is not None:
            ids.add(self._token_id(text, "eos_token"))
        return ids

    def _decoder_types(self) -> set[str]:
        """The types of the decoder's steps (of each step of a ``Sequence``)."""
        decoder = json.loads(self.raw.decoder.__getstate__()) if self.raw.decoder else {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" \
            else [decoder]
        return {str(p.get("type")) for p in parts if isinstance(p, Mapping)}

    def _plain_tokenizer(self) -> Any:
        """The second instance, parsing no special tokens; built once, under a lock."""
        with self._plain_lock:
            if self._plain is None:
                plain = self._load(self._json)
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    # --- encoding ---------------------------------------------------------------------

    def encode(self, rendered: Rendered) -> TokenizedPrompt:
        """Ids of ``rendered``, run by run (see the module docstring).

        Raises InvalidValueError (a ValidationError) when the prompt encodes to nothing."""
        ids: list[int] = []
        for n, (text, pieces, content_only) in enumerate(self._runs(rendered)):
            if content_only:
                ids += self._encode(text, special=False, first=n == 0)
            else:
                ids += self._encode_run(text, pieces, first=n == 0)
        return TokenizedPrompt(ids, self.digest, digest_text(rendered.text))

    def encode_text(self, text: str, *, special: bool = False) -> list[int]:
        """Ids of ``text`` alone; special-token strings are parsed only if ``special``."""
        return self._encode(text, special=special, first=True)

    def encode_document(self, text: str) -> list[int]:
        """Ids of ``text`` as a document (:class:`~pipeline.contracts.text.DocumentEncoder`): the
        ids tokenizer.json's post-processor puts before a sequence (its BOS, if any), then
        the text with special-token strings parsed. Its EOS, if it adds one, is left off."""
        return [*self.leading_ids, *self._encode(text, special=True, first=True)]

    def _leading_ids(self) -> tuple[int, ...]:
        """The ids the post-processor puts before a sequence, found by encoding a probe."""
        bare = self.raw.encode("a", add_special_tokens=False).ids
        full = self.raw.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1)
                   if full[i:i + len(bare)] == bare), 0)
        return tuple(full[:at])

    def _runs(self, rendered: Rendered) -> list[Run]:
        runs: list[Run] = []
        group: list[tuple[str, SpanKind]] = []
        for text, kind in rendered.pieces():
            if kind is SpanKind.CONTENT and self._special_re.search(text):
                if group:
                    runs.append(("".join(t for t, _ in group), group, False))
                runs.append((text, [(text, kind)], True))
                group = []
            else:
                group.append((text, kind))
        if group:
            runs.append(("".join(t for t, _ in group), group, False))
        return runs

    def _encode_run(self, text: str, pieces: list[tuple[str, SpanKind]], first: bool
                    ) -> list[int]:
        ids, offsets = self._encode_offsets(text, first)
        control, at = [], 0
        for piece, kind in pieces:
            if kind is SpanKind.CONTROL:
                control.append((at, at + len(piece)))
            at += len(piece)
        stray = any(i in self.special_token_ids and not _inside(s, e, control)
                    for i, (s, e) in zip(ids, offsets, strict=True))
        if not stray:
            return ids
        return [t for n, (piece, kind) in enumerate(pieces) for t in self._encode(
            piece, special=kind is SpanKind.CONTROL, first=first and n == 0)]

    def _encode_offsets(self, text: str, first: bool) -> tuple[list[int], list[tuple[int, int]]]:
        if not first:
            enc = self.raw.encode("\n" + text, add_special_tokens=False)
            k = len(self._newline)
            if enc.ids[:k] == self._newline:
                return enc.ids[k:], [(s - 1, e - 1) for s, e in enc.offsets[k:]]
        enc = self.raw.encode(text, add_special_tokens=False)
        return list(enc.ids), list(enc.offsets)

    def _encode(self, text: str, *, special: bool, first: bool) -> list[int]:
        tok = self.raw if special or not self._special_re.search(text) \
            else self._plain_tokenizer()
        if not first:
            ids: list[int] = tok.encode("\n" + text, add_special_tokens=False).ids
            if ids[:len(self._newline)] == self._newline:
                return ids[len(self._newline):]
        return list(tok.encode(text, add_special_tokens=False).ids)

    # --- decoding ---------------------------------------------------------------------

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; raises InvalidValueError for an id outside the vocabulary."""
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidValueError("ids", token, f"outside the vocabulary of "
                                                      f"{self.vocab_size}")
        return str(self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` adds to the text when it follows other output.

        Byte-level BPE: the token's bytes through GPT-2's alphabet (possibly part of a UTF-8
        character). Added tokens: their UTF-8 text. A byte-fallback token (``<0xE6>``): that
        byte. Any other token: what it adds to a decode after itself, ``decode([t, t])``
        minus ``decode([t])``, so a SentencePiece word-start token (``"▁hi"``) keeps the
        leading space a decoder strips only at the start of a text. Raises
        InvalidValueError for an id with no token."""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        token = self.raw.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if token is None:
            raise InvalidValueError("token_id", token_id, "no token has this id")
        if self.byte_level:
            try:
                return bytes(self._byte_decoder[c] for c in token)
            except KeyError as exc:
                raise TokenizerError(f"token {token_id} ({token!r}) is not byte-level") from exc
        if self._byte_fallback and (byte := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(byte.group(1), 16)])
        one = self.decode([token_id], skip_special_tokens=False)
        two = self.decode([token_id, token_id], skip_special_tokens=False)
        return (two[len(one):] if two.startswith(one) else one).encode("utf-8")
