"""GGUF model files: reading their metadata, tokenizer and chat template, and weights."""
