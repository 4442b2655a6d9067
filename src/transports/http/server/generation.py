"""A generation request between its parsed body and its answer: the choices it starts, and
the dialect's body or stream encoder for what they produce.

Owns :class:`Started` (the choices submitted for one HTTP request, with what its answer needs)
and :func:`start`, the request-side work of every generation endpoint, run on the work pool:
each prompt to the model's input (a completions prompt to ids; a chat request's tool choice
is the pipeline's to apply, :mod:`pipeline.tools.choice`), the window fit (:meth:`~transports.http.gateway.fit.WindowFit.fit`), the choices'
requests (:func:`~transports.http.server.choices.choice_requests`) and their admission together
(:meth:`~transports.http.gateway.admission.Admission.submit`). :func:`answer` builds the non-stream body
and :func:`encoder` the stream's encoder, in the dialect the request came in; an endpoint
with an answer of its own over the same flow (``/v1/responses``) brings a :class:`Form`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from pipeline.prepared import Prepared
from pipeline.contracts.text import Detokenizer, Tokenizer
from pipeline.contracts.output import Completion
from pipeline.contracts.request import Request
from pipeline.contracts.output import Part
from transports.http.dialects import anthropic as anthropic_api, completions as completions_api, openai as openai_api
from transports.http.server.choices import choice_requests, total_usage
from transports.http.dialects.common import Parsed, StreamEncoder
from transports.http.dialects.documents import fit_documents
from transports.http.server.errors import Dialect
from transports.http.gateway.gateway import Gateway
from transports.http.gateway.models import Flight, ServedModel
from transports.http.server.work import Checkpoint


@attrs.frozen
class Started:
    """The choices of one request, submitted: their flights in choice order, the prompt's
    size (for Anthropic's ``message_start``; 0 when not needed), whether the prompt left a
    ``<think>`` open, and for completions each choice's prompt ids and echo text."""

    flights: list[Flight]
    prompt_tokens: int = 0
    thinking: bool = False
    prompts: tuple[tuple[int, ...], ...] = ()
    echoes: tuple[str, ...] = ()

    def cancel(self) -> None:
        """Cancel every choice still running; their admission places are free at once."""
        for flight in self.flights:
            flight.cancel()


def _tokenizer(served: ServedModel) -> Tokenizer:
    tokenizer = served.pipe.stages.tokenizer
    assert tokenizer is not None, "a served pipeline has a tokenizer"
    return tokenizer


def _detokenizer(served: ServedModel) -> Detokenizer[Any]:
    detokenizer = served.pipe.stages.detokenizer
    assert detokenizer is not None, "a served pipeline has a detokenizer"
    return detokenizer


def _inputs(gateway: Gateway, served: ServedModel, parsed: Parsed,
            checkpoint: Checkpoint) -> list[Request]:
    """One request per prompt, ready to fit: chat's as parsed, a completions request's with
    each prompt as ids (a text far too long for the window is refused before it is
    tokenized)."""
    if parsed.raw is None:
        return [parsed.request]
    tokenizer = _tokenizer(served)
    prompts = parsed.raw.prompts
    out = []
    for p, prompt in enumerate(prompts):
        path = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        if isinstance(prompt, str):
            gateway.window_fit.refuse_longer(served, prompt, path)
        ids = completions_api.prompt_ids(tokenizer, prompt, path)
        out.append(attrs.evolve(parsed.request, prompt=None, prompt_ids=ids))
        checkpoint()
    return out


def start(gateway: Gateway, served: ServedModel, parsed: Parsed, dialect: Dialect,
          endpoint: str, loop: asyncio.AbstractEventLoop, checkpoint: Checkpoint,
          owners: frozenset[str] = frozenset()) -> Started:
    """Prepare and submit the request's choices (call on the work pool); their traces will
    be readable with the keys whose fingerprints are ``owners``."""
    fitted = []
    for request in _inputs(gateway, served, parsed, checkpoint):
        ready: Request | Prepared = request
        if parsed.documents:  # documents cut to the room the window leaves, when it is short
            ready = fit_documents(served.pipe, request, parsed.documents,
                                  gateway.window_fit.window(served), "messages")
        fitted.append(gateway.window_fit.fit(served, ready, max_tokens_given=parsed.max_tokens_given,
                                  checkpoint=checkpoint, budget_field=parsed.budget_field))
        checkpoint()
    # message_start reports the prompt's size before any token exists
    counted = parsed.stream and dialect is Dialect.ANTHROPIC
    prompt_tokens = len(fitted[0].prepared.tokens) if counted else 0
    checkpoint()
    base_id = parsed.request.request_id
    requests = choice_requests([f.request for f in fitted], parsed.n, base_id)
    chosen = [fitted[k // parsed.n].prepared.with_request(r) for k, r in enumerate(requests)]
    prompts: tuple[tuple[int, ...], ...] = ()
    echoes: tuple[str, ...] = ()
    if parsed.raw is not None:
        tokenizer = _tokenizer(served)
        prompts = tuple(r.prompt_ids or () for r in requests)
        echoes = tuple(completions_api.prompt_text(tokenizer, prompt)
                       for prompt in parsed.raw.prompts for _ in range(parsed.n))
    flights = gateway.admission.submit(served, chosen, endpoint, loop, record_id=base_id, n=parsed.n,
                             owners=owners)
    return Started(flights, prompt_tokens, fitted[0].thinking, prompts, echoes)


def split(served: ServedModel, parsed: Parsed, completion: Completion) -> list[Part]:
    """A whole answer's parts (answer text, thinking, tool calls), as the engine typed them
    (:attr:`~pipeline.contracts.output.Completion.parts`): the HTTP layer encodes, never re-parses."""
    return list(completion.parts)


def answer(served: ServedModel, parsed: Parsed, dialect: Dialect, started: Started,
           completions: Sequence[Completion]) -> dict[str, Any]:
    """The non-stream response body."""
    if dialect is Dialect.ANTHROPIC:
        (completion,) = completions
        return anthropic_api.message_body(parsed, completion, split(served, parsed, completion))
    if parsed.raw is not None:
        return completions_api.text_completion(parsed, completions, started.echoes,
                                               started.prompts, _tokenizer(served),
                                               _detokenizer(served))
    parts = [split(served, parsed, c) for c in completions]
    return openai_api.chat_completion(parsed, completions, parts,
                                      total_usage(completions, parsed.n), _tokenizer(served))


def encoder(served: ServedModel, parsed: Parsed, dialect: Dialect,
            started: Started) -> StreamEncoder:
    """The stream encoder of the request's dialect and endpoint."""
    if dialect is Dialect.ANTHROPIC:
        return anthropic_api.MessageStream(parsed, parsed.request.request_id,
                                           started.prompt_tokens)
    if parsed.raw is not None:
        return completions_api.TextStream(parsed, started.echoes, started.prompts,
                                          _tokenizer(served), _detokenizer(served))
    return openai_api.ChatStream(parsed, parsed.request.request_id, _tokenizer(served))


class FormStream(StreamEncoder, Protocol):
    """A :class:`Form`'s stream encoder, which also writes the event that ends a stream
    whose generation failed."""

    def fail(self, exc: BaseException) -> bytes:
        """The closing error event for ``exc``."""
        ...


class Form(Protocol):
    """An endpoint's own answer over the generation flow (``/v1/responses``): the non-stream
    body and the stream encoder that replace the dialect's :func:`answer` and
    :func:`encoder`."""

    def answer(self, served: ServedModel, parsed: Parsed, started: Started,
               completions: Sequence[Completion]) -> dict[str, Any]:
        """The non-stream body."""
        ...

    def encoder(self, served: ServedModel, parsed: Parsed, started: Started) -> FormStream:
        """The stream's encoder."""
        ...
