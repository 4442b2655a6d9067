"""Tokenizers: rendered prompts to token ids and back.

:class:`HFTokenizer` wraps a Hugging Face ``tokenizer.json``: control spans parse special
tokens, content spans do not, and ids match transformers' ``apply_chat_template``.
"""

from stages.tokenize.hf import HFTokenizer

__all__ = ["HFTokenizer"]
