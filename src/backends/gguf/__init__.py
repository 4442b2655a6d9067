"""GGUF files' weights (llama.cpp's model format, docs/design.md §13) on the torch backend.

Modules: :mod:`.backend` (the metadata as ``config.json`` keys for ``ModelSpec``, and the
``gguf`` backend component), :mod:`.load` (tensors → ``ModelWeights``, dequantized at load or
kept quantized), :mod:`.quants` (dequantizing GGML tensor data in torch, and linears over
weights kept quantized in memory), :mod:`.int4` (torch's int4 kernel over kept-quantized
weights of every type whose groups map onto it). The file itself is read by :mod:`pipeline.gguf_file`; its tokenizer and chat
template are stages (:mod:`stages.gguf`).
"""
