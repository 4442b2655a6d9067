"""The model side of the contracts: what a backend is called with and answers.

:class:`ModelCall` (one sequence's part of a forward pass, :class:`PrefillChunk`,
:class:`Attention`), the :class:`Backend` Protocol and its optional capabilities
(:class:`PagedBackend`, :class:`Embedder`, :class:`EmbeddingInputs`,
:class:`CacheInspector`, :class:`ModelDescriber` with :class:`ModelInfo`, :class:`LayerTaps`),
and what a backend does not honour (:class:`BackendHonours`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import attrs
import torch

from pipeline.errors import InvalidValueError

if TYPE_CHECKING:
    from pipeline.contracts.strategy import Plan

# --- model --------------------------------------------------------------------------------


@attrs.frozen
class PrefillChunk:
    """Prompt tokens ``token_ids`` for ``slot`` at positions ``start .. start+len-1``.

    ``start`` equals the slot's cache length before the call; the chunk is the last of its
    prompt when ``last`` is true (only then are its logits used). A convenience of the torch
    and scripted backends' ``prefill``; the engine speaks :class:`ModelCall`.
    """

    slot: int
    token_ids: tuple[int, ...]
    start: int
    last: bool


class Attention(enum.Enum):
    """How a call's new tokens attend (docs/design.md §6, second edition).

    ``CAUSAL``: each new token sees the cached prefix and the new tokens before it.
    ``BLOCK``: each new token sees the cached prefix and *every* new token of its call
    (bidirectional within the block over a causal prefix), as masked diffusion needs.
    """

    CAUSAL = "causal"
    BLOCK = "block"


def _block_table(value: Iterable[int] | None) -> tuple[int, ...] | None:
    """A block table as a tuple (None stays None)."""
    return None if value is None else tuple(value)


@attrs.frozen
class ModelCall:
    """One sequence's part of a :meth:`Backend.forward`.

    ``token_ids`` go at positions ``start .. start+len-1``; ``start`` must equal the slot's
    cache length before the call. ``outputs`` are the offsets into ``token_ids`` whose logits
    are wanted, ascending (a prefill chunk that is not its prompt's last wants none; a decode
    token wants ``(0,)``; verifying k drafts after a pending token wants ``range(k + 1)``).
    With ``write`` false the call reads the cache but leaves the slot's length as it was (its
    keys and values are never read again).

    ``blocks`` is the sequence's block table when the caller manages KV memory in blocks
    (:class:`PagedBackend`): block ``blocks[i]`` holds positions ``i*block_size ..
    (i+1)*block_size - 1``, and it covers at least ``start + len(token_ids)`` positions
    (``start`` for a call that does not write). None leaves memory to the backend.

    Continuous strategies (docs/design.md §10) feed embeddings instead of tokens: ``embeddings`` (a
    tensor ``[len(token_ids), d]`` on the model's device, in the backend's
    :meth:`EmbeddingInputs.embedding_space`) replaces the token embeddings of the call's
    positions, whose ``token_ids`` then only keep the length (placeholder ids); ``time`` (in
    [0, 1], the model family's time) and ``self_condition`` (the previous x0 estimate,
    ``[len(token_ids), d]``) condition a model that was trained with them
    (:class:`EmbeddingInputs`). All three default to None: a plain call.

    ``prompt`` marks a prompt chunk (:meth:`chunk` sets it): a batch-invariant backend computes
    a prompt position the same way whichever chunk it arrives in (whole, cut by the token
    budget, or after a prefix-cache hit), as it computes a decode token the same way in any
    batch.

    Example::

        ModelCall(slot, (y_t,), start=m + t - 1, outputs=(0,))        # a decode step
        ModelCall(slot, tuple(chunk), start=0, outputs=())             # a non-final chunk
        ModelCall(slot, (y_t,), m + t - 1, (0,), blocks=kv.table(seq)) # paged decode step
        ModelCall(slot, (0,) * 16, n, tuple(range(16)), Attention.BLOCK, write=False,
                  embeddings=x_t, time=0.7)                            # a denoising pass
    """

    slot: int
    token_ids: tuple[int, ...]
    start: int
    outputs: tuple[int, ...]
    attention: Attention = Attention.CAUSAL
    write: bool = True
    blocks: tuple[int, ...] | None = attrs.field(default=None, converter=_block_table)
    embeddings: torch.Tensor | None = attrs.field(default=None, eq=False)
    time: float | None = None
    self_condition: torch.Tensor | None = attrs.field(default=None, eq=False)
    prompt: bool = False

    @classmethod
    def chunk(cls, chunk: PrefillChunk, blocks: Sequence[int] | None = None) -> ModelCall:
        """The call for a prefill chunk: logits at its last token when it ends its prompt
        (``blocks``: the sequence's block table, when the caller manages KV memory)."""
        return cls(chunk.slot, chunk.token_ids, chunk.start,
                   (len(chunk.token_ids) - 1,) if chunk.last else (), blocks=blocks,
                   prompt=True)

    @classmethod
    def planned(cls, slot: int, start: int, plan: Plan,
                blocks: Sequence[int] | None = None) -> ModelCall:
        """The call for a strategy's :class:`Plan`, placed in the cache: at ``slot``, after
        its ``start`` cached positions, with ``blocks`` its block table (None: the backend
        keeps its memory). Every field the plan has, the call takes as it is."""
        return cls(slot, plan.token_ids, start, plan.outputs, plan.attention, plan.write,
                   blocks, embeddings=plan.embeddings, time=plan.time,
                   self_condition=plan.self_condition)


def split_outputs(calls: Sequence[ModelCall], logits: torch.Tensor) -> list[torch.Tensor]:
    """Each call's rows of a forward's ``[N, V]`` logits (``[len(outputs), V]`` each)."""
    out, at = [], 0
    for call in calls:
        n = len(call.outputs)
        out.append(logits[at:at + n])
        at += n
    return out


@runtime_checkable
class Backend(Protocol):
    """A model that keeps a KV cache per slot and computes logits (docs/design.md §4, §6).

    Lifecycle: ``allocate`` a slot per request; ``forward`` batches of :class:`ModelCall`
    (prompt chunks, decode tokens, draft verification, denoising passes of a block: all one
    shape, one batched call per engine step); ``truncate`` a slot to roll back positions it
    no longer wants (rejected drafts); ``release``. Step order (docs/design.md §4): after the prompt
    of m tokens the slot's cache length is m; a call writing y_t makes it m+t and its logits
    are z_{t+1}. Every layer's keys and values cover the same positions.

    ``forward`` returns float32 logits ``[N, V]``: the wanted outputs of every call, in call
    order then offset order (:func:`split_outputs` slices them). Calls come from one thread
    (the engine's). On failure raise :class:`~pipeline.errors.SlotError` naming the slots at
    fault when the other rows' caches are intact; any other exception fails every request in
    the call. :class:`~pipeline.errors.CapacityError` from ``allocate`` means "no free slot".

    Example::

        slot = backend.allocate()
        z1 = backend.forward([ModelCall(slot, ids, 0, (len(ids) - 1,))])[0]   # cache m
        y1 = int(z1.argmax())
        z2 = backend.forward([ModelCall(slot, (y1,), len(ids), (0,))])[0]     # cache m+1
        backend.release(slot)
    """

    vocab_size: int
    num_slots: int
    max_context: int
    snapshot: str

    def allocate(self) -> int:
        """Reserve a free slot with an empty cache."""
        ...

    def release(self, slot: int) -> None:
        """Free ``slot`` and its cache."""
        ...

    def cache_length(self, slot: int) -> int:
        """Positions the slot's cache covers now."""
        ...

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """Run every call as one batch; logits ``[N, V]`` at the wanted outputs."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """Shrink ``slot``'s cache to its first ``length`` positions (never grows it)."""
        ...


@runtime_checkable
class EmbeddingInputs(Protocol):
    """Optional backend capability: calls that feed embeddings (:attr:`ModelCall.embeddings`),
    for continuous diffusion and flow strategies (docs/design.md §10).

    ``embedding_space()`` is the ``[V, d]`` float32 table of every token's embedding in the
    space calls' embeddings live in (on the model's device; the same tensor on every call,
    not to be modified); x0 estimates are mixtures of its rows and rounding finds the
    nearest one. ``time_conditioned`` / ``self_conditioned`` say whether the model reads a
    call's ``time`` / ``self_condition``; a call that gives one the model does not read is
    refused with :class:`~pipeline.errors.SlotError`.

    Example::

        space = backend.embedding_space()                          # [V, d]
        x0_hat = logits.softmax(-1) @ space                         # [L, d]
    """

    @property
    def embedding_dim(self) -> int:
        """d, the width of embedding inputs."""
        ...

    @property
    def time_conditioned(self) -> bool:
        """Whether the model reads a call's ``time``."""
        ...

    @property
    def self_conditioned(self) -> bool:
        """Whether the model reads a call's ``self_condition``."""
        ...

    def embedding_space(self) -> torch.Tensor:
        """Every token's embedding ``[V, d]`` in the space of embedding inputs."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """Optional backend capability: the model's final hidden states of a token sequence,
    for embeddings (``POST /v1/embeddings``).

    ``hidden_states(token_ids)`` runs the model over ``token_ids`` as one causal sequence from
    position 0 and returns its last layer's output after the final norm, before the output
    head: ``[T, hidden_size]`` float32, one row per token. It writes no KV cache and touches
    no slot, so it never disturbs a request in flight; like every backend call it must come
    from the engine's thread (the model's scratch state is shared with ``forward``), e.g.
    through :meth:`~pipeline.engine.api.EngineAPI.call`. Raises
    :class:`~pipeline.errors.InvalidValueError` for an empty sequence, one longer than
    ``max_context``, or an id outside the vocabulary.

    Example::

        future = engine.call(lambda: backend.hidden_states(ids))
        states = future.result()                                  # [len(ids), hidden_size]
        vector = torch.nn.functional.normalize(states.mean(0), dim=0)
    """

    hidden_size: int

    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The final hidden states ``[T, hidden_size]`` (float32) of ``token_ids``."""
        ...


