"""A GGUF file's tokenizer and chat template, as the Hugging Face files the stages read.

A GGUF file has no ``tokenizer.json``: llama.cpp stores the vocabulary, merges, token types and
special ids as key-value metadata (``tokenizer.ggml.*``) and the chat template as
``tokenizer.chat_template``. From that metadata (a plain mapping of Python values, as
``gguf.GGUFReader``'s ``{k: f.contents() for k, f in reader.fields.items()}`` gives it) this
module builds

- :func:`tokenizer_json`: the bytes of an equivalent ``tokenizer.json``;
- :func:`tokenizer_config`: the tokenizer_config keys the stages read (named special tokens,
  ``add_bos_token``, ``chat_template``) and ``eos_token_ids``;
- :func:`gguf_tokenizer` and :func:`gguf_renderer`: an :class:`~stages.tokenize.HFTokenizer`
  and an :class:`~stages.render.HFChatTemplateRenderer` over them,

so everything downstream is the same stage stack as for a Hugging Face folder. The file is
read by :mod:`pipeline.gguf_file`; :mod:`stages.plugin` registers the two as the ``gguf``
tokenizer and renderer.

Tokenizer models (``tokenizer.ggml.model``):

1. ``"gpt2"``, byte-level BPE: ``tokens`` and ``merges``; the text is split by the regexes
   llama.cpp uses for ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`), each splitting the
   pieces the one before left (matches and gaps both kept), then mapped to GPT-2's byte
   alphabet; the decoder is byte-level.
2. ``"llama"``, SentencePiece BPE with byte fallback: ``tokens``, ``scores`` and, when the file
   has them, ``merges`` (else merges are derived from the scores, best score first);
   ``add_space_prefix`` (default true) prepends ``"▁"`` to the text's start.

Token types (``tokenizer.ggml.token_type``): 2 UNKNOWN and 3 CONTROL become special added
tokens, 4 USER_DEFINED plain added tokens (matched whole in any text, as llama.cpp does); the
rest are ordinary vocabulary. BOS/EOS are added by the post-processor only where
``add_bos_token``/``add_eos_token`` say so (for BOS, default: true for ``"llama"`` and the
llama3 pre-tokenizers, as in llama.cpp); the stages themselves never add them.

Where llama.cpp, which GGUF files are written for, and transformers' own GGUF loading
disagree, this module follows llama.cpp:

- ``smollm`` and the other starcoder-family types split off every digit before GPT-2's
  regex (as SmolLM2's own tokenizer.json does); transformers applies GPT-2's regex alone, which
  differs where a run of spaces precedes a digit (``"x  1"``);
- the llama3 types look a whole piece up in the vocabulary before merging (``ignore_merges``);
- every CONTROL token is special, even one spelled outside the byte alphabet;
- a file without ``add_bos_token`` gets BOS for the llama3 types (transformers adds none).

It follows transformers for ``"default"`` (and a missing ``pre``): GPT-2's regex, where
llama.cpp falls back to a legacy split it warns degrades generation. For ``"llama"`` models
the space prefix is added at the text's start only (transformers), not after every special
token (llama.cpp). A token string that appears twice keeps its last id for encoding (as in
both); the earlier id decodes to nothing.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from pipeline.errors import TemplateError, TokenizerError
from stages.render import HFChatTemplateRenderer
from stages.tokenize import HFTokenizer

__all__ = ["PRE_TOKENIZERS", "SUPPORTED_MODELS", "PreTokenizer", "gguf_renderer",
           "gguf_tokenizer", "tokenizer_config", "tokenizer_json"]

MODEL = "tokenizer.ggml.model"
PRE = "tokenizer.ggml.pre"
TOKENS = "tokenizer.ggml.tokens"
TOKEN_TYPES = "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
SCORES = "tokenizer.ggml.scores"
ADD_BOS = "tokenizer.ggml.add_bos_token"
ADD_EOS = "tokenizer.ggml.add_eos_token"
ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
CHAT_TEMPLATE = "tokenizer.chat_template"

SUPPORTED_MODELS = ("gpt2", "llama")
"""``tokenizer.ggml.model`` values this module builds a tokenizer for."""

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
"""llama.cpp's token types that become added tokens (the first two special)."""

