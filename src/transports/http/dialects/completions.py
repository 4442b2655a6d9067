"""OpenAI's legacy text completions: ``POST /v1/completions`` bodies in, ``text_completion`` out.

Owns :func:`parse_completions` (a body → :class:`~transports.http.dialects.common.Parsed` with its
:class:`~transports.http.dialects.common.RawPrompts`), :func:`prompt_ids` (a prompt as the model's
input ids: text through the tokenizer alone, with its own BOS rule and special-token strings
parsed, never a chat template; token ids as they are), :func:`text_completion` (the non-stream
body) and :class:`TextStream` (``text_completion`` chunks, choices interleaved by ``index``,
``data: [DONE]`` last), with the legacy ``logprobs`` object (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``; a token's text is written as chat's logprobs write it).

A prompt is a string, a list of token ids, or a list of either (a batch: one prompt after
another, ``n`` choices each, choice ``p * n + i`` for prompt ``p``). ``suffix`` is refused (no
fill-in-the-middle format), and so is ``best_of`` other than ``n`` (no server-side ranking),
and ``echo`` with ``logprobs`` (it needs the prompt tokens' logprobs, which are not computed).
``max_tokens`` defaults to 16, as in OpenAI's API.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.contracts.text import Detokenizer, DocumentEncoder, Tokenizer
from pipeline.contracts.output import Completion, Delta, FinishReason, TokenLogprob, Usage
from pipeline.contracts.request import Request
from transports.http.server.choices import total_usage
from transports.http.dialects.common import (
    Parsed, RawPrompt, RawPrompts, ServerDefaults, config_from, raw_prompts, sampling_given,
)
from transports.http.dialects.documented import structured_outputs
from transports.http.dialects.fields import Obj
from transports.http.dialects.spec import SAMPLING, unsupported
from transports.http.dialects.openai import (
    choice_count, finish_word, sampling, stream_end, stream_options, token_of,
    usage_body,
)
from transports.sse import SSEEvent, encode

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # OpenAI stops at 5; the engine gives up to 20 alternatives


def _unsupported(body: Obj, n: int) -> None:
    suffix = body.get("suffix", "string")
    if suffix:
        raise unsupported("suffix", suffix, "no fill-in-the-middle format for these models")
    best_of = body.num("best_of", 1, 1 << 30, integer=True)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", best_of, f"only best_of equal to n ({n}): there is no "
                                              "server-side ranking of choices")


def parse_completions(raw: Any, defaults: ServerDefaults) -> Parsed:
    """A completions body → the internal request (the first prompt's; each prompt gets its
    own at submission) and how to answer it."""
    body = Obj(raw, "body")
    model = body.need("model", "string")
    prompts = raw_prompts(body, "prompt")
    fields = sampling(body, SAMPLING)
    given = body.num("max_tokens", 1, 1 << 30, integer=True)
    logprobs = body.num("logprobs", 0, MAX_LOGPROBS, integer=True)
    echo = body.get("echo", "boolean", False)
    if echo and logprobs is not None:
        raise unsupported("logprobs", logprobs, "with echo it would need the prompt tokens' "
                                                "logprobs, which are not computed")
    if logprobs is not None:
        fields.update(logprobs=True, top_logprobs=logprobs)
    n = choice_count(body)
    _unsupported(body, n)
    stream = body.get("stream", "boolean", False)
    include_usage = stream_options(body, stream)
    user = body.get("user", "string")
    grammar = structured_outputs(body, None)
    body.done()
    config = config_from(fields, DEFAULT_MAX_TOKENS if given is None else given, defaults)
    config = attrs.evolve(config, grammar=grammar)
    first = prompts[0]
    request = Request(prompt=first if isinstance(first, str) else None,
                      prompt_ids=None if isinstance(first, str) else first,
                      generation_config=config, request_id=f"cmpl-{uuid.uuid4().hex[:24]}",
                      client_metadata={"user": user} if user else {})
    return Parsed(model, request, stream, given is not None, False, include_usage, n=n,
                  raw=RawPrompts(prompts, echo, logprobs), sampling_given=sampling_given(raw))


def prompt_ids(tokenizer: Tokenizer, prompt: RawPrompt, path: str) -> tuple[int, ...]:
    """The model's input ids for one prompt: text as the tokenizer alone encodes it
    (:class:`~pipeline.contracts.text.DocumentEncoder` where it has that, else special-token
    strings parsed and nothing added); token ids checked against the vocabulary."""
    vocab = tokenizer.vocab_size
    if not isinstance(prompt, str):
        for i, token in enumerate(prompt):
            if token >= vocab:
                raise InvalidValueError(f"{path}[{i}]", token,
                                        f"outside the vocabulary (size {vocab})")
        return prompt
    ids = (tokenizer.encode_document(prompt) if isinstance(tokenizer, DocumentEncoder)
           else tokenizer.encode_text(prompt, special=True))
    if not ids:
        raise InvalidValueError(path, prompt, "the prompt encodes to no tokens")
    return tuple(ids)


def prompt_text(tokenizer: Tokenizer, prompt: RawPrompt) -> str:
    """What ``echo`` repeats: the prompt's text (token ids decoded, special tokens kept)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt, skip_special_tokens=False)


# --- logprobs --------------------------------------------------------------------------------


