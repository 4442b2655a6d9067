"""A GGUF file's chat template as a renderer.

Owns :func:`gguf_renderer`: the template llama.cpp stores as ``tokenizer.chat_template`` (or
``tokenizer.chat_template.<name>``), run by the same :class:`HFChatTemplateRenderer` as a
Hugging Face folder's, with the file's named special tokens as template variables and every
special token's text protected in caller text. The metadata is read by
:mod:`stages.tokenize.gguf` (the named tokens as tokenizer_config spells them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.errors import TemplateError
from stages.render.hf_template import HFChatTemplateRenderer, named_special_tokens
from stages.tokenize.gguf import (CHAT_TEMPLATE, chat_template, special_token_strings,
                                  tokenizer_config)


def gguf_renderer(metadata: Mapping[str, Any], source: str, *,
                  template_name: str | None = None) -> HFChatTemplateRenderer:
    """An :class:`HFChatTemplateRenderer` over the file's chat template, with its named special
    tokens as template variables and every special token's text protected in caller text.

    ``template_name`` picks ``tokenizer.chat_template.<name>`` instead of the default
    ``tokenizer.chat_template``. A file without that template raises TemplateError naming
    ``source`` and the field (a model without a template wants the plain renderer instead);
    a malformed vocabulary raises TokenizerError.
    """
    template = chat_template(metadata, source, template_name)
    if template is None:
        key = CHAT_TEMPLATE if template_name is None else f"{CHAT_TEMPLATE}.{template_name}"
        raise TemplateError(f"{source}: no chat template: GGUF field {key} is missing")
    strings = special_token_strings(metadata, source)
    named = named_special_tokens(tokenizer_config(metadata, source))
    return HFChatTemplateRenderer(
        template, special_tokens=named, special_token_strings=[*strings, *named.values()],
        name="gguf_chat_template" + (f":{template_name}" if template_name else ""))
