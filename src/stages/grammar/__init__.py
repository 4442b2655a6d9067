"""Grammar-constrained decoding (docs/design.md §11) on llguidance.

Owns the ``grammar`` logit processor (:mod:`stages.grammar.processor`), the bitmask applied
to logits (:mod:`stages.grammar.bitmask`), the vocabulary handed to the engine
(:mod:`stages.grammar.vocab`) and the tool-call grammars (:mod:`stages.grammar.tools`). The
:class:`~pipeline.grammar.Grammar` value a request carries is in :mod:`pipeline.grammar`.
"""

from stages.grammar.processor import GrammarProcessor

__all__ = ["GrammarProcessor"]