class Offsets:
    """Where each token's text starts in an answer: the detokenizer replayed over the
    choice's tokens (so a character split over tokens is counted once, where it ends)."""

    def __init__(self, detokenizer: Detokenizer[Any], prompt: Sequence[int]) -> None:
        self._detokenizer = detokenizer
        self._state = detokenizer.start(prompt)
        self.chars = 0

    def of(self, tokens: Sequence[int]) -> list[int]:
        """The offsets of the next ``tokens``."""
        out = []
        for token in tokens:
            out.append(self.chars)
            self._state, piece = self._detokenizer.step(self._state, token)
            self.chars += len(piece)
        return out


def legacy_logprobs(tokenizer: Tokenizer, items: Sequence[TokenLogprob],
                    offsets: Sequence[int]) -> dict[str, Any]:
    """The legacy ``logprobs`` object of ``items``: each token's text (as chat's logprobs show
    it: :func:`~transports.http.dialects.openai.token_of`, a partial UTF-8 character's bytes as
    ``\\xNN`` escapes), logprob, top alternatives (text → logprob, most likely first; the
    first of tokens with equal text wins) and text offset."""
    def text(lp: TokenLogprob) -> str:
        return token_of(tokenizer, lp)[0]

    tops = []
    for lp in items:
        top: dict[str, float] = {}
        for alternative in lp.top:
            top.setdefault(text(alternative), alternative.logprob)
        tops.append(top)
    return {"tokens": [text(lp) for lp in items],
            "token_logprobs": [lp.logprob for lp in items], "top_logprobs": tops,
            "text_offset": list(offsets)}


# --- responses -------------------------------------------------------------------------------


def _choice(index: int, text: str, logprobs: dict[str, Any] | None,
            finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def text_completion(parsed: Parsed, completions: Sequence[Completion],
                    echoes: Sequence[str], prompts: Sequence[Sequence[int]],
                    tokenizer: Tokenizer, detokenizer: Detokenizer[Any]) -> dict[str, Any]:
    """The non-stream body: choice ``k``'s text (after ``echoes[k]`` when echoing), its
    logprobs when asked, its finish reason; the usage counts each prompt once."""
    assert parsed.raw is not None
    choices = []
    for k, completion in enumerate(completions):
        logprobs = None
        if parsed.raw.logprobs is not None:
            items = completion.logprobs or ()
            offsets = Offsets(detokenizer, prompts[k]).of([lp.token_id for lp in items])
            logprobs = legacy_logprobs(tokenizer, items, offsets)
        text = (echoes[k] if parsed.raw.echo else "") + completion.text
        choices.append(_choice(k, text, logprobs,
                               finish_word(completion.finish_reason, False)))
    usage: Usage = total_usage(completions, parsed.n)
    return {"id": parsed.request.request_id, "object": "text_completion",
            "created": int(time.time()), "model": parsed.model, "choices": choices,
            "usage": usage_body(usage)}


class TextStream:
    """The ``text_completion`` chunks of one streamed answer, as SSE bytes: the echoed prompt
    first (when asked), each choice's text as it comes with its ``index``, its finish chunk
    after its last delta, then the usage chunk (if asked) and ``[DONE]``."""

    def __init__(self, parsed: Parsed, echoes: Sequence[str], prompts: Sequence[Sequence[int]],
                 tokenizer: Tokenizer, detokenizer: Detokenizer[Any]) -> None:
        assert parsed.raw is not None
        self.parsed = parsed
        self._raw = parsed.raw
        self._echoes = echoes
        self._tokenizer = tokenizer
        self._head = {"id": parsed.request.request_id, "object": "text_completion",
                      "created": int(time.time()), "model": parsed.model}
        self._offsets = ([Offsets(detokenizer, p) for p in prompts]
                         if self._raw.logprobs is not None else [])

    def _chunk(self, index: int, text: str, logprobs: dict[str, Any] | None = None,
               finish: str | None = None) -> bytes:
        body: dict[str, Any] = {**self._head, "choices": [_choice(index, text, logprobs,
                                                                  finish)]}
        if self.parsed.include_usage:
            body["usage"] = None
        return encode(SSEEvent(json.dumps(body, ensure_ascii=False)))

    def start(self) -> bytes:
        """The echoed prompt of every choice, when ``echo`` is set."""
        if not self._raw.echo:
            return b""
        return b"".join(self._chunk(k, text) for k, text in enumerate(self._echoes))

    def delta(self, index: int, parts: Sequence[object], delta: Delta) -> bytes:
        """The text of one engine delta of choice ``index`` (the raw text: a completion
        splits out neither reasoning nor tool calls), and its finish chunk after the last."""
        out = []
        logprobs = None
        if self._offsets and delta.logprobs:
            offsets = self._offsets[index].of([lp.token_id for lp in delta.logprobs])
            logprobs = legacy_logprobs(self._tokenizer, delta.logprobs, offsets)
        if delta.text or logprobs is not None:
            out.append(self._chunk(index, delta.text, logprobs))
        reason = delta.finish_reason
        if reason is not None and reason is not FinishReason.ERROR:  # a failure ends the stream
            out.append(self._chunk(index, "", finish=finish_word(reason, False)))
        return b"".join(out)

    def end(self, completions: Sequence[Completion]) -> bytes:
        """The usage chunk if asked (each prompt once, completions summed), and ``[DONE]``."""
        return stream_end(self._head, self.parsed.include_usage, self.parsed.n, completions)
