"""The typed keywords of ``Pipeline.generate``, ``stream``, ``astream`` and ``submit``.

:class:`RequestOptions` names every keyword those methods accept, with its type, so a type
checker and an editor know them (``pipe.generate("hi", max_tokens=20, temperature=0)``) and a
misspelt one is an error before the program runs, as it is at run time
(:class:`~pipeline.errors.UnknownFieldError`). The values are checked at run time by
:class:`~pipeline.contracts.request.GenerationConfig` and :meth:`~pipeline.pipe.Pipeline.request`, which
own their meaning; this module owns only their names and types, and a test keeps it equal to
those two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from pipeline.grammar import Grammar
    from pipeline.contracts.request import Recording, RuntimeLimits, TapWindow, ToolChoice, ToolSpec


class RequestOptions(TypedDict, total=False):
    """Keywords of a request: :class:`~pipeline.contracts.request.GenerationConfig`'s fields (laid over
    the pipeline's defaults) and :meth:`~pipeline.pipe.Pipeline.request`'s own. Every key is
    optional."""

    # GenerationConfig: sampling, truncation, penalties, endings, output detail, control
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    logit_bias: Mapping[int, float]
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    min_tokens: int
    ignore_eos: bool
    seed: int | None
    logprobs: bool
    top_logprobs: int
    banned_token_ids: Sequence[int]
    allowed_token_ids: Sequence[int] | None
    processor_order: Sequence[str] | None
    reasoning_budget_tokens: int | None
    forced_prefix: Sequence[int]
    grammar: Grammar | str | None
    # Pipeline.request: limits, tools, identity, recording, template, structured output
    limits: RuntimeLimits | None
    tools: Sequence[ToolSpec | Mapping[str, Any]] | None
    request_id: str | None
    recording: Recording | str | None
    tap_tensors: TapWindow | str | Mapping[str, int] | None
    template_kwargs: Mapping[str, Any] | None
    json_schema: Mapping[str, Any] | bool | None
    json_object: bool
    regex: str | None
    choice: Sequence[str] | None
    tool_choice: ToolChoice | str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None