NAMED_TOKEN_FIELDS: Mapping[str, str] = MappingProxyType({
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id",  # sic: the GGUF key is spelled so
    "pad_token": "tokenizer.ggml.padding_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
})
"""tokenizer_config's named special tokens and the GGUF fields holding their ids."""

EOS_FIELDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
              "tokenizer.ggml.eom_token_id")
"""Fields whose ids end generation: end of sequence, of turn, of message."""

_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@attrs.frozen
class PreTokenizer:
    """How llama.cpp splits text for one ``tokenizer.ggml.pre`` type.

    ``splits``: regexes applied in order, each to the pieces the previous ones left (matches
    and the text between them both kept); ``ignore_merges``: a piece that is a whole token is
    that token, before any merge; ``add_bos``: whether BOS is added when the file has no
    ``tokenizer.ggml.add_bos_token``.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


def _family(names: Sequence[str], pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names, pre)


PRE_TOKENIZERS: Mapping[str, PreTokenizer] = MappingProxyType({
    **_family(["default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion"],
              PreTokenizer((_GPT2,))),
    **_family(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
               "minerva-7b"], PreTokenizer((r"\p{N}", _GPT2))),
    **_family(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "f2llmv2",
               "hunyuan"], PreTokenizer((_QWEN2,))),
    **_family(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
               "midm-2.0", "lfm2", "jina-v5-nano"],
              PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_family(["dbrx", "smaug-bpe"], PreTokenizer((_LLAMA3,))),
    **_family(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
              PreTokenizer((_GPT4O,))),
})
"""Supported ``tokenizer.ggml.pre`` values for ``"gpt2"`` models (llama.cpp's regexes)."""


# --- reading fields -----------------------------------------------------------------------


def _missing(source: str, key: str, what: str) -> TokenizerError:
    return TokenizerError(f"{source}: GGUF field {key} is missing; it must hold {what}")


def _wrong(source: str, key: str, what: str, value: object) -> TokenizerError:
    shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:80]
    return TokenizerError(f"{source}: GGUF field {key} must hold {what}, not {shown}")


def _strings(metadata: Mapping[str, Any], key: str, source: str) -> list[str]:
    """The list of strings in ``key`` (required)."""
    value = metadata.get(key)
    if value is None:
        raise _missing(source, key, "a list of strings")
    if not isinstance(value, list) or not _all_of(value, str):
        raise _wrong(source, key, "a list of strings", value)
    return value


def _all_of(values: list[Any], *kinds: type) -> bool:
    """Whether every value is an instance of one of ``kinds`` and none a bool (a check over
    the distinct types, not the 49,152 values: the vocabulary is checked at every start)."""
    return all(issubclass(t, kinds) and not issubclass(t, bool) for t in set(map(type, values)))


def _numbers(metadata: Mapping[str, Any], key: str, source: str, count: int,
             kind: type[int] | type[float]) -> list[Any] | None:
    """The list of ``count`` numbers in ``key``, or None if the file has no such field."""
    value = metadata.get(key)
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != count
            or not _all_of(value, *((int, float) if kind is float else (int,)))):
        raise _wrong(source, key, f"a list of {count} {kind.__name__}s (one per token)", value)
    return value


