"""OpenAI embeddings: ``POST /v1/embeddings`` bodies in, ``list`` of ``embedding`` out.

Owns :func:`parse_embeddings` (a body → :class:`EmbeddingsAsk`, every field type-checked,
unknown fields refused), :func:`token_inputs` (each input as the model's ids, bounded),
:func:`embed` (the vectors) and :func:`embeddings_body` (OpenAI's shape, floats or base64).

``input`` is a string, a list of strings, a list of token ids (one input) or a list of lists
of token ids. A text is encoded as ``/v1/completions`` encodes a prompt
(:func:`~transports.http.dialects.completions.prompt_ids`: the tokenizer alone, its own leading
ids, special-token strings parsed), so it gives the ids a Hugging Face tokenizer gives.

**The vector** is the mean, over the input's tokens, of the model's final hidden states
(the last layer after the final norm: what the output head reads), L2-normalized, in
float32. Mean rather than the last token: a causal model's last state is shaped to predict
the next token, while the mean weighs every token of the text, and needs no end-of-text
token the model may not have been trained to summarise at. Normalized as OpenAI's are, so a
dot product is the cosine similarity.

**Where the forward runs.** The engine thread owns the backend: the model keeps scratch state
per forward (its row plans), and another thread's forward would race the engine's. So each
input is one :meth:`~pipeline.runtime.thread.ThreadEngine.call`: the engine runs it on its own thread
between two steps, one per step, so a long batch of inputs interleaves with the decoding of
requests in flight instead of stalling them, and the forward writes no KV cache
(:class:`~pipeline.contracts.model.Embedder`). A request's inputs are asked for one after another,
so each request has at most one call waiting; the engine's queue of calls is bounded
(:data:`~pipeline.engine.MAX_CALLS`: past it a 429). A call is not timed by the stall
watchdog, so its size is bounded here: :data:`MAX_INPUT_TOKENS` per input, and attention
runs in query tiles (memory linear in the input). The event loop only awaits; a client that
leaves, or an input that fails, stops the inputs not yet started. A backend without the
capability is a 400 naming the model.

**Bounds**, before any tokenizing: at most :data:`MAX_INPUTS` inputs and
``max_prompt_chars`` characters of text (the server's limit); then each input within the
model's window and :data:`MAX_INPUT_TOKENS` (a text far too long refused by its length
first), and
:data:`MAX_TOTAL_TOKENS` tokens in all.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from starlette.requests import Request as HTTPRequest

from pipeline.errors import CapacityError, ContextWindowError, LimitExceededError
from transports.http.serving_errors import ClientGone, OverloadedError
from pipeline.contracts.model import Embedder
from transports.http.dialects.common import RawPrompt, raw_prompts
from transports.http.dialects.completions import prompt_ids
from transports.http.dialects.spec import one_of, unsupported
from transports.http.dialects.fields import Obj
from transports.http.gateway.gateway import Gateway
from transports.http.gateway.models import ServedModel
from transports.http.server.limits import Limits
from transports.http.server.work import Checkpoint, disconnected

MAX_INPUTS = 2048
"""Inputs in one request (OpenAI's own bound)."""
MAX_INPUT_TOKENS = 8192
"""Tokens of one input (OpenAI's own bound for its embedding models): one forward of the
engine's, which nothing else interrupts."""
MAX_TOTAL_TOKENS = 300_000
"""Tokens of all inputs of one request together (OpenAI's own bound)."""

@attrs.frozen
class EmbeddingsAsk:
    """An embeddings body, checked: the model, the inputs, the encoding, the dimensions."""

    model: str
    inputs: tuple[RawPrompt, ...]
    base64: bool = False
    dimensions: int | None = None


def parse_embeddings(raw: Any, limits: Limits) -> EmbeddingsAsk:
    """An embeddings body → what it asks; the text is bounded by ``max_prompt_chars``."""
    body = Obj(raw, "body")
    model = body.need("model", "string")
    inputs = raw_prompts(body, "input", MAX_INPUTS)
    chars = sum(len(i) for i in inputs if isinstance(i, str))
    if chars > limits.max_prompt_chars:
        raise LimitExceededError("input", "max_prompt_chars", chars, limits.max_prompt_chars,
                                 "characters of input text")
    encoding = one_of(body, "encoding_format", ("float", "base64"))
    dimensions = body.num("dimensions", 1, 1 << 30, integer=True)
    body.get("user", "string")  # an end-user id: nothing here depends on it
    body.done()
    return EmbeddingsAsk(model, inputs, encoding == "base64", dimensions)


def embedder(served: ServedModel) -> Embedder:
    """The served model's backend as an :class:`~pipeline.contracts.model.Embedder`; a 400 naming
    the model when it has no such capability."""
    engine = served.pipe.engine
    backend = engine.backend if engine is not None else None
    if not isinstance(backend, Embedder):
        raise unsupported("model", served.name, f"model '{served.name}' gives no embeddings "
                          "(its backend computes no final hidden states)")
    return backend


def token_inputs(gateway: Gateway, served: ServedModel, ask: EmbeddingsAsk,
                 checkpoint: Checkpoint) -> list[tuple[int, ...]]:
    """Each input as ids (call on the work pool): a text too long for the window refused
    before it is tokenized, every input within the window, all within
    :data:`MAX_TOTAL_TOKENS`; ``dimensions`` other than the model's is a 400."""
    size = embedder(served).hidden_size
    if ask.dimensions is not None and ask.dimensions != size:
        raise unsupported("dimensions", ask.dimensions,
                          f"model '{served.name}' gives {size} dimensions and does not "
                          f"shorten them: leave 'dimensions' out or send {size}")
    tokenizer = served.pipe.stages.tokenizer
    assert tokenizer is not None, "a served pipeline has a tokenizer"
    window, total, out = gateway.window_fit.window(served), 0, []
    for i, item in enumerate(ask.inputs):
        path = "input" if len(ask.inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            gateway.window_fit.refuse_longer(served, item, path)
        ids = prompt_ids(tokenizer, item, path)
        if len(ids) > min(window, MAX_INPUT_TOKENS):
            raise ContextWindowError(path, len(ids), min(window, MAX_INPUT_TOKENS))
        total += len(ids)
        if total > MAX_TOTAL_TOKENS:
            raise LimitExceededError("input", "max_total_tokens", total, MAX_TOTAL_TOKENS,
                                     "tokens of input (at least)")
        out.append(ids)
        checkpoint()
    return out


def pooled(backend: Embedder, ids: Sequence[int]) -> torch.Tensor:
    """The embedding of ``ids``: the mean of its final hidden states, L2-normalized,
    ``[hidden_size]`` float32 (call on the engine's thread)."""
    states = backend.hidden_states(ids)                                        # [T, H]
    return F.normalize(states.float().mean(0), dim=0)                          # [H]


async def embed(http: HTTPRequest, served: ServedModel,
                inputs: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Every input's embedding, each computed by the engine between two of its steps, one
    input after another; a client that leaves first stops those not started
    (:class:`ClientGone`), a full queue of engine calls is a 429."""
    backend = embedder(served)
    engine = served.pipe.engine
    assert engine is not None
    watcher: asyncio.Future[Any] = asyncio.ensure_future(disconnected(http))
    vectors = []
    try:
        for ids in inputs:
            try:
                future = engine.call(functools.partial(pooled, backend, ids))
            except CapacityError as exc:
                raise OverloadedError(f"the engine is busy: {exc}; try again later") from exc
            done = asyncio.wrap_future(future)
            await asyncio.wait({done, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                future.cancel()
                raise ClientGone("the client disconnected while its embeddings were computed")
            vectors.append(done.result())
    finally:
        watcher.cancel()
    return vectors


def _encoded(vector: torch.Tensor, as_base64: bool) -> list[float] | str:
    if as_base64:  # little-endian float32, as OpenAI's SDKs decode it
        data = np.asarray(vector.numpy(), dtype="<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()


def embeddings_body(ask: EmbeddingsAsk, inputs: Sequence[Sequence[int]],
                    vectors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The response body: one ``embedding`` per input, in order, and the usage."""
    tokens = sum(len(ids) for ids in inputs)
    return {"object": "list", "model": ask.model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(v, ask.base64)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
