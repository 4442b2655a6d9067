"""The HTTP server serves the continuous diffusion and flow models through both dialects
unchanged (issue 14): the official ``openai`` and ``anthropic`` SDKs parse the answers and
streams, a streamed answer equals the non-streamed one with the same seed, and usage and
finish reasons come from the committed tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from pipeline.builder import build
from pipeline.pipe import Pipeline
from tests.http_support import config, running
from transports.http import Gateway, ServerConfig

KEY = "sk-test-key"
QUESTION = [{"role": "user", "content": "What is a Python list?"}]


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    assert folder is not None
    strategy = {"tiny-continuous": "ddim", "tiny-flow": "flow"}[folder.name]
    return build(folder.name, strategy=strategy, strategy_options={"steps": 6},
                 options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("continuous"), api_keys={KEY},
                 models={"diffusion": Path("tiny-continuous"), "flow": Path("tiny-flow")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.mark.parametrize("model", ["diffusion", "flow"])
def test_openai_stream_equals_non_stream(base_url: str, model: str) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    args = dict(model=model, messages=QUESTION, max_tokens=20, seed=7)
    whole = oai.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(oai.chat.completions.create(**args, stream=True,  # type: ignore[call-overload]
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens <= 20
    assert whole.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("model", ["diffusion", "flow"])
def test_anthropic_stream_equals_non_stream(base_url: str, model: str) -> None:
    claude = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)
    args = dict(model=model, messages=QUESTION, max_tokens=20, extra_body={"seed": 3})
    whole = claude.messages.create(**args)  # type: ignore[call-overload]
    with claude.messages.stream(**args) as stream:  # type: ignore[call-overload]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens <= 20
