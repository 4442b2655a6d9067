"""Text-side stage implementations, one folder per stage family.

``render/`` (chat templates, plain text), ``tokenize/`` (tokenizers), ``process/`` (the logit
processor chain), ``select/`` (selectors and the autoregressive strategy), ``detokenize/``
(incremental detokenization), ``stop/`` (stoppers), ``tools/`` (tool-call parsers, one per
model family's format). ``plugin`` registers them all.
"""