@runtime_checkable
class PagedBackend(Protocol):
    """Optional backend capability: KV memory in ``num_blocks`` blocks of ``block_size``
    positions whose block tables the caller owns (docs/design.md §6, second edition).

    The caller (the engine) keeps a :class:`~pipeline.engine.blocks.BlockManager` of the same shape
    and passes each sequence's table in :attr:`ModelCall.blocks`; the backend reads and writes
    exactly those blocks and allocates none. Slots still name sequences and carry their
    lengths (``allocate``, ``cache_length``, ``truncate`` and ``release`` work as for any
    :class:`Backend`), with one addition: a call to an empty slot may start at a multiple of
    ``block_size`` when the first blocks of its table hold those positions already (a
    prefix-cache hit); the slot's length becomes ``start + len(token_ids)``. The caller must
    not let two calls of one ``forward`` write a block that another call of it reads, and
    must not write a block another sequence shares (the manager's rules ensure both). A
    backend without this capability keeps the slot API, and the engine leaves memory to it.
    Raises :class:`~pipeline.errors.SlotError` naming the calls whose tables are malformed
    (a block outside ``0..num_blocks-1``, repeated, too few for the positions, written by
    one call and held by another).

    Example::

        kv = BlockManager(backend.num_blocks, backend.block_size, snapshot=backend.snapshot)
        slot, hit = backend.allocate(), kv.match(prompt)
        table = kv.allocate(slot, len(prompt), prefix=hit)
        todo = prompt[hit.cached_tokens:]
        backend.forward([ModelCall(slot, todo, hit.cached_tokens, (len(todo) - 1,), blocks=table)])
    """

    block_size: int
    num_blocks: int

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """As :meth:`Backend.forward`, reading and writing the blocks each call names."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """As :meth:`Backend.truncate` (the caller frees the blocks it no longer needs)."""
        ...



@attrs.frozen
class CacheLayout:
    """Per-layer key and value lengths of one slot's cache (docs/design.md §8, invariant 2)."""

    key_lengths: tuple[int, ...]
    value_lengths: tuple[int, ...]


