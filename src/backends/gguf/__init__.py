"""Reading GGUF files (llama.cpp's model format) for the torch backend.

Modules: :mod:`.quants` (dequantizing GGML tensor data in torch, and linears over weights kept
quantized in memory).
"""
