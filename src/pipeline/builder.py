"""``build()``: compose a :class:`~pipeline.pipe.Pipeline` from names or instances.

Owns stage resolution: every stage argument is a registered name (looked up through the
pluggy :class:`~pipeline.registry.Registry`) or an object that satisfies the stage's Protocol,
used as given. Nothing here imports an implementation by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, TypeVar, cast

import attrs

from pipeline.engine import EngineConfig
from pipeline.errors import ArtifactError, InvalidValueError, RegistryError, hint_keywords
from pipeline.events import EventSink
from pipeline.model_paths import (
    DEFAULT_MODEL, GENERATION_KEY, TINY_MODEL_DIR, ResolvedModel, generation_marker,
    is_gguf_file, resolve_model,
)
from pipeline.options import BackendOptions
from pipeline.pipe import Pipeline, Stages
from pipeline.contracts.decode import LogitProcessor, RequestCheck, Selector
from pipeline.contracts.model import Backend, backend_honours
from pipeline.contracts.strategy import Honours, Strategy
from pipeline.contracts.text import Detokenizer, Renderer, Stopper, Tokenizer, ToolCallParser
from pipeline.contracts.transport import Transport
from pipeline.registry import DEFAULT_ORDER, DEFAULT_STOPPERS, BuildContext, Registry
from pipeline.runtime.thread import ThreadEngine
from pipeline.sampling_defaults import for_build
from pipeline.strategy_choice import StrategyChoice
from pipeline.tokenizing import renderer_stage, resolve, tokenizer_stage
from pipeline.contracts.output import Delta
from pipeline.contracts.request import GenerationConfig
from pipeline.tools.formats import choose_parser

AUTOREGRESSIVE_STRATEGIES = ("autoregressive", "speculative")
"""The built-in strategies that need an autoregressive model (no ``pipeline_generation``)."""
DEFAULT_PROCESSORS = ("grammar", *DEFAULT_ORDER)
"""The built-in processors of the default chain, in order: ``grammar`` (built with the
tokenizer, :mod:`stages.structured`), then :data:`~pipeline.registry.DEFAULT_ORDER`."""
ADDED_PROCESSORS_BEFORE = "temperature"
"""Where ``build(processors=[...])`` inserts its processors: after every mask, bias and
penalty, before temperature and truncation (see :func:`build`)."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


StrategyMaker = Callable[[Sequence[LogitProcessor], Selector], Strategy]
T = TypeVar("T")


