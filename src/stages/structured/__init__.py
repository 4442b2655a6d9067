"""Structured output: grammar-constrained decoding (docs/design.md §11) on llguidance.

Owns the ``grammar`` logit processor (:mod:`stages.structured.processor`), the bitmask applied
to logits (:mod:`stages.structured.bitmask`) and the vocabulary handed to the engine
(:mod:`stages.structured.vocab`). The :class:`~pipeline.grammar.Grammar` value a request carries
is in :mod:`pipeline.grammar`, the tool-call grammars in :mod:`pipeline.tools.grammars`.
"""

from stages.structured.processor import GrammarProcessor

__all__ = ["GrammarProcessor"]
