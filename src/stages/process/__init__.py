"""Logit processors: the ordered chain between the model's logits and the selector.

Owns the built-in processors (masks and biases, penalties, temperature, truncation), the
:class:`ProcessorChain` that applies them in an explicit order, and the name table the plugin
registry exposes; ``DEFAULT_ORDER`` (from :mod:`pipeline.registry`) names the default chain.
Every processor satisfies :class:`pipeline.contracts.decode.LogitProcessor`: built with no
arguments, stateless, per-row parameters read from ``row.config``.
"""

from pipeline.registry import DEFAULT_ORDER
from stages.process.chain import PROCESSORS, ProcessorChain, make_processor
from stages.process.masks import AllowedTokens, BannedTokens, LogitBias, MinTokens
from stages.process.penalties import FrequencyPenalty, PresencePenalty, RepetitionPenalty
from stages.process.temperature import Temperature
from stages.process.truncation import MinP, TopK, TopP, TypicalP

__all__ = [
    "DEFAULT_ORDER", "PROCESSORS", "AllowedTokens", "BannedTokens", "FrequencyPenalty",
    "LogitBias", "MinP", "MinTokens", "PresencePenalty", "ProcessorChain", "RepetitionPenalty",
    "Temperature", "TopK", "TopP", "TypicalP", "make_processor",
]