@runtime_checkable
class CacheInspector(Protocol):
    """Optional backend capability: report each layer's key and value lengths for a slot.

    A backend that has it gets those lengths recorded in ``prefill.completed`` and
    ``decode.completed``, so ``pipeline trace check`` can verify invariant 2 layer by layer;
    without it the trace records the one logical length ``cache_length`` gives.

    Example::

        layout = backend.cache_layout(slot)      # CacheLayout((7, 7), (7, 7))
    """

    def cache_layout(self, slot: int) -> CacheLayout:
        """The lengths of every layer's keys and values in ``slot``'s cache."""
        ...


@attrs.frozen
class ModelInfo:
    """What a loaded model is, for logs and listings (``pipeline serve``, ``pipeline chat``).

    ``architecture`` is the checkpoint's class name (``Qwen3ForCausalLM``); ``parameters``
    counts every weight once (a tied output head is the embedding); ``dtype`` and ``device``
    are the weights' (``bfloat16``, ``cpu``). ``weight_bytes`` is the memory the weights hold,
    quantized ones at their encoded size; ``packed_bytes`` the extra copies laid out for
    faster products; ``cache_bytes`` the preallocated key/value cache of every slot;
    ``threads`` how the model's CPU threads are set (``"2"``: fixed by the ``threads`` option;
    ``"1-2 by measuring"``: chosen per decode step; None: not said).
    """

    architecture: str
    parameters: int
    dtype: str
    device: str
    weight_bytes: int
    packed_bytes: int = 0
    cache_bytes: int = 0
    threads: str | None = None

    def summary(self) -> str:
        """``Qwen3MoeForCausalLM, 6.35M parameters, bfloat16 on cpu``."""
        return (f"{self.architecture}, {human_count(self.parameters)} parameters, "
                f"{self.dtype} on {self.device}")