@hint_keywords
def build(
    model: str | Path | None = None, *,
    backend: str | Backend | None = None,
    tokenizer: str | Tokenizer | None = None,
    renderer: str | Renderer | None = None,
    processors: Sequence[str | LogitProcessor] | None = None,
    replace_processors: bool = False,
    selector: str | Selector = "sample",
    detokenizer: str | Detokenizer[Any] = "incremental",
    stoppers: Sequence[str | Stopper[Any]] | None = None,
    replace_stoppers: bool = False,
    strategy: str | StrategyChoice | Strategy | None = None,
    steps: int | None = None,
    block_length: int | None = None,
    strategy_options: Mapping[str, Any] | None = None,
    plugins: Sequence[object] = (),
    sinks: Sequence[EventSink] = (),
    engine: EngineConfig | None = None,
    defaults: GenerationConfig | None = None,
    options: BackendOptions | Mapping[str, Any] | None = None,
    tool_parser: str | ToolCallParser | None = None,
    async_transport: str | Transport[AsyncIterator[Delta]] = "asyncio",
    device: str | None = None,
    dtype: str | None = None,
) -> Pipeline:
    """Build a pipeline for ``model`` or from explicit stages.

    ``model`` is a Hugging Face-layout folder, a GGUF file, a short name (``"smollm2"``,
    ``"tiny"``) or a repo id in the local Hugging Face cache (:mod:`pipeline.model_paths`). With
    no model, backend or tokenizer, the default model (SmolLM2-135M-Instruct) is used.

    A folder that holds only tokenizer files gives a pipeline that renders, tokenizes and
    counts tokens without a model. Every stage argument takes a registered name or an
    instance; ``plugins`` adds plugin objects beside those of the ``pipeline`` entry points.
    ``options`` configures the model backend (device, dtype, slots, ...): a
    :class:`~pipeline.options.BackendOptions` or a mapping of its fields (an unknown key is an
    :class:`~pipeline.errors.UnknownFieldError` naming the closest one); a device this
    machine does not have is refused here, before anything loads. ``device=`` and ``dtype=``
    are short for the same fields of ``options`` (``build(device="cuda", dtype="bfloat16")``);
    giving one both ways with different values is an error. A keyword ``build`` does not take
    is an :class:`~pipeline.errors.UnknownKeywordError` (also a ``TypeError``) that names the
    closest one it does.

    The processor chain runs in this order (a request may reorder it with
    ``GenerationConfig.processor_order``; the trace records the order used):

    1. ``grammar`` — tokens the request's ``grammar`` does not allow next are removed
    2. ``allowed_tokens`` — everything outside ``allowed_token_ids`` is removed
    3. ``banned_tokens`` — ``banned_token_ids`` are removed
    4. ``logit_bias`` — the per-token biases are added
    5. ``min_tokens`` — EOS and stop tokens are removed until ``min_tokens`` outputs exist
    6. ``repetition_penalty`` — over prompt and output tokens (divide positive, multiply negative)
    7. ``presence_penalty`` — over output tokens, once per distinct token
    8. ``frequency_penalty`` — over output tokens, per occurrence
    9. ``dry`` — the DRY sequence penalty: a token that would extend a repeated run of the
       output loses ``dry_multiplier * dry_base ** (L - dry_allowed_length)``
    10. the ``processors`` you pass, in the order given
    11. ``temperature`` — divide by T (T < 1e-5, zero included, is greedy: left for argmax)
    12. ``top_k`` — keep the k most likely
    13. ``top_p`` — keep the smallest set with mass >= p
    14. ``min_p`` — keep tokens with probability >= min_p × the top probability
    15. ``typical_p`` — locally typical sampling

    Masks and biases come first so that penalties and truncation see the allowed vocabulary (the
    grammar first: what it forbids can never be chosen, whatever the biases);
    temperature comes before truncation, as in vLLM, SGLang and transformers, so ``top_p``
    acts on the distribution that is sampled. Your processors (step 10) join the default chain
    rather than replace it, so the request's temperature, top-k, top-p and penalties keep
    working. They run on logits with every mask, bias and penalty applied, at the logits'
    own scale (a bias of +5 means what ``logit_bias`` of +5 means, whatever the
    temperature), and before temperature and truncation, so truncation keeps only tokens
    your processor allows and sampling draws from exactly what truncation kept: a processor
    that masks or boosts tokens is obeyed by ``top_k=1`` and by greedy decoding alike. A name
    that is already in the chain is an error.

    ``replace_processors=True`` makes ``processors`` the whole chain instead, in the order
    given (names of built-ins and instances mixed; an empty list leaves the logits as the
    model gave them). Built-ins you leave out then do nothing, whatever a request asks.

    Selection follows (``selector``), then the stoppers, in order: ``eos``, ``max_tokens``,
    ``stop_strings``, ``deadline``, then the ``stoppers`` you pass (so a request's
    ``max_tokens``, stop strings and deadline keep working beside yours); when two end the
    run at the same token, the earlier one's reason is reported. ``replace_stoppers=True``
    makes ``stoppers`` the whole list.

    ``strategy`` (a name, a :class:`~pipeline.strategy_choice.StrategyChoice` that also
    carries ``steps``, ``block_length`` and ``strategy_options``, or a
    :class:`~pipeline.contracts.strategy.Strategy` instance, used as it is with its own chain: a
    request that reorders processors is then refused) says how tokens are generated:
    ``"autoregressive"`` (the default for an autoregressive model), ``"speculative"``, or an
    iterative sampler such as masked
    diffusion's ``"llada"``, ``"fast_dllm"`` and ``"dfm"`` (docs/diffusion.md) or continuous
    diffusion's and flow's ``"ddpm"``, ``"ddim"`` and ``"flow"`` (docs/continuous.md). A
    model whose ``config.json`` carries a ``pipeline_generation`` marker is not autoregressive: without a
    ``strategy`` it gets the marker's, and an autoregressive strategy on it is an error (as is
    an iterative one on a model without the marker). ``steps`` (model calls per block) and
    ``block_length`` (positions per block) configure iterative strategies; the strategy's
    other settings go in ``strategy_options``.

    ``tool_parser`` names (or is) the reader of the model's tool calls (``"hermes"``,
    ``"llama3_json"``, ``"mistral"``); by default it is the format the chat template writes
    (:func:`pipeline.tools.formats.choose_parser`).

    ``async_transport`` names (or is) the bridge that delivers a request's deltas on an
    asyncio event loop: ``Pipeline.astream`` and the HTTP server's streams both go through it
    (default ``"asyncio"``: one merged delta per wake-up of the loop).

    ``defaults`` are what a request gets for every field it does not set. Without them the
    pipeline's defaults are the model's recommended sampling (its ``generation_config.json``,
    or a GGUF file's ``general.sampling.*`` metadata), else the documented
    :data:`~pipeline.sampling_defaults.PIPELINE_DEFAULT`; ``Pipeline.defaults_source`` says
    which (:mod:`pipeline.sampling_defaults`).
    """
    registry = Registry(plugins)
    backend_options = _with_device(BackendOptions.coerce(options), device, dtype)
    backend_options.check_device()
    if model is None and backend is None and tokenizer is None:
        model = DEFAULT_MODEL
    found = resolve_model(model) if model is not None else ResolvedModel()
    model_dir, model_file = found.directory, found.file
    if model_file is not None and not is_gguf_file(model_file):
        raise InvalidValueError("model", str(model), "a model file must be a GGUF file")
    given: Strategy | None = None
    if strategy is not None and not isinstance(strategy, str):  # it comes configured
        chosen = isinstance(strategy, StrategyChoice)
        if not chosen and not isinstance(strategy, Strategy):
            raise InvalidValueError("strategy", type(strategy).__name__, "must be a strategy's "
                                    "name, a StrategyChoice or a Strategy instance")
        for field, value in (("steps", steps), ("block_length", block_length),
                             ("strategy_options", strategy_options)):
            if value is not None:
                raise InvalidValueError(field, value, "is set by strategy=StrategyChoice(...); "
                                        "give it there" if chosen else "configures a strategy "
                                        "build() makes; a Strategy instance comes configured")
    if isinstance(strategy, StrategyChoice):  # the choice as one value: it says it all
        choice = strategy.build_args()
        steps, block_length = choice["steps"], choice["block_length"]
        named: str | None = choice["strategy"]
        strategy_options = choice["strategy_options"]
    elif isinstance(strategy, Strategy):
        given, named = strategy, strategy.name
    else:
        named = strategy
    name, strategy_settings = _strategy(model_dir, named, steps, block_length,
                                        _mapping("strategy_options", strategy_options),
                                        given is not None)
    context = BuildContext(model_dir=model_dir, options=backend_options, model_file=model_file,
                           strategy_options=strategy_settings)
    tok = tokenizer_stage(registry, context, tokenizer)
    context = attrs.evolve(context, tokenizer=tok)
    procs = [resolve(registry, "processor", p, context)
             for p in _chain_of("processors", DEFAULT_PROCESSORS, processors, replace_processors,
                               before=ADDED_PROCESSORS_BEFORE)]
    _unique("processors", [p.name for p in procs], replace_processors)
    sel: Selector = resolve(registry, "selector", selector, context)
    stops = tuple(resolve(registry, "stopper", s, context)
                  for s in _chain_of("stoppers", DEFAULT_STOPPERS, stoppers, replace_stoppers))
    _unique("stoppers", [s.name for s in stops], replace_stoppers)
    chat = renderer_stage(registry, context, renderer)
    stages = Stages(
        renderer=chat,
        tokenizer=tok,
        detokenizer=resolve(registry, "detokenizer", detokenizer, context) if tok else None,
        stoppers=stops,
        processor_names=tuple(p.name for p in procs),
        selector=sel.name,
        stream_transport=cast(Transport[Iterator[Delta]],
                              registry.create("transport", "inprocess", context)),
        async_transport=cast(Transport[AsyncIterator[Delta]],
                             resolve(registry, "transport", async_transport, context)),
        tool_parser=choose_parser(registry, context, tool_parser, chat),
        request_checks=tuple(p for p in procs if isinstance(p, RequestCheck)),
    )
    model_backend = _backend(registry, context, backend)
    if model_backend is not None:
        _check_honours(model_backend, backend, name, backend_options)
    context = attrs.evolve(context, backend=model_backend, load_model=load_backend)
    make_strategy = (_as_maker(given) if given is not None
                     else cast(StrategyMaker, registry.create("strategy", name, context)))
    eng = None
    if model_backend is not None:
        if tok is None:
            raise ArtifactError("a backend needs a tokenizer: pass tokenizer= or a model folder")
        by_name = {p.name: p for p in procs}

        def strategies(order: tuple[str, ...] | None) -> Strategy:
            if given is not None and order is not None:
                raise InvalidValueError("processor_order", list(order), "this pipeline's "
                                        "strategy was given as an instance with its own chain; "
                                        "build(strategy=<name>) to reorder processors")
            chain = procs if order is None else [by_name[n] for n in order]
            made = make_strategy(chain, sel)
            if not isinstance(getattr(made, "honours", None), Honours):
                raise RegistryError(f"strategy {name!r} does not say which request controls it "
                                    "keeps: give it an `honours` attribute (pipeline.Honours)")
            return made

        eng = ThreadEngine(model_backend, strategies, engine, decodable_vocab=tok.vocab_size)
    where = model_dir or model_file
    sampling = for_build(context, defaults)  # the model's recommendation, else the default
    return Pipeline(stages, eng, sinks=sinks, defaults=sampling.config,
                    defaults_source=sampling.source,
                    description={"model": str(where) if where else None,
                                 "strategy": name}, registry=registry)


