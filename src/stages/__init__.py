"""Text-side stage implementations, one folder per stage family.

``render/`` (chat templates, plain text), ``tokenize/`` (tokenizers), ``process/`` (the logit
processor chain), ``select/`` (selectors and the autoregressive strategy), ``detokenize/``
(incremental detokenization), ``stop/`` (stoppers), ``structured/`` (the ``grammar`` processor:
grammar-constrained decoding), ``toolcalls/`` (tool-call parsers, one per model family's
format). ``plugin`` registers them all. (The tool boundary, executing calls, is
:mod:`pipeline.tools`; the grammar a request carries is :mod:`pipeline.grammar`.)
"""
