"""The ``speculative`` strategy's options and its factory.

Owns :class:`SpeculativeConfig`, read from ``build(..., strategy="speculative",
strategy_options={...})``, and :func:`speculative_maker`, the registered factory: it
checks the options, loads a draft model once per build (sized by the target backend: one
draft slot per target slot), and returns the ``(processors, selector) -> strategy`` maker the
engine calls once per processor order. Options:

- ``proposer``: ``"ngram"`` (prompt lookup, the default) or ``"draft"`` (the default when a
  ``draft_model`` is given);
- ``num_draft_tokens``: k, the most drafts one step verifies (1..64, default 8);
- ``max_n`` / ``min_n``: the n-gram lengths prompt lookup tries, longest first (default 4/1);
- ``draft_model``: a model folder, GGUF file or name (as ``build`` takes) whose tokenizer is
  the target's, or a :class:`~pipeline.contracts.model.Backend` object (used as given);
- ``draft_options``: backend options for the draft model (``num_slots``, ``max_context``,
  ``dtype``, ``device``, ``pack``, ``quantized``, ``kv_cache_bytes``, ``kv_blocks``,
  ``block_size``); ``dtype``,
  ``device`` and ``pack`` default to the build's own.

Unknown names and values out of range are errors that name the option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.contracts.decode import LogitProcessor, Selector
from pipeline.contracts.model import Backend
from pipeline.registry import BuildContext
from pipeline.contracts.request import from_mapping
from stages.process.chain import ProcessorChain
from stages.strategies.draft import DraftModelProposer, vocabulary_mismatch
from stages.strategies.proposers import NgramProposer, Proposer
from stages.strategies.speculative import (
    DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SpeculativeStrategy,
)

PROPOSERS = ("ngram", "draft")
DRAFT_OPTIONS = ("num_slots", "max_context", "dtype", "device", "pack", "quantized",
                 "kv_cache_bytes", "kv_blocks", "block_size")
INHERITED = ("dtype", "device", "pack")
"""Backend options a draft model takes from the build's own unless ``draft_options`` says."""
MAX_N = 64


def _count(lo: int, hi: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise InvalidValueError(f"speculative.{attribute.name}", value,
                                    f"must be an integer in {lo}..{hi}")
    return check


def _draft_options(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidValueError("speculative.draft_options", value, "must be a mapping")
    for key in value:
        if key not in DRAFT_OPTIONS:
            raise UnknownFieldError("speculative.draft_options", str(key), DRAFT_OPTIONS)
    return dict(value)


@attrs.frozen
class SpeculativeConfig:
    """The speculative strategy's options (see the module docstring)."""

    proposer: str = attrs.field(default="ngram")
    num_draft_tokens: int = attrs.field(default=DEFAULT_DRAFT_TOKENS,
                                        validator=_count(1, MAX_DRAFT_TOKENS))
    max_n: int = attrs.field(default=4, validator=_count(1, MAX_N))
    min_n: int = attrs.field(default=1, validator=_count(1, MAX_N))
    draft_model: str | Path | Backend | None = attrs.field(default=None, eq=False)
    draft_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_draft_options,
                                                   eq=False)

    def __attrs_post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise InvalidValueError("speculative.proposer", self.proposer,
                                    f"must be one of {', '.join(PROPOSERS)}")
        if self.min_n > self.max_n:
            raise InvalidValueError("speculative.min_n", self.min_n,
                                    f"cannot exceed max_n={self.max_n}")
        if self.proposer == "draft" and self.draft_model is None:
            raise InvalidValueError("speculative.draft_model", None,
                                    "the draft proposer needs a draft_model")
        if self.proposer == "ngram" and self.draft_model is not None:
            raise InvalidValueError("speculative.draft_model", str(self.draft_model),
                                    "the ngram proposer takes no draft model")
        if self.draft_options and not isinstance(self.draft_model, (str, Path)):
            raise InvalidValueError("speculative.draft_options", dict(self.draft_options),
                                    "apply only to a draft_model given by name or path")

    @classmethod
    def from_options(cls, value: Any) -> SpeculativeConfig:
        """From ``build(strategy_options=...)``: None (defaults), a config, or a mapping."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidValueError("options.speculative", value,
                                    "must be a mapping of speculative options")
        data = dict(value)
        data.setdefault("proposer", "ngram" if data.get("draft_model") is None else "draft")
        return from_mapping(cls, data)


def speculative_maker(ctx: BuildContext
                      ) -> Callable[[Sequence[LogitProcessor], Selector], SpeculativeStrategy]:
    """The registered ``speculative`` factory: options checked and the draft model loaded
    now, at build time; strategies made per processor order."""
    config = SpeculativeConfig.from_options(ctx.strategy_options)
    target = ctx.backend
    decodable = ctx.tokenizer.vocab_size if ctx.tokenizer is not None else None
    draft = _draft_backend(config, ctx) if config.proposer == "draft" and target else None

    def make(processors: Sequence[LogitProcessor], selector: Selector) -> SpeculativeStrategy:
        chain = ProcessorChain(processors)
        proposer: Proposer
        if draft is None:
            proposer = NgramProposer(config.max_n, config.min_n)
        else:
            vocab = target.vocab_size if target is not None else draft.vocab_size
            proposer = DraftModelProposer(draft, chain, vocab, decodable)
        return SpeculativeStrategy(chain, selector, proposer, config.num_draft_tokens,
                                   None if target is None else target.max_context)

    return make


def _draft_backend(config: SpeculativeConfig, ctx: BuildContext) -> Backend:
    """The draft model's backend: loaded with one slot per target slot, its tokenizer
    checked against the target's; or the given backend object."""
    model = config.draft_model
    if not isinstance(model, (str, Path)):
        if not isinstance(model, Backend):
            raise InvalidValueError("speculative.draft_model", model,
                                    "must be a model folder, GGUF file or name, or a Backend")
        return model
    if ctx.load_model is None:
        raise InvalidValueError("speculative.draft_model", str(model),
                                "this build cannot load a second model")
    options: dict[str, Any] = {k: getattr(ctx.options, k) for k in INHERITED}
    if ctx.backend is not None:
        options["num_slots"] = ctx.backend.num_slots
    options.update(config.draft_options)
    backend, tokenizer = ctx.load_model(model, options=options)
    if ctx.tokenizer is not None:
        why = vocabulary_mismatch(ctx.tokenizer, tokenizer)
        if why is not None:
            raise InvalidValueError("speculative.draft_model", str(model),
                                    f"its tokenizer is not the target's: {why}")
    return backend
