"""GGUF files (llama.cpp's model format, docs/design.md §13) on the torch backend.

Modules: :mod:`.file` (the ``gguf`` package's reader: metadata, tensor index, snapshot; the
metadata as ``config.json`` keys for ``ModelSpec``), :mod:`.load` (tensors → ``ModelWeights``,
dequantized at load or kept quantized), :mod:`.quants` (dequantizing GGML tensor data in
torch, and linears over weights kept quantized in memory), :mod:`.tokenizer` (the
``tokenizer.ggml.*`` metadata as a ``tokenizers`` tokenizer, and the chat template),
:mod:`.factories` (the ``gguf`` tokenizer, renderer and backend components).
"""
