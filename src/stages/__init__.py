"""Text-side stage implementations, one folder per stage family.

``render/`` (chat templates, plain text), ``tokenize/`` (tokenizers), ``process/`` (the logit
processor chain), ``select/`` (selectors and the autoregressive strategy), ``detokenize/``
(incremental detokenization), ``stop/`` (stoppers), ``structured/`` (the ``grammar`` processor:
grammar-constrained decoding). ``plugin`` registers them all, and the built-in tool-call parsers
of :mod:`pipeline.tools` (where reading calls and executing them both live); the grammar a
request carries is :mod:`pipeline.grammar`.
"""