def human_count(n: int) -> str:
    """``6348864`` → ``6.35M``; ``134515008`` → ``135M``; ``7615616512`` → ``7.62B``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def human_bytes(n: int) -> str:
    """``12697728`` → ``12.1 MiB`` (binary units, one decimal; below 1 KiB: ``512 B``)."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@runtime_checkable
class ModelDescriber(Protocol):
    """Optional backend capability: say what model it runs (:class:`ModelInfo`).

    Called from any thread after the backend is built; the answer does not change while the
    backend lives. :meth:`Pipeline.model_info <pipeline.pipe.Pipeline.model_info>` returns
    ``None`` for a backend without it.

    Example::

        info = backend.model_info()    # ModelInfo('LlamaForCausalLM', 134515008, ...)
    """

    def model_info(self) -> ModelInfo:
        """The model's architecture, size, dtype, device and memory."""
        ...




@attrs.frozen
class BackendHonours:
    """What a backend can do beyond the plain :class:`Backend` calls (its capability model,
    as :class:`~pipeline.contracts.strategy.Honours` is a strategy's).

    ``batch_invariance``: a row's logits never depend on the rest of its batch
    (``BackendOptions.batch_invariant``); ``draft_verification``: several positions scored in
    one call and rolled back by :meth:`Backend.truncate` exactly as decoding them one at a
    time would score them (the speculative strategy); ``prefix_sharing``: KV blocks shared
    between requests (:class:`PagedBackend`, the prefix cache); ``block_attention``:
    :attr:`Attention.BLOCK` calls (masked diffusion); ``embedding_inputs``: calls that feed
    embeddings (:class:`EmbeddingInputs`). A backend without an ``honours`` attribute honours
    all of them. The builder refuses a build that asks for one the backend lacks, naming it
    (:meth:`refusal`), rather than run without it.

    Example::

        BackendHonours.ALL.refusal("batch_invariance", "transformers")   # None
        BackendHonours(batch_invariance=False).refusal("batch_invariance", "transformers")
        # InvalidValueError: batch_invariant ... the transformers backend does not ...
    """

    batch_invariance: bool = True
    draft_verification: bool = True
    prefix_sharing: bool = True
    block_attention: bool = True
    embedding_inputs: bool = True

    ALL: ClassVar[BackendHonours]

    SETTINGS: ClassVar[dict[str, tuple[str, str]]] = {
        "batch_invariance": ("batch_invariant", "keep a row's logits independent of its batch"),
        "draft_verification": ("strategy", "verify speculative drafts"),
        "prefix_sharing": ("prefix_cache", "share KV blocks between requests"),
        "block_attention": ("strategy", "attend bidirectionally within a block (diffusion)"),
        "embedding_inputs": ("strategy", "take embeddings as inputs (continuous diffusion)"),
    }
    """Each capability's setting (the field an error names) and what it means."""

    def refusal(self, capability: str, backend: str, value: object = True
                ) -> InvalidValueError | None:
        """The error for asking ``backend`` for ``capability`` (one of this class's fields)
        when it lacks it; None when it has it."""
        if getattr(self, capability):
            return None
        field, means = self.SETTINGS[capability]
        return InvalidValueError(field, value, f"the {backend} backend cannot {means}; "
                                 "use the torch backend for it")

    def lacking(self) -> tuple[str, ...]:
        """The capabilities this backend does not have, in field order."""
        return tuple(f.name for f in attrs.fields(BackendHonours) if not getattr(self, f.name))


