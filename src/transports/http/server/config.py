"""Server settings: which models to serve, how each generates, and the gateway's limits, as
one value.

Owns :class:`ServerConfig` (each served model's strategy among them) and
:func:`load_api_keys` (keys from an environment variable and/or a file, one per line or
comma-separated).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.options import BackendOptions, device_name, dtype_name
from pipeline.strategy_choice import StrategyChoice
from pipeline.contracts.request import DEFAULT_MAX_TOKENS
from transports.http.server.limits import Limits
from transports.http.server.timeouts import Timeouts


def _positive(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidValueError(attribute.name, value, "must be an integer >= 1")


def _non_negative(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidValueError(attribute.name, value, "must be an integer >= 0")


def _seconds_or_none(meaning_of_none: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """A validator of a duration in (0, 86400] seconds, or None (``meaning_of_none``)."""
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 86400):
            raise InvalidValueError(attribute.name, value, "must be in (0, 86400] seconds, or "
                                    f"None ({meaning_of_none})")
    return check


def _models(value: Any) -> Mapping[str, Path | None]:
    if not isinstance(value, Mapping) or not value:
        raise InvalidValueError("models", value, "serve at least one model (name -> folder)")
    return MappingProxyType({str(k): (Path(v) if v is not None else None)
                             for k, v in value.items()})


def _strategies(value: Any) -> Mapping[str, StrategyChoice]:
    if not isinstance(value, Mapping):
        raise InvalidValueError("strategies", value, "must map served names to a "
                                "StrategyChoice")
    for name, choice in value.items():
        if not isinstance(choice, StrategyChoice):
            raise InvalidValueError(f"strategies[{name!r}]", choice, "must be a StrategyChoice")
    return MappingProxyType(dict(value))


def _keys(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


@attrs.frozen
class ServerConfig:
    """What a server serves and the limits of its gateway.

    ``models`` maps a served name to a model (a folder, a GGUF file, a name or a cached repo
    id; ``None``: the default model, SmolLM2-135M-Instruct). ``strategies`` maps a served
    name to the :class:`~pipeline.strategy_choice.StrategyChoice` it is built with (a name
    missing from it gets the model's own strategy: autoregressive, or its
    ``pipeline_generation`` marker's); :meth:`strategy` is a model's choice.
    ``api_keys`` empty means no authentication. Per model, at most ``num_slots`` requests run
    and ``max_queue`` more wait; beyond that a request is refused as overloaded. ``max_context``
    caps each model's window (``None``: the model's own); ``context_slack`` tokens of it are
    kept free. A ``max_tokens`` larger than the room left is clamped when ``clamp_max_tokens``,
    else refused; a request without one gets ``min(room, default_max_tokens)``. The thinking
    guard: a request that states no thinking preference (no Anthropic ``thinking``, no
    ``reasoning_effort``) and no reasoning budget, to a model that can think and a strategy
    that keeps a budget, gets a budget that leaves its answer ``min(answer_reserve_tokens,
    max_tokens // 3)`` tokens beside the two think markers, so it never ends thinking with no
    answer; a server-wide
    ``reasoning_budget_tokens`` is a stated budget for every request instead.

    ``limits`` bounds what one request may ask for (:mod:`transports.http.server.limits`);
    ``timeouts`` how long its headers and body may take to arrive (408 and close).
    ``device`` and ``dtype`` are the models' torch device and compute dtype (None: each
    model's own), checked as :class:`~pipeline.options.BackendOptions` checks them (as is
    ``kv_cache_dtype``, ``"int8"`` for an int8 KV cache, and ``expert_cache_bytes`` with
    ``expert_cache_policy``, a memory cap for MoE models' routed experts);
    :meth:`backend_options` is the value the models are built with, and ``backend`` the
    backend they are built on (None: each model's own, torch for a folder and gguf for a
    GGUF file; ``"transformers"`` runs any causal LM transformers loads).
    Request-side work (parsing, rendering, counting) runs on ``work_threads`` threads with at
    most ``work_queue`` more waiting. When a model's engine loop stops after an internal
    error, a fresh engine is started ``restart_delay_s`` later (503 meanwhile).
    The traces of the last ``keep_traces`` finished requests are kept in memory for
    ``GET /traces/{request_id}`` (:mod:`transports.http.accounting.traces`; 0 keeps none).
    An engine step that runs longer than ``stall_timeout_s`` (None: never checked) is a
    stall: ``/health`` says so, its requests fail with a 503 and the engine is replaced as a
    dead one is. A response waits at most ``usage_wait_s`` for its usage record to be durable
    (:mod:`transports.http.accounting.usage`: a record the database will not take is kept and retried).
    ``request_deadline_s`` (None: none) ends a request that has run that long since it was
    accepted, queueing included, with what it wrote so far (``finish_reason`` ``length``).
    ``max_queue_wait_s`` (None: no bound) fails a request that waited that long in its
    model's queue without getting a slot: the client gets its dialect's overload error
    (OpenAI 503, Anthropic 529; a stream's error event), as if it had been refused at once.
    ``usage_database`` (a ``postgresql://`` URL; None: SQLite in ``data_dir``) is where usage
    records go, a database that replicas share (:mod:`transports.http.accounting.usage_postgres`).
    ``engine_process`` runs each model's engine (model and scheduler) in a child process the
    server starts and watches (:mod:`pipeline.runtime.parent`): a native crash, the
    out-of-memory killer or a stalled step then ends that process, not the server; its requests
    fail at once with an error event and a ``failed`` usage record, ``/health`` says
    ``restarting``, and a fresh process takes over ``restart_delay_s`` later (a stalled
    step's process is killed). ``ranks`` above 1 (one model served; implies
    ``engine_process``) makes that process rank 0 of a parallel group of ``ranks``
    processes splitting the model (:mod:`pipeline.runtime.ranks`): a lost rank ends the
    group, its requests fail with a retryable error, ``/health`` says ``restarting``, and a
    whole fresh group takes over. ``release_idle_memory`` hands malloc's free pages back to
    the system when the engines fall idle after work
    (:func:`~pipeline.process_memory.release_free_memory`).
    """

    models: Mapping[str, Path | None] = attrs.field(converter=_models, eq=False)
    strategies: Mapping[str, StrategyChoice] = attrs.field(factory=dict, converter=_strategies,
                                                           eq=False)
    api_keys: frozenset[str] = attrs.field(default=frozenset(), converter=_keys, repr=False)
    data_dir: Path = attrs.field(default=Path("pipeline-data"), converter=Path)
    num_slots: int = attrs.field(default=8, validator=_positive)
    max_queue: int = attrs.field(default=64, validator=_non_negative)
    max_context: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive))
    context_slack: int = attrs.field(default=0, validator=_non_negative)
    clamp_max_tokens: bool = True
    default_max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS, validator=_positive)
    reasoning_budget_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative))
    answer_reserve_tokens: int = attrs.field(default=4096, validator=_positive)
    ping_interval_s: float = 5.0
    limits: Limits = attrs.field(factory=Limits)
    timeouts: Timeouts = attrs.field(factory=Timeouts)
    device: str = attrs.field(default="cpu", converter=device_name)
    dtype: str | None = attrs.field(default=None, converter=dtype_name)
    batch_invariant: bool | None = None
    quantized: bool | None = None
    kv_cache_dtype: str | None = None
    expert_cache_bytes: int | None = None
    expert_cache_policy: str = "lfu"
    threads: int | None = None
    backend: str | None = None
    work_threads: int = attrs.field(default=4, validator=_positive)
    work_queue: int = attrs.field(default=64, validator=_non_negative)
    restart_delay_s: float = attrs.field(default=1.0)
    keep_traces: int = attrs.field(default=100, validator=_non_negative)
    stall_timeout_s: float | None = attrs.field(default=120.0,
                                                validator=_seconds_or_none("unchecked"))
    usage_wait_s: float = attrs.field(default=5.0)
    request_deadline_s: float | None = attrs.field(default=None,
                                                   validator=_seconds_or_none("no deadline"))
    max_queue_wait_s: float | None = attrs.field(default=60.0,
                                                 validator=_seconds_or_none("no bound"))
    release_idle_memory: bool = True
    engine_process: bool = False
    ranks: int = attrs.field(default=1, validator=_positive)
    usage_database: str | None = attrs.field(default=None, repr=False)  # may hold a password

    def __attrs_post_init__(self) -> None:
        self.backend_options()  # every backend field valid together, before any model loads
        if self.ranks > 1:
            if len(self.models) != 1:
                raise InvalidValueError("ranks", self.ranks, "a parallel group holds one "
                                        f"model: serve one (given: {', '.join(self.models)})")
            folder = next(iter(self.models.values()))
            if folder is None or not Path(folder).is_dir():
                raise InvalidValueError("ranks", self.ranks, "a parallel group splits a "
                                        "Hugging Face folder of safetensors weights; the "
                                        f"model {folder or 'default (a GGUF file)'} runs in "
                                        "one process")
        unknown = sorted(set(self.strategies) - set(self.models))
        if unknown:
            raise InvalidValueError("strategies", unknown, "no served model has that name "
                                    f"(served: {', '.join(self.models)})")

    def strategy(self, name: str) -> StrategyChoice:
        """The strategy the model served as ``name`` is built with (empty: its own)."""
        return self.strategies.get(name, StrategyChoice())

    def backend_options(self) -> BackendOptions:
        """The options every served model is built with (slots, window, device, dtype,
        quantization, batch invariance, the KV cache's dtype, the expert cap, the threads)."""
        return BackendOptions(num_slots=self.num_slots, max_context=self.max_context,
                              device=self.device, dtype=self.dtype, quantized=self.quantized,
                              batch_invariant=self.batch_invariant,
                              kv_cache_dtype=self.kv_cache_dtype,
                              expert_cache_bytes=self.expert_cache_bytes,
                              expert_cache_policy=self.expert_cache_policy,
                              threads=self.threads)

    @usage_database.validator
    def _usage_database(self, _: attrs.Attribute[str | None], value: str | None) -> None:
        if value is not None:
            from transports.http.accounting.usage_postgres import check_url

            check_url(value)

    @restart_delay_s.validator
    def _delay(self, _: attrs.Attribute[float], value: float) -> None:
        if not isinstance(value, (int, float)) or not 0 <= value < 3600:
            raise InvalidValueError("restart_delay_s", value, "must be in [0, 3600) seconds")

    @usage_wait_s.validator
    def _usage_wait(self, _: attrs.Attribute[float], value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 600:
            raise InvalidValueError("usage_wait_s", value, "must be in [0, 600] seconds")


def load_api_keys(env_var: str | None = "PIPELINE_API_KEYS",
                  path: str | Path | None = None) -> frozenset[str]:
    """Keys from ``$env_var`` (comma-separated) and from ``path`` (one per line; ``#`` comments)."""
    keys: set[str] = set()
    if env_var and os.environ.get(env_var):
        keys.update(k.strip() for k in os.environ[env_var].split(","))
    if path is not None:
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.add(line)
    keys.discard("")
    return frozenset(keys)
