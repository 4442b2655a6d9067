"""The :class:`Pipeline`: the face users call (``generate``, ``stream``, ``submit``, ...).

Owns request normalization (docs/design.md §3, step "normalize"), rendering and tokenization on the
caller's thread, the start of every trace (``request.accepted`` → ``request.normalized`` with
the execution instance → ``context.rendered`` → ``input.tokenized``), validation against the
artifacts (vocabulary, context window, processor names), and the hand-off to the
:class:`~pipeline.engine.Engine`. A pipeline without a backend still renders, tokenizes and
counts tokens exactly. Build one with :func:`pipeline.build`.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from typing_extensions import Unpack

from pipeline.engine.api import EngineAPI
from pipeline.errors import ArtifactError, InvalidValueError, UnknownNameError
from pipeline.events import EventSink, Tracer, digest_ids, digest_json, digest_text
from pipeline.grammar import Grammar
from pipeline.engine.handle import RequestHandle
from pipeline.engine.job import Job
from pipeline.engine.job_spec import JobSpec
from pipeline.recording import parse_traceparent
from pipeline.room import window
from pipeline.request_options import RequestOptions
from pipeline.sampling_defaults import CALLER, SamplingDefaults, pipeline_default
from pipeline.contracts.decode import RequestCheck
from pipeline.contracts.model import ModelDescriber, ModelInfo, has_taps
from pipeline.contracts.text import Detokenizer, Renderer, Stopper, Tokenizer, ToolCallParser
from pipeline.contracts.transport import Transport
from pipeline.engine.text_state import TextState
from pipeline.output_parts import THINK_CLOSE, THINK_OPEN, opens_thinking
from pipeline.prepared import Prepared
from pipeline.tools.choice import constrain_calls
from pipeline.registry import Registry
from pipeline.tokenizing import render_request
if TYPE_CHECKING:
    import threading
    from pathlib import Path

    from pipeline.tools.boundary import Ask
    from pipeline.tools.executor import ToolPolicy
    from pipeline.tools.ledger import Ledger
    from pipeline.tools.loop import RoundChoice, Tool, ToolRun
from pipeline.contracts.output import Completion, Delta
from pipeline.contracts.request import (
    GenerationConfig, Message, Recording, Request, RuntimeLimits, ToolChoice, ToolSpec,
    from_mapping,
)
from pipeline.contracts.text import Rendered, TokenizedPrompt

Prompt = str | Sequence[Message | Mapping[str, Any]] | Request


def environment_id() -> str:
    """A digest of the runtime environment (Python, torch, platform, library version)."""
    from pipeline import __version__

    return digest_json({"python": sys.version, "torch": torch.__version__,
                        "platform": platform.platform(), "pipeline": __version__,
                        "threads": torch.get_num_threads()})


def seed_for(request: Request) -> int:
    """The request's seed, or one derived from its id (recorded, so runs replay)."""
    seed = request.generation_config.seed
    if seed is not None:
        return seed
    return int.from_bytes(hashlib.sha256(request.request_id.encode()).digest()[:8], "little") >> 1


def trace_context(request: Request) -> dict[str, Any]:
    """The caller's W3C trace context from ``client_metadata["traceparent"]``, for the trace:
    ``{"traceparent": {...}}`` when valid, ``{"traceparent_ignored": why}`` when not, else
    nothing."""
    if "traceparent" not in request.client_metadata:
        return {}
    context, why = parse_traceparent(request.client_metadata["traceparent"])
    return {"traceparent": context} if context is not None else {"traceparent_ignored": why}


@attrs.frozen
class Stages:
    """The resolved stages of a pipeline (what ``build`` produced)."""

    renderer: Renderer | None
    tokenizer: Tokenizer | None
    detokenizer: Detokenizer[Any] | None
    stoppers: tuple[Stopper[Any], ...]
    processor_names: tuple[str, ...]
    selector: str
    stream_transport: Transport[Iterator[Delta]]
    async_transport: Transport[AsyncIterator[Delta]]
    tool_parser: ToolCallParser | None = None
    request_checks: tuple[RequestCheck, ...] = ()
    """The processors that check a request before it is queued (:class:`RequestCheck`)."""