BackendHonours.ALL = BackendHonours()


def backend_honours(backend: object) -> BackendHonours:
    """``backend.honours``, or :attr:`BackendHonours.ALL` for a backend that says nothing."""
    honours = getattr(backend, "honours", None)
    return honours if isinstance(honours, BackendHonours) else BackendHonours.ALL


Tap = Callable[[int, str, torch.Tensor], None]
"""A layer tap's receiver: ``(call, name, hidden)``, with ``call`` the index of the
:class:`ModelCall` in the forward's list, ``name`` the tap's (:meth:`LayerTaps.tap_names`)
and ``hidden`` its states at the call's positions, ``[len(call.token_ids), H]`` in the model's
activation dtype. Valid only during the call: a receiver that keeps one copies it."""


@runtime_checkable
class LayerTaps(Protocol):
    """Optional backend capability: hand each layer's hidden states to a receiver as a forward
    computes them (``pipeline compare``, traces with layer taps; docs/tracing.md).

    ``tap_names()`` lists the taps in the order a forward reaches them: ``embed`` (the
    token embeddings the first layer reads), then for each layer ``i``:
    ``layers.i.attention`` (the attention block's output, before the residual sum),
    ``layers.i.mlp`` (the MLP's or the experts' output, before the residual sum) and
    ``layers.i`` (the residual stream after the layer). Backends of one architecture name
    the same tensor the same way, so two backends' taps compare name by name.
    ``set_tap(receiver)`` turns the taps on for every later forward (None turns them off:
    a forward then costs what it cost without the capability). Calls come from the engine's
    thread, like ``forward``.

    Example::

        seen = {}
        backend.set_tap(lambda call, name, h: seen.setdefault(name, h.float().clone()))
        backend.forward([ModelCall(slot, ids, 0, (len(ids) - 1,))])
        backend.set_tap(None)
        seen["layers.0.attention"].shape                  # (len(ids), hidden_size)
    """

    def tap_names(self) -> tuple[str, ...]:
        """Every tap's name, in the order a forward reaches them."""
        ...

    def set_tap(self, tap: Tap | None) -> None:
        """Send later forwards' hidden states to ``tap`` (None: stop)."""
        ...


def has_taps(backend: object) -> bool:
    """Whether ``backend`` has :class:`LayerTaps` and names at least one tap."""
    return isinstance(backend, LayerTaps) and bool(backend.tap_names())


def tap_names(num_layers: int) -> tuple[str, ...]:
    """The names :class:`LayerTaps` uses for a model of ``num_layers`` layers."""
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.attention", f"layers.{i}.mlp", f"layers.{i}"]
    return tuple(names)