def _check_honours(backend: Backend, named: str | Backend | None, strategy: str,
                   options: BackendOptions) -> None:
    """Refuse what the backend does not honour (:class:`~pipeline.contracts.model.BackendHonours`),
    naming it: ``batch_invariant=True``, the speculative strategy (draft verification), an
    iterative one (block attention; a continuous strategy checks embedding inputs itself)."""
    honours = backend_honours(backend)
    label = named if isinstance(named, str) else type(backend).__name__
    asked: list[tuple[str, object]] = []
    if options.batch_invariant:
        asked.append(("batch_invariance", True))
    if strategy == "speculative":
        asked.append(("draft_verification", strategy))
    elif strategy not in AUTOREGRESSIVE_STRATEGIES:
        asked.append(("block_attention", strategy))
    for capability, value in asked:
        refusal = honours.refusal(capability, label, value)
        if refusal is not None:
            raise refusal


def _as_maker(given: Strategy) -> StrategyMaker:
    """A strategy given as an instance: it serves the default order only (its chain is its
    own), so a request that reorders processors is refused, naming the field."""
    def make(chain: Sequence[LogitProcessor], selector: Selector) -> Strategy:
        return given
    return make


def _strategy(model_dir: Path | None, strategy: str | None, steps: int | None,
              block_length: int | None, options: Mapping[str, Any], instance: bool = False
              ) -> tuple[str, Mapping[str, Any]]:
    """The strategy's name (the model marker's when none is given) and its options, with
    ``steps`` and ``block_length`` folded in; an autoregressive strategy on a model marked
    otherwise, or iterative settings for an autoregressive strategy, is refused."""
    marker = generation_marker(model_dir)
    if strategy is None:
        strategy = str(marker.get("strategy")) if marker is not None else "autoregressive"
    if not isinstance(strategy, str):
        raise InvalidValueError("strategy", strategy, "must be a strategy's name")
    if instance:  # a Strategy instance: nothing to fold in, and it is the caller's choice
        return strategy, {}
    if marker is not None and strategy in AUTOREGRESSIVE_STRATEGIES:
        raise InvalidValueError("strategy", strategy, f"needs an autoregressive model; this "
                                f"one is a {marker['family']!r} model ({GENERATION_KEY} in "
                                f"its config.json: use strategy={marker.get('strategy')!r})")
    given = {k: v for k, v in (("steps", steps), ("block_length", block_length))
             if v is not None}
    if given and strategy in AUTOREGRESSIVE_STRATEGIES:
        raise InvalidValueError(", ".join(given), list(given.values()), "steps and "
                                "block_length configure iterative strategies (diffusion, flow); "
                                f"{strategy!r} takes neither")
    for key in given:
        if key in options:
            raise InvalidValueError(key, given[key], f"given twice: as build({key}=...) and "
                                    "in strategy_options")
    return strategy, {**options, **given}