def _flag(metadata: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise _wrong(source, key, "a boolean", value)
    return value


def _token_id(metadata: Mapping[str, Any], key: str, source: str, count: int) -> int | None:
    """The token id in ``key`` (None if absent); TokenizerError unless it names a token."""
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise _wrong(source, key, f"a token id below {count}", value)
    return value


def _model(metadata: Mapping[str, Any], source: str) -> str:
    value = metadata.get(MODEL)
    if value not in SUPPORTED_MODELS:
        raise TokenizerError(f"{source}: GGUF field {MODEL} is {value!r}; supported tokenizer "
                             f"models: {', '.join(map(repr, SUPPORTED_MODELS))}")
    return str(value)


def _pre_tokenizer(metadata: Mapping[str, Any], source: str) -> PreTokenizer:
    name = metadata.get(PRE, "default")
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(f"{source}: GGUF field {PRE} is {name!r}, a pre-tokenizer this "
                             f"library does not know; supported: {', '.join(PRE_TOKENIZERS)}")
    return PRE_TOKENIZERS[name]


@attrs.frozen
class _Vocab:
    """The tokens of a file, their types (1 NORMAL where the file has none) and its model."""

    tokens: list[str]
    types: list[int]
    model: str

    @classmethod
    def read(cls, metadata: Mapping[str, Any], source: str) -> _Vocab:
        model = _model(metadata, source)
        tokens = _strings(metadata, TOKENS, source)
        if not tokens:
            raise _wrong(source, TOKENS, "at least one token", tokens)
        types = _numbers(metadata, TOKEN_TYPES, source, len(tokens), int)
        return cls(tokens, types or [1] * len(tokens), model)

    def added(self, index: int) -> bool:
        return self.types[index] in (UNKNOWN, CONTROL, USER_DEFINED)

    def special(self, index: int) -> bool:
        return self.types[index] in (UNKNOWN, CONTROL)

    def key(self, index: int) -> str:
        """Token ``index`` as tokenizer.json spells it: added tokens as their text; others in
        a byte-level model in the byte alphabet (a file may store one as plain text)."""
        token = self.tokens[index]
        if self.model != "gpt2" or self.added(index) or set(token) <= _ALPHABET:
            return token
        return "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))

    def keys(self) -> dict[str, int]:
        """Every token's :meth:`key` → its id (a later id wins for a repeated key)."""
        if self.model != "gpt2" or set("".join(self.tokens)) <= _ALPHABET:
            return {token: i for i, token in enumerate(self.tokens)}  # every key is the token
        return {self.key(i): i for i in range(len(self.tokens))}


def _byte_chars() -> list[str]:
    """GPT-2's byte alphabet: the character standing for each byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


_BYTE_CHARS = _byte_chars()
_ALPHABET = frozenset(_BYTE_CHARS)


# --- tokenizer.json -----------------------------------------------------------------------


def _merges(metadata: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    merges = _strings(metadata, MERGES, source)
    spaces = list(map(str.find, merges, itertools.repeat(" ")))
    for n, (merge, at) in enumerate(zip(merges, spaces)):
        if not 0 < at < len(merge) - 1 or " " in merge[at + 1:]:
            raise TokenizerError(f"{source}: GGUF field {MERGES}[{n}] is {merge!r}, not two "
                                 "tokens joined by one space")
    # one tuple per merge and no other container: 48,900 of them wake the garbage collector
    return [(merge[:at], merge[at + 1:]) for merge, at in zip(merges, spaces)]


def _score_merges(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best score of the whole first (ties: longer left, then longer right part; then token
    order), as transformers derives them."""
    found = []
    for token, index in vocab.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [s for s in splits if s[0] in vocab and s[1] in vocab]
        splits.sort(key=lambda s: (vocab[s[0]], vocab[s[1]]))
        found += [(scores[index], left, right) for left, right in splits]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _build(make: Callable[[], Any], source: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(make())
    except Exception as exc:  # tokenizers raises plain Exception for a bad vocabulary
        raise TokenizerError(f"{source}: GGUF fields {TOKENS} and {MERGES} do not make a "
                             f"tokenizer: {exc}") from exc


def _gpt2(metadata: Mapping[str, Any], vocab: _Vocab, source: str) -> tokenizers.Tokenizer:
    pre = _pre_tokenizer(metadata, source)
    keys, merges = vocab.keys(), _merges(metadata, source)
    tok = _build(lambda: models.BPE(keys, merges, ignore_merges=pre.ignore_merges), source)
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _llama(metadata: Mapping[str, Any], vocab: _Vocab, source: str) -> tokenizers.Tokenizer:
    keys = vocab.keys()
    scores = _numbers(metadata, SCORES, source, len(vocab.tokens), float)
    if MERGES not in metadata and scores is None:
        raise _missing(source, SCORES, "a score per token (the file has no merges either)")
    merges = _merges(metadata, source) if MERGES in metadata else \
        _score_merges(keys, scores or [])
    unk = _token_id(metadata, NAMED_TOKEN_FIELDS["unk_token"], source, len(vocab.tokens))
    tok = _build(lambda: models.BPE(keys, merges, unk_token=None if unk is None else
                                    vocab.key(unk), fuse_unk=True, byte_fallback=True), source)
    prefix = _flag(metadata, ADD_SPACE_PREFIX, source, True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return tok


_BUILDERS = {"gpt2": _gpt2, "llama": _llama}


def _add_tokens(tok: tokenizers.Tokenizer, vocab: _Vocab) -> None:
    """Added tokens keep the ids their text has in the vocabulary."""
    added = [i for i in range(len(vocab.tokens)) if vocab.added(i)]
    tok.add_special_tokens([tokenizers.AddedToken(vocab.tokens[i], normalized=False,
                                                  special=True)
                            for i in added if vocab.special(i)])
    tok.add_tokens([tokenizers.AddedToken(vocab.tokens[i], normalized=False, special=False)
                    for i in added if not vocab.special(i)])


def _bos_eos(metadata: Mapping[str, Any], vocab: _Vocab, source: str
             ) -> tuple[int | None, int | None]:
    """The ids the post-processor adds (BOS first, EOS last), where the file asks for them."""
    add_bos, add_eos = _adds(metadata, vocab.model, source)
    return (_end_id(metadata, vocab, source, "bos_token", ADD_BOS) if add_bos else None,
            _end_id(metadata, vocab, source, "eos_token", ADD_EOS) if add_eos else None)


def _end_id(metadata: Mapping[str, Any], vocab: _Vocab, source: str, name: str,
            flag: str) -> int:
    field = NAMED_TOKEN_FIELDS[name]
    token = _token_id(metadata, field, source, len(vocab.tokens))
    if token is None:
        raise _missing(source, field, f"a token id, as {flag} asks to add one")
    return token


def _adds(metadata: Mapping[str, Any], model: str, source: str) -> tuple[bool, bool]:
    """``(add_bos, add_eos)``: the file's flags, else llama.cpp's defaults."""
    default_bos = model == "llama" or _pre_tokenizer(metadata, source).add_bos
    return _flag(metadata, ADD_BOS, source, default_bos), _flag(metadata, ADD_EOS, source, False)


def _post_processor(vocab: _Vocab, bos: int | None, eos: int | None) -> dict[str, Any] | None:
    """A TemplateProcessing that adds ``bos``/``eos`` around each sequence, or None."""
    if bos is None and eos is None:
        return None

    def piece(token: int | None, type_id: int) -> list[dict[str, Any]]:
        return [] if token is None else [{"SpecialToken": {"id": vocab.key(token),
                                                            "type_id": type_id}}]

    def seq(name: str, type_id: int) -> list[dict[str, Any]]:
        return [*piece(bos, type_id), {"Sequence": {"id": name, "type_id": type_id}},
                *piece(eos, type_id)]

    specials = {vocab.key(t): {"id": vocab.key(t), "ids": [t], "tokens": [vocab.key(t)]}
                for t in (bos, eos) if t is not None}
    return {"type": "TemplateProcessing", "single": seq("A", 0),
            "pair": seq("A", 0) + seq("B", 1), "special_tokens": specials}


def tokenizer_json(metadata: Mapping[str, Any], source: str) -> bytes:
    """The bytes of a ``tokenizer.json`` equivalent to the tokenizer in GGUF ``metadata``
    (see the module docstring for models, pre-tokenizers, added tokens and BOS/EOS).

    ``source`` names the file in errors. Raises TokenizerError naming ``source`` and the field
    when ``tokenizer.ggml.model`` is not one of :data:`SUPPORTED_MODELS`, ``tokenizer.ggml.pre``
    is not in :data:`PRE_TOKENIZERS`, or a field the model needs is missing or malformed.
    """
    vocab = _Vocab.read(metadata, source)
    bos, eos = _bos_eos(metadata, vocab, source)
    tok = _BUILDERS[vocab.model](metadata, vocab, source)
    _add_tokens(tok, vocab)
    data = json.loads(tok.to_str())
    data["post_processor"] = _post_processor(vocab, bos, eos)
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


# --- config, stages -----------------------------------------------------------------------


def tokenizer_config(metadata: Mapping[str, Any], source: str = "GGUF metadata"
                     ) -> dict[str, Any]:
    """What tokenizer_config.json would hold for GGUF ``metadata``, for the stages.

    Keys: each named special token the file has an id for (``bos_token``, ``eos_token``,
    ``unk_token``, ``sep_token``, ``pad_token``, ``mask_token``; as tokenizer.json spells
    them), ``add_bos_token`` and ``add_eos_token`` (the file's flags or llama.cpp's defaults),
    ``chat_template`` (when the file has ``tokenizer.chat_template``) and ``eos_token_ids``
    (sorted: the EOS, end-of-turn and end-of-message ids the file has). Raises TokenizerError
    naming ``source`` and the field for a malformed or out-of-range field, TemplateError for
    a chat template that is not text.
    """
    vocab = _Vocab.read(metadata, source)
    count = len(vocab.tokens)
    config: dict[str, Any] = {}
    for name, field in NAMED_TOKEN_FIELDS.items():
        if (token := _token_id(metadata, field, source, count)) is not None:
            config[name] = vocab.key(token)
    config["add_bos_token"], config["add_eos_token"] = _adds(metadata, vocab.model, source)
    if (template := _template(metadata, CHAT_TEMPLATE, source)) is not None:
        config["chat_template"] = template
    eos = {_token_id(metadata, field, source, count) for field in EOS_FIELDS}
    config["eos_token_ids"] = sorted(t for t in eos if t is not None)
    return config


def _template(metadata: Mapping[str, Any], key: str, source: str) -> str | None:
    value = metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise TemplateError(f"{source}: GGUF field {key} must hold the chat template text, "
                            f"not {type(value).__name__}")
    return value


def gguf_tokenizer(metadata: Mapping[str, Any], source: str) -> HFTokenizer:
    """An :class:`HFTokenizer` over :func:`tokenizer_json` and :func:`tokenizer_config`, with
    EOS ids from ``eos_token_ids``. Raises TokenizerError naming ``source`` and the field."""
    config = tokenizer_config(metadata, source)
    return HFTokenizer(tokenizer_json(metadata, source), config=config,
                       eos_token_ids=config["eos_token_ids"], source=source)


def gguf_renderer(metadata: Mapping[str, Any], source: str, *,
                  template_name: str | None = None) -> HFChatTemplateRenderer:
    """An :class:`HFChatTemplateRenderer` over the file's chat template, with its named special
    tokens as template variables and every special token's text protected in caller text.

    ``template_name`` picks ``tokenizer.chat_template.<name>`` instead of the default
    ``tokenizer.chat_template``. A file without that template raises TemplateError naming
    ``source`` and the field (a model without a template wants the plain renderer instead);
    a malformed vocabulary raises TokenizerError.
    """
    key = CHAT_TEMPLATE if template_name is None else f"{CHAT_TEMPLATE}.{template_name}"
    template = _template(metadata, key, source)
    if template is None:
        raise TemplateError(f"{source}: no chat template: GGUF field {key} is missing")
    vocab = _Vocab.read(metadata, source)
    config = tokenizer_config(metadata, source)
    named = {k: v for k, v in config.items() if k in NAMED_TOKEN_FIELDS}
    strings = [vocab.tokens[i] for i in range(len(vocab.tokens)) if vocab.special(i)]
    return HFChatTemplateRenderer(
        template, special_tokens=named, special_token_strings=[*strings, *named.values()],
        name="gguf_chat_template" + (f":{template_name}" if template_name else ""))
