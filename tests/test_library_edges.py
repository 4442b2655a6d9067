"""Rough edges of the library face, each seen by a user: tokenize/count_tokens/render take the
same template arguments as transformers' ``apply_chat_template``; messages come in the OpenAI /
Hugging Face shapes users already have; an unknown field suggests the closest name.

Oracle: transformers' ``apply_chat_template`` on the same tokenizer folder (the tiny model's
template renders tools and tool calls)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import build
from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.request import GenerationConfig, Message

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                 {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


@pytest.fixture(scope="module")
def oracle() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))


def _hf_chat() -> list[dict[str, Any]]:
    """CHAT as transformers' templates take it (content as text)."""
    out = [dict(m) for m in CHAT]
    out[0]["content"] = "Weather in Paris?"
    return out


@pytest.mark.parametrize("add", [True, False])
def test_tokenize_count_and_render_take_tools_like_apply_chat_template(oracle: Any,
                                                                       add: bool) -> None:
    want = oracle.apply_chat_template(_hf_chat(), tools=TOOLS, add_generation_prompt=add,
                                      tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    text = oracle.apply_chat_template(_hf_chat(), tools=TOOLS, add_generation_prompt=add,
                                      tokenize=False)
    with build("tiny") as pipe:
        assert list(pipe.tokenize(CHAT, tools=TOOLS, add_generation_prompt=add).input_ids) == want
        assert pipe.count_tokens(CHAT, tools=TOOLS, add_generation_prompt=add) == len(want)
        assert pipe.render(CHAT, tools=TOOLS, add_generation_prompt=add).text == text


def test_openai_and_hf_message_shapes_are_accepted() -> None:
    message = Message.from_dict(CHAT[1])
    (call,) = message.tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    text_args = {**CHAT[1]["tool_calls"][0],
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert Message.from_dict({**CHAT[1], "tool_calls": [text_args]}).tool_calls[0].arguments \
        == '{"city": "Paris"}'
    assert Message.from_dict(CHAT[0]).content == "Weather in Paris?"
    with pytest.raises(InvalidValueError, match="only text"):
        Message.from_dict({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})
    with pytest.raises(InvalidValueError, match="only function"):
        Message.from_dict({**CHAT[1], "tool_calls": [{**CHAT[1]["tool_calls"][0],
                                                      "type": "code"}]})


@pytest.mark.parametrize("wrong, right", [("max_token", "max_tokens"),
                                          ("temprature", "temperature"),
                                          ("topp", "top_p")])
def test_an_unknown_field_suggests_the_closest_name(wrong: str, right: str) -> None:
    with pytest.raises(UnknownFieldError) as err:
        GenerationConfig.from_dict({wrong: 1})
    assert err.value.suggestion == right and f"did you mean {right!r}" in str(err.value)
    with build("tiny") as pipe, pytest.raises(UnknownFieldError, match=f"did you mean {right!r}"):
        pipe.generate("x", **{wrong: 1})


def test_a_vocabulary_padded_beyond_the_tokenizer_never_fails_a_request() -> None:
    # The model has 320 ids, the byte tokenizer 257: the model's favourite id is padding.
    import torch

    from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted

    vocab, padded = 320, 300

    def logits(tokens: Any) -> torch.Tensor:
        out = torch.zeros(vocab)
        out[padded] = 50.0          # what an untrained padding row can do
        out[ord("k")] = 10.0        # the best id the tokenizer can decode
        return out

    assert ByteTokenizer.VOCAB < padded
    with build_scripted(ScriptedBackend(vocab, logits)) as pipe:
        for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
            done = pipe.generate("x", max_tokens=3, **params)
            assert done.text == "kkk" and max(done.token_ids) < ByteTokenizer.VOCAB
        # token-id fields may name any id the model has
        assert pipe.generate("x", max_tokens=2, temperature=0,
                             logit_bias={padded + 5: -1.0}).text == "kk"
        with pytest.raises(InvalidValueError, match="outside the vocabulary"):
            pipe.generate("x", max_tokens=2, logit_bias={vocab: 1.0})