def _chain_of(what: str, defaults: Sequence[str], given: Sequence[T] | None, replace: bool, *,
             before: str | None = None) -> list[str | T]:
    """The stages of a chain: ``given`` alone when ``replace``, else the ``defaults`` with
    ``given`` (None: nothing) inserted before the default named ``before`` (None: at the end)."""
    if given is None:
        if replace:
            raise InvalidValueError(f"replace_{what}", True, f"needs {what}=[...] to replace "
                                    "the default chain with")
        return list(defaults)
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise InvalidValueError(what, given, "must be a list of names or instances")
    if replace:
        return list(given)
    at = defaults.index(before) if before is not None else len(defaults)
    return [*defaults[:at], *given, *defaults[at:]]


def _unique(what: str, names: Sequence[str], replace: bool) -> None:
    """Every name once: a repeat is a mistake, and adding a built-in the default chain already
    has usually means a list written to replace the chain (so say how)."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if not repeated:
        return
    hint = "" if replace else (
        f"; {what}= adds to the default chain, which already has it (pass "
        f"replace_{what}=True to give the whole chain)")
    raise InvalidValueError(what, repeated, f"each name may appear once{hint}")


def load_backend(model: str | Path, *,
                 options: BackendOptions | Mapping[str, Any] | None = None,
                 plugins: Sequence[object] = ()) -> tuple[Backend, Tokenizer]:
    """The model backend and tokenizer of ``model``, resolved as :func:`build` resolves them
    (``options`` as there), without a pipeline or an engine: e.g. a speculative strategy's
    draft model. Raises :class:`~pipeline.errors.ArtifactError` when ``model`` has no
    weights or no tokenizer."""
    registry = Registry(plugins)
    found = resolve_model(model)
    if found.file is not None and not is_gguf_file(found.file):
        raise InvalidValueError("model", str(model), "a model file must be a GGUF file")
    context = BuildContext(model_dir=found.directory, options=BackendOptions.coerce(options),
                           model_file=found.file)
    tok = tokenizer_stage(registry, context, None)
    model_backend = _backend(registry, attrs.evolve(context, tokenizer=tok), None)
    if tok is None or model_backend is None:
        raise ArtifactError(f"{model}: a model needs weights and a tokenizer "
                            f"({'no weights' if model_backend is None else 'no tokenizer'})")
    return model_backend, tok


def _mapping(what: str, value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidValueError(what, value, "must be a mapping of option names to values")
    return dict(value)


def _backend(registry: Registry, context: BuildContext,
             value: str | Backend | None) -> Backend | None:
    if value is None:
        folder = context.model_dir
        if context.model_file is not None:
            value = "gguf"
        elif folder is None or not any((folder / f).exists() for f in WEIGHT_FILES):
            return None  # tokenizer-only pipeline: render and count, no generation
        else:
            value = "torch"
    chosen = value
    return cast(Backend, off_the_calling_thread(
        lambda: resolve(registry, "backend", chosen, context)))


R = TypeVar("R")


def off_the_calling_thread(make: Callable[[], R]) -> R:
    """``make()`` run on a thread of its own that ends with it; its exception re-raised here.

    A backend's load runs torch operations with several intra-op threads, and GNU OpenMP
    keeps a pool of workers for every thread that has done so. Once the caller's thread
    owns a pool, the engine thread's pool oversubscribes a machine with as many cores as
    torch threads, and GNU OpenMP then puts idle workers to sleep after about a hundred
    spins: every parallel operation of a decode step pays a wake-up (measured on 2 cores:
    one 3072 x 576 int4 product 46 us from a thread when the main thread has no pool, 100-150
    us when it has one; docs/performance.md). Loading on a passing thread leaves the
    caller's thread without a pool.
    """
    import threading

    box: list[R] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            box.append(make())
        except BaseException as exc:  # re-raised on the caller's thread below
            failure.append(exc)

    worker = threading.Thread(target=run, name="pipeline-load", daemon=True)
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return box[0]


def _with_device(options: BackendOptions, device: str | None,
                 dtype: str | None) -> BackendOptions:
    """``options`` with ``build``'s ``device=`` and ``dtype=`` shorthands laid over them; a
    field given both ways with different values is an error, never a silent choice."""
    given = {name: value for name, value in (("device", device), ("dtype", dtype))
             if value is not None}
    if not given:
        return options
    changed = BackendOptions.coerce({**attrs.asdict(options, recurse=False), **given})
    for name in given:
        before, after = getattr(options, name), getattr(changed, name)
        if before != after and before != getattr(BackendOptions(), name):
            raise InvalidValueError(name, given[name], f"options= already says {before!r}")
    return changed