class Pipeline:
    """A built pipeline. Safe to use from many threads at once; close it when done."""

    def __init__(self, stages: Stages, engine: EngineAPI | None, *, sinks: Sequence[EventSink] = (),
                 defaults: GenerationConfig | None = None, model_snapshot: str | None = None,
                 description: Mapping[str, Any] | None = None,
                 registry: Registry | None = None, defaults_source: str | None = None) -> None:
        self.stages = stages
        self.registry = registry
        """Where named tools and policies come from (``run(tools=["name"])``)."""
        self.engine = engine
        chosen = (pipeline_default() if defaults is None
                  else SamplingDefaults(defaults, defaults_source or CALLER))
        self.defaults = chosen.config
        """What a request gets for every field it does not set (its keywords are laid over
        these): the model's recommended sampling, else the documented pipeline default
        (:mod:`pipeline.sampling_defaults`), unless ``build(defaults=...)`` gave them."""
        self.defaults_source = chosen.source
        """Where :attr:`defaults` came from: ``"generation_config.json"``, ``"GGUF
        metadata"``, ``"pipeline default"`` or ``"build(defaults=...)"``."""
        self.model_snapshot = model_snapshot or (engine.backend.snapshot if engine else None)
        self.description = dict(description or {})
        self._sinks = tuple(sinks)
        self._environment = environment_id()
        self._invariant: bool | None = (getattr(engine.backend, "batch_invariant", None)
                                        if engine is not None else None)
        """Whether the backend declares its rows independent of their batch (None: says
        nothing), recorded in every trace's instance as ``batch_invariant``."""
        self._threads: str | None = (getattr(engine.backend, "thread_policy", None)
                                     if engine is not None else None)
        """How the backend sets its CPU threads (the ``threads`` option, or chosen by
        measuring), recorded in every trace's instance as ``threads``."""
        self._think: tuple[int, int] | tuple[()] | None = None

    # --- artifacts without a model ---------------------------------------------------------

    def render(self, messages: Sequence[Message | Mapping[str, Any]], *,
               tools: Sequence[ToolSpec | Mapping[str, Any]] = (),
               add_generation_prompt: bool = True, **template_kwargs: Any) -> Rendered:
        """Render a conversation with the pipeline's chat template."""
        request = Request(messages=messages, tool_catalog=tools, template_kwargs=template_kwargs)
        return self._render(request, add_generation_prompt)

    def tokenize(self, prompt: Prompt | Rendered, *,
                 tools: Sequence[ToolSpec | Mapping[str, Any]] | None = None,
                 add_generation_prompt: bool | None = None,
                 **template_kwargs: Any) -> TokenizedPrompt:
        """Token ids of a string (one user turn), a conversation, a ``Request`` or rendered
        text. ``tools``, ``add_generation_prompt`` (default True) and template kwargs work as
        in :meth:`render` (and as transformers' ``apply_chat_template``); given for a
        ``Request``, they replace its own."""
        if isinstance(prompt, Rendered):
            return self._tokenizer.encode(prompt)
        if add_generation_prompt is not None:
            template_kwargs["add_generation_prompt"] = add_generation_prompt
        fields = self._kwargs_field(prompt, template_kwargs)
        if tools is not None:
            fields["tool_catalog"] = tools
        request = Request.coerce(prompt, **fields)
        return self._encode(request, self._render(request))

    def count_tokens(self, prompt: Prompt | Rendered, *,
                     tools: Sequence[ToolSpec | Mapping[str, Any]] | None = None,
                     add_generation_prompt: bool | None = None, **template_kwargs: Any) -> int:
        """The exact prompt length in tokens (what a gateway's window arithmetic needs); the
        arguments are :meth:`tokenize`'s."""
        return len(self.tokenize(prompt, tools=tools, add_generation_prompt=add_generation_prompt,
                                 **template_kwargs))

    # --- generation --------------------------------------------------------------------------

    def request(self, prompt: Prompt, config: GenerationConfig | None = None,
                **options: Unpack[RequestOptions]) -> Request:
        """Normalize what ``generate`` accepts into a :class:`Request` (not yet submitted).

        ``options`` (:class:`~pipeline.request_options.RequestOptions`) are
        :class:`GenerationConfig` fields (``max_tokens=20, temperature=0``) laid over ``config``
        or the pipeline's defaults, and the request's own (:data:`REQUEST_KEYWORDS`: its
        ``limits``, ``tools``, ``request_id``, ``recording`` (and ``tap_tensors``: which step's
        layers a ``taps`` trace keeps as tensors), ``template_kwargs`` and those
        below); an unknown name is an error.
        ``json_schema=`` (a JSON schema), ``json_object=True`` (any JSON object), ``regex=``
        (a regular expression the whole output matches), ``choice=`` (a list of strings the
        output is one of) and ``grammar=`` (a :class:`~pipeline.Grammar`, or a context-free
        grammar's text in Lark or EBNF) set the config's ``grammar``: the output then follows
        it by construction (:mod:`pipeline.grammar`; a schema feature the engine lacks is an
        error here). ``tool_choice=`` (``"auto"``, ``"none"``, ``"required"`` or a tool's
        name: :class:`~pipeline.contracts.request.ToolChoice`) and
        ``parallel_tool_calls=False`` (at most one call) say how the model may call ``tools``.
        """
        params: dict[str, Any] = dict(options)
        own = {name: params.pop(name) for name in REQUEST_KEYWORDS if name in params}
        fields: dict[str, Any] = {}
        base = config or (prompt.generation_config if isinstance(prompt, Request)
                          else self.defaults)
        params = _with_grammar(params, own.get("json_schema"), own.get("json_object", False),
                               own.get("regex"), own.get("choice"))
        if params:
            from_mapping(GenerationConfig, params)  # rejects unknown names with our error
            base = attrs.evolve(base, **params)
        fields["generation_config"] = base
        for key, name in (("runtime_limits", "limits"), ("tool_catalog", "tools"),
                          ("request_id", "request_id"), ("recording", "recording"),
                          ("tap_tensors", "tap_tensors"),
                          ("template_kwargs", "template_kwargs")):
            if own.get(name) is not None:
                fields[key] = own[name]
        tool_choice, parallel = own.get("tool_choice"), own.get("parallel_tool_calls")
        if tool_choice is not None or parallel is not None:
            current = prompt.tool_choice if isinstance(prompt, Request) else ToolChoice()
            chosen = ToolChoice.coerce(tool_choice) if tool_choice is not None else current
            if parallel is not None:
                chosen = attrs.evolve(chosen, parallel=parallel)
            fields["tool_choice"] = chosen
        return Request.coerce(prompt, **fields)

    def prepare(self, prompt: Prompt, config: GenerationConfig | None = None,
                **options: Unpack[RequestOptions]) -> Prepared:
        """The request made ready to submit, once: normalized (:meth:`request`), a required
        tool call's constraint added, validated against the artifacts and the strategy
        (:class:`~pipeline.contracts.strategy.Honours`), and rendered; it is tokenized on the first use
        of :attr:`~pipeline.prepared.Prepared.tokens`. Inspect it, change its budget or limits
        with :meth:`~pipeline.prepared.Prepared.with_request`, and :meth:`submit` it: the
        template and the tokenizer run once for all of that. Bad input raises here."""
        request = constrain_calls(self.request(prompt, config, **options),
                                  self.stages.tool_parser, self._tokenizer)
        self._validate(request)
        request = attrs.evolve(
            request, model_snapshot=self.model_snapshot,
            template_version=self.stages.renderer.digest if self.stages.renderer else None,
            tokenizer_version=self._tokenizer.digest)
        return Prepared(request, self._render(request), self, self._encode)

    def submit(self, prompt: Prompt | Prepared, config: GenerationConfig | None = None,
               **options: Unpack[RequestOptions]) -> RequestHandle:
        """Start a request; returns at once with a handle (``result``, ``deltas``, ``cancel``).

        Bad input raises here, before anything is queued. ``prompt`` is a prompt with
        ``options`` (those of :meth:`request`), or what :meth:`prepare` returned (which
        carries its options: giving more is an error).
        """
        engine = self._engine
        accepted_ns = time.monotonic_ns()
        if isinstance(prompt, Prepared):
            if config is not None or options:
                raise InvalidValueError(
                    "options", sorted(options) or "config", "a prepared request carries its "
                    "options: give them to prepare(), not submit()")
            if prompt.source is not self:
                raise InvalidValueError("prompt", "(prepared)", "was prepared by another "
                                        "pipeline: prepare it with the one that submits it")
            self._validate(prompt.request)  # a copy (with_request) may carry a new config
            prepared = prompt
        else:
            prepared = self.prepare(prompt, config, **options)
        request = prepared.request
        tracer = Tracer(request.request_id, self._sinks)
        accepted = tracer.emit("pipeline", "request.accepted", {
            "request_id": request.request_id, "schema_version": request.schema_version,
            "unix_ns": time.time_ns(), **trace_context(request)})
        spec = self._job_spec(prepared, tracer, accepted_ns, accepted)
        handle = RequestHandle(request.request_id, engine.wake)
        engine.submit(self.job(spec, tracer, handle))
        return handle

    def job(self, spec: JobSpec, tracer: Tracer, handle: RequestHandle) -> Job:
        """The engine's record of a request whose spec is made: its text state over this
        pipeline's detokenizer, stoppers and tool-call reader. :meth:`submit` makes one; so
        does an engine in another process for the spec it was sent
        (:mod:`pipeline.runtime.child`)."""
        assert self.stages.detokenizer is not None
        request = spec.request
        parser = self.stages.tool_parser
        reader = (parser.start(request.request_id) if parser is not None and
                  request.tools_shown else None)
        text = TextState(spec, self.stages.detokenizer, self.stages.stoppers,
                         self._tokenizer.token_bytes, reader)
        return Job(spec, text, tracer, handle)

    def generate(self, prompt: Prompt | Prepared, config: GenerationConfig | None = None,
                 **options: Unpack[RequestOptions]) -> Completion:
        """Run a request to completion and return it (raises ``RequestFailed`` on failure)."""
        return self.submit(prompt, config, **options).result()

    def stream(self, prompt: Prompt | Prepared, config: GenerationConfig | None = None,
               **options: Unpack[RequestOptions]) -> Iterator[Delta]:
        """Deltas as they are produced; closing the iterator early cancels the request."""
        return self.stages.stream_transport.deliver(self.submit(prompt, config, **options))

    def astream(self, prompt: Prompt | Prepared, config: GenerationConfig | None = None,
                **options: Unpack[RequestOptions]) -> AsyncIterator[Delta]:
        """The async-iterator form of :meth:`stream`, for an asyncio event loop."""
        return self.stages.async_transport.deliver(self.submit(prompt, config, **options))

    def run(self, messages: str | Sequence[Message | Mapping[str, Any]], *,
            tools: Sequence[Tool], max_rounds: int = 4, policy: ToolPolicy | str | None = None,
            ask: Ask | None = None, ledger: Ledger | str | Path | None = None,
            run_id: str | None = None, cancel: threading.Event | None = None,
            config: GenerationConfig | None = None, tool_choice: RoundChoice = None,
            **options: Any) -> ToolRun:
        """Let the model call ``tools`` and answer with their results (docs/design.md §11).

        ``tools`` are typed Python functions (their JSON schemas come from type hints and
        the docstring's ``Args:`` section), :class:`~pipeline.tools.ToolExecutor`\\s, or
        names of registered tool plugins; they are rendered through the chat template's
        tools support. Each call the model makes is parsed, validated against its schema,
        authorized by ``policy`` (a :class:`~pipeline.tools.ToolPolicy` or a registered
        policy's name; default: allow every offered tool; ``ask(call, verdict)`` answers a
        policy's ``ask``), committed under an idempotency key to ``ledger`` (a
        :class:`~pipeline.tools.Ledger` or a file path for a durable JSON-lines ledger;
        default: in memory), executed, and its result fed back as a ``tool`` message.
        ``max_rounds`` bounds the rounds of calls executed (so the model answers at most
        ``max_rounds + 1`` times); ``run_id`` seeds the idempotency keys (reuse it with the
        same ledger to resume a run without repeating effects); ``cancel`` (a
        ``threading.Event``) stops the loop — a call already committed keeps its effect.
        ``tool_choice`` applies to every round, or per round: a list (round ``i`` takes entry
        ``i``, the last repeating; ``["required", "none"]`` calls, then answers) or a function
        of the round's number. ``config`` and ``options`` are :meth:`generate`'s
        (``parallel_tool_calls=False`` among them). Every transition is a ``tool.*`` event in
        the round's trace; returns a :class:`~pipeline.tools.ToolRun`, whose ``stopped`` says
        why the loop ended.
        """
        from pipeline.tools.loop import run_tools

        return run_tools(self, messages, tools=tools, sinks=self._sinks, max_rounds=max_rounds,
                         policy=policy, ask=ask, ledger=ledger, run_id=run_id, cancel=cancel,
                         config=config, tool_choice=tool_choice, **options)

    def restart_engine(self) -> None:
        """Replace an engine whose loop stopped after an internal error (``engine.failure``)
        with a fresh one over the same backend; requests submitted meanwhile got
        :class:`~pipeline.errors.EngineClosed`. Does nothing while the engine is alive."""
        engine = self._engine
        if engine.failure is not None and not engine.alive:
            self.engine = engine.fresh()

    def close(self) -> None:
        """Cancel what is in flight, stop the engine and close the event sinks."""
        if self.engine is not None:
            self.engine.close()
        for sink in self._sinks:
            sink.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def model_info(self) -> ModelInfo | None:
        """What the backend says about its model (architecture, parameters, dtype, device,
        memory); ``None`` without a backend or from one that cannot say
        (:class:`~pipeline.contracts.model.ModelDescriber`)."""
        backend = self.engine.backend if self.engine is not None else None
        return backend.model_info() if isinstance(backend, ModelDescriber) else None

    def think_markers(self) -> tuple[int, int] | None:
        """Ids of ``<think>`` and ``</think>`` when the tokenizer has each as one token."""
        if self._think is None:
            tok = self._tokenizer
            ids = [tok.encode_text(m, special=True) for m in (THINK_OPEN, THINK_CLOSE)]
            self._think = (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else ()
        return self._think or None

    # --- internals ---------------------------------------------------------------------------

    @property
    def _engine(self) -> EngineAPI:
        if self.engine is None:
            raise ArtifactError("this pipeline has no model backend: it can render, tokenize "
                                "and count tokens, not generate")
        return self.engine

    @property
    def _tokenizer(self) -> Tokenizer:
        if self.stages.tokenizer is None:
            raise ArtifactError("this pipeline has no tokenizer")
        return self.stages.tokenizer

    @staticmethod
    def _kwargs_field(prompt: Prompt, template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if not template_kwargs:
            return {}
        return {"template_kwargs": template_kwargs} if not isinstance(prompt, Request) else {
            "template_kwargs": {**prompt.template_kwargs, **template_kwargs}}

    def _render(self, request: Request, add_generation_prompt: bool = True) -> Rendered:
        return render_request(request, self.stages.renderer, self._tokenizer,
                              add_generation_prompt)

    def _encode(self, request: Request, rendered: Rendered) -> TokenizedPrompt:
        """The prompt's ids: ``rendered`` tokenized, or a token-id prompt as it is."""
        tokenizer = self._tokenizer
        if request.prompt_ids is not None:
            return TokenizedPrompt(request.prompt_ids, tokenizer.digest,
                                   digest_text(rendered.text))
        return tokenizer.encode(rendered)

    def _job_spec(self, prepared: Prepared, tracer: Tracer, accepted_ns: int, parent: int
                  ) -> JobSpec:
        """The job of a prepared request: its trace's opening events, its tokens (the window
        and the processors' request checks hold for them), its seed and forcing markers."""
        request, rendered, tokenizer = prepared.request, prepared.rendered, self._tokenizer
        seed = seed_for(request)
        parent = tracer.emit("pipeline", "request.normalized", self._instance(request, seed),
                             parent)
        parent = tracer.emit("renderer", "context.rendered", {
            "renderer": rendered.renderer, "template_digest": rendered.template_digest,
            "rendered_digest": digest_text(rendered.text), "chars": len(rendered.text),
            "control_spans": sum(1 for s in rendered.spans if s.kind.value == "control"),
            **({"text": rendered.text} if request.recording.content else {})}, parent)
        prompt = prepared.tokens
        self._check_window(prompt, request.runtime_limits.max_context_tokens)
        for check in self.stages.request_checks:
            check.check_request(request.generation_config, prompt.input_ids)
        last = tracer.emit("tokenizer", "input.tokenized", {
            "tokens": len(prompt), "ids_digest": digest_ids(prompt.input_ids),
            "positions_digest": digest_ids(prompt.positions),
            "tokenizer_digest": prompt.tokenizer_digest,
            "rendered_digest": prompt.rendered_digest,
            **({"input_ids": list(prompt.input_ids)}
               if request.recording.content else {})}, parent)
        think = (self.think_markers() if request.generation_config.reasoning_budget_tokens
                 is not None else None)
        return JobSpec(request, prompt, seed, tokenizer.eos_token_ids, accepted_ns, last, think,
                       opens_thinking(rendered.text))

    def _instance(self, request: Request, seed: int) -> dict[str, Any]:
        """The execution instance (docs/design.md §3): request plus artifact digests, seed,
        runtime."""
        config = attrs.asdict(request.generation_config)
        config["logit_bias"] = {str(k): v for k, v in request.generation_config.logit_bias.items()}
        return {
            "request_id": request.request_id, "schema_version": request.schema_version,
            "messages_digest": digest_json([m.to_template() for m in request.messages]),
            "prompt_digest": self._prompt_digest(request),
            "tools_digest": digest_json([t.to_template() for t in request.tool_catalog]),
            "template_kwargs": dict(request.template_kwargs),
            "model_snapshot": request.model_snapshot,
            "template_version": request.template_version,
            "tokenizer_version": request.tokenizer_version,
            "generation_config": config, "processor_chain": list(self.stages.processor_names),
            "seed": seed, "rng": "counter:splitmix64(seed,stream,step)",
            "runtime_limits": attrs.asdict(request.runtime_limits),
            "environment": self._environment, "batch_invariant": self._invariant,
            "threads": self._threads,
            "recording": request.recording.value,
            **trace_context(request),
        }

    @staticmethod
    def _prompt_digest(request: Request) -> str | None:
        """The digest of a raw prompt: its text, or its ids (None for messages)."""
        if request.prompt_ids is not None:
            return digest_ids(request.prompt_ids)
        return digest_text(request.prompt) if request.prompt is not None else None

    def _validate(self, request: Request) -> None:
        config = request.generation_config
        # token-id fields may name any id the model has (its vocabulary may be padded beyond
        # the tokenizer's; padding ids are never selected, see Engine.decodable_vocab)
        vocab = (self.engine.backend.vocab_size if self.engine is not None
                 else self._tokenizer.vocab_size)
        known = min(vocab, self._tokenizer.vocab_size)  # a prompt id must have a token
        for at, token in enumerate(request.prompt_ids or ()):
            if token >= known:
                raise InvalidValueError(f"prompt_ids[{at}]", token,
                                        f"outside the vocabulary (size {known})")
        for token in sorted(config.token_ids_used()):
            if token >= vocab:
                field = "logit_bias" if token in config.logit_bias else "token ids"
                raise InvalidValueError(field, token, f"outside the vocabulary (size {vocab})")
        for name in config.processor_order or ():
            if name not in self.stages.processor_names:
                raise UnknownNameError("processor", name, self.stages.processor_names)
        if request.recording is Recording.TAPS and (
                self.engine is None or not has_taps(self.engine.backend)):
            backend = type(self.engine.backend).__name__ if self.engine else "no backend"
            raise InvalidValueError("recording", "taps", f"this pipeline's backend ({backend}) "
                                    "has no layer taps (LayerTaps: the torch and transformers "
                                    "backends have them)")
        if self.engine is not None:  # the one check of what the strategy keeps
            strategy = self.engine.strategy(config.processor_order)
            refused = strategy.honours.refusal(config, strategy.name)
            if refused is not None:
                raise refused

    def _check_window(self, prompt: TokenizedPrompt, request_limit: int | None) -> None:
        if self.engine is None:
            return
        limit = window(self.engine.backend.max_context, request_limit)
        if len(prompt) >= limit:
            raise InvalidValueError("prompt", len(prompt),
                                    f"prompt is too long: {len(prompt)} tokens >= {limit} "
                                    "maximum context (no room for one output token)")


REQUEST_KEYWORDS = (
    "limits", "tools", "request_id", "recording", "tap_tensors", "template_kwargs", "json_schema",
    "json_object", "regex", "choice", "tool_choice", "parallel_tool_calls",
)
"""The keywords of :meth:`Pipeline.request` (and so of ``generate``) that are the request's
own rather than :class:`~pipeline.contracts.request.GenerationConfig` fields."""


def _with_grammar(params: dict[str, Any], json_schema: Mapping[str, Any] | bool | None,
                  json_object: bool, regex: str | None = None,
                  choice: Sequence[str] | None = None) -> dict[str, Any]:
    """``params`` with the ``grammar`` that ``json_schema`` / ``json_object`` / ``regex`` /
    ``choice`` ask for (a ``grammar`` given as text is read as Lark or EBNF)."""
    asked = [n for n, v in (("json_schema", json_schema is not None),
                            ("json_object", json_object), ("regex", regex is not None),
                            ("choice", choice is not None), ("grammar", "grammar" in params))
             if v]
    if len(asked) > 1:
        raise InvalidValueError(asked[1], True, "give one of json_schema=, json_object=True, "
                                f"regex=, choice= and grammar=, not {' and '.join(asked)}")
    if json_object is not False and json_object is not True:
        raise InvalidValueError("json_object", json_object, "must be True or False")
    if json_schema is not None:
        return {**params, "grammar": Grammar.json_schema(json_schema)}
    if json_object:
        return {**params, "grammar": Grammar.json_object()}
    if regex is not None:
        return {**params, "grammar": Grammar.regex(regex)}
    if choice is not None:
        return {**params, "grammar": Grammar.choice(choice)}
    if isinstance(params.get("grammar"), str):
        return {**params, "grammar": Grammar.text(params["grammar"])}
    return params
