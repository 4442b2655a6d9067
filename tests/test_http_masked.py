"""The HTTP server serving the masked-diffusion model, through both dialects, unchanged.

Oracles: the official ``openai`` and ``anthropic`` SDKs (they parse our bodies and SSE
streams), and the non-streamed answer for the streamed one.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from pipeline.model_paths import TINY_MASKED_MODEL_DIR
from tests.http_support import config, running
from transports.http import Gateway

KEY = "sk-test-key"
QUESTION = [{"role": "user", "content": "What is a Python list?"}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("masked"), api_keys={KEY},
                 models={"default": TINY_MASKED_MODEL_DIR})
    with running(Gateway(cfg)) as url:
        yield url


def test_openai_chat_streamed_and_not(base_url: str) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    args = dict(model="default", messages=QUESTION, max_tokens=16, temperature=0.8, seed=7,
                extra_body={"min_tokens": 16})
    whole = oai.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(oai.chat.completions.create(**args, stream=True,  # type: ignore[call-overload]
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage == whole.usage


def test_anthropic_messages_streamed_and_not(base_url: str) -> None:
    claude = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)
    args = dict(model="default", messages=QUESTION, max_tokens=16,
                extra_body={"temperature": 0.8, "seed": 3})
    whole = claude.messages.create(**args)  # type: ignore[call-overload]
    with claude.messages.stream(**args) as stream:  # type: ignore[call-overload]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and text
    assert final.stop_reason == whole.stop_reason
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert final.usage.output_tokens == whole.usage.output_tokens <= 16
