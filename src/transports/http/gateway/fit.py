"""The window fit: a request's ``max_tokens`` against the room its prompt leaves, and the
thinking guard.

Owns :class:`WindowFit` (``room = window - slack - prompt``: a character-class bound first, a
length bound before tokenizing, the exact count only near the limit; clamp or refuse
``max_tokens``; a reasoning budget that leaves an answer room when the request gives no
thinking preference), :class:`Fitted` and :func:`token_upper_bound`. The window and the room
are :mod:`pipeline.room`'s arithmetic, as the engine's and the strategies' are.
"""

from __future__ import annotations

import math

import attrs

from pipeline.errors import ContextWindowError
from pipeline.output_parts import opens_thinking
from pipeline.prepared import Prepared
from pipeline.room import room
from pipeline.room import window as request_window
from pipeline.contracts.request import Request
from transports.http.gateway.models import ServedModel
from transports.http.server.config import ServerConfig
from transports.http.server.work import Checkpoint


def token_upper_bound(text: str) -> int:
    """An upper bound on the token count of ``text`` by character class, without tokenizing.

    A byte-level BPE token covers at least one UTF-8 byte, so the count is at most the byte
    length: 1 per ASCII character, 2 below U+0800, 3 below U+10000, else 4. (A tokenizer with
    tokens that cover no input byte, like SentencePiece's dummy prefix, can exceed it by a few;
    the pipeline's own window check and the engine's context-full stop still hold then.)
    """
    return len(text.encode("utf-8", "surrogatepass"))


def _prompt_field(request: Request) -> str:
    """The body field a too-long prompt came from."""
    return "messages" if request.messages else "prompt"


@attrs.frozen
class Fitted:
    """A prepared request fitted to the window, and whether its prompt left a ``<think>``
    open."""

    prepared: Prepared
    thinking: bool

    @property
    def request(self) -> Request:
        """The fitted request."""
        return self.prepared.request


class WindowFit:
    """Fits requests to a served model's window under the server's settings."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def window(self, served: ServedModel) -> int:
        """The tokens a request may use: the model's window, capped by ``max_context``, less
        ``context_slack``."""
        limit = request_window(served.max_context, self.config.max_context)
        return limit - self.config.context_slack

    def fit(self, served: ServedModel, request: Request | Prepared, *, max_tokens_given: bool,
            checkpoint: Checkpoint | None = None, budget_field: str = "max_tokens") -> Fitted:
        """``request``, prepared (rendered once, :meth:`~pipeline.pipe.Pipeline.prepare`),
        with ``max_tokens`` fitted to the room the prompt leaves.

        ``room = window - slack - prompt_tokens``. When the character-class bound plus
        ``max_tokens`` fits, the prompt is not counted here at all (a token-id prompt is
        counted by its length). A prompt with more
        characters than ``window`` tokens of the longest token could cover is refused before
        tokenizing. ``checkpoint`` is called between the render and the count. A refused
        budget is named ``budget_field``, the body's name for it. The tokens counted here
        are the ones submitted: the prompt is tokenized at most once.
        """
        prepared = request if isinstance(request, Prepared) else served.pipe.prepare(request)
        request = prepared.request
        window = self.window(served)
        limits = request.runtime_limits
        prepared = prepared.with_request(attrs.evolve(request, runtime_limits=attrs.evolve(
            limits, max_context_tokens=window,
            deadline_s=limits.deadline_s or self.config.request_deadline_s,
            queue_timeout_s=limits.queue_timeout_s or self.config.max_queue_wait_s)))
        if request.prompt_ids is not None:  # counted already: its length
            return self._fit_count(prepared, len(request.prompt_ids), window, False,
                                   max_tokens_given, budget_field)
        text = prepared.rendered.text
        thinking = opens_thinking(text)
        if token_upper_bound(text) + request.generation_config.max_tokens <= window:
            return self._guard_thinking(served, Fitted(prepared, thinking))
        self.refuse_longer(served, text, _prompt_field(request))
        if checkpoint is not None:
            checkpoint()
        return self._guard_thinking(served, self._fit_count(
            prepared, len(prepared.tokens), window, thinking, max_tokens_given, budget_field))

    def _guard_thinking(self, served: ServedModel, fitted: Fitted) -> Fitted:
        """The thinking guard (:class:`ServerConfig`): a request with no thinking preference
        and no budget gets a reasoning budget that leaves its answer
        ``min(answer_reserve_tokens, max_tokens // 3)`` tokens after the two think markers,
        when the model has think markers and its strategy keeps a budget."""
        request = fitted.request
        config = request.generation_config
        engine = served.pipe.engine
        if (config.reasoning_budget_tokens is not None or "enable_thinking" in
                request.template_kwargs or engine is None or served.pipe.think_markers() is None
                or not engine.strategy(config.processor_order).honours.reasoning_budget):
            return fitted
        reserve = min(self.config.answer_reserve_tokens, config.max_tokens // 3)
        budget = max(0, room(config.max_tokens, reserve + 2))  # <think> and </think> count too
        guarded = attrs.evolve(config, reasoning_budget_tokens=budget)
        return Fitted(fitted.prepared.with_request(attrs.evolve(
            request, generation_config=guarded)), fitted.thinking)

    def refuse_longer(self, served: ServedModel, text: str, field: str) -> None:
        """Refuse ``text`` without tokenizing it when it has more characters than the window's
        tokens could cover even at the vocabulary's longest token."""
        window = self.window(served)
        at_least = math.ceil(len(text) / served.token_chars)
        if at_least > window - 1:
            raise ContextWindowError(field, at_least, window - 1, lower_bound=True)

    def _fit_count(self, prepared: Prepared, prompt_tokens: int, window: int, thinking: bool,
                   max_tokens_given: bool, budget_field: str) -> Fitted:
        """:meth:`fit` once the prompt's exact length is known."""
        request = prepared.request
        config = request.generation_config
        if prompt_tokens > window - 1:
            raise ContextWindowError(_prompt_field(request), prompt_tokens, window - 1)
        left = room(config.max_tokens, 0, window=window, held=prompt_tokens)
        if config.max_tokens <= left:
            return Fitted(prepared, thinking)
        if max_tokens_given and not self.config.clamp_max_tokens:
            raise ContextWindowError(budget_field, prompt_tokens, left, config.max_tokens)
        fitted = attrs.evolve(config, max_tokens=left, min_tokens=min(config.min_tokens, left))
        return Fitted(prepared.with_request(attrs.evolve(request, generation_config=fitted)),
                      thinking)
