"""A prepared request (``Pipeline.prepare``): made ready once, inspected, then submitted.

Oracles: transformers' chat template and tokenizer on the same files give the prepared
prompt's text and ids; a prepared request generates what the same prompt given directly
generates (greedy), and its trace opens with the same events, so preparing changes nothing
but how often the template and the tokenizer run.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
from transformers import AutoTokenizer

from pipeline import build
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    with build("tiny") as built:
        yield built


def test_the_prepared_prompt_is_the_template_and_tokenizer_of_the_model(pipe: Pipeline) -> None:
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    prepared = pipe.prepare(MESSAGES, max_tokens=5)
    assert prepared.rendered.text == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                            add_generation_prompt=True)
    assert not prepared.tokenized  # tokens come when first asked for
    assert list(prepared.tokens.input_ids) == hf.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert prepared.tokenized


def test_submitting_a_prepared_request_is_submitting_its_prompt(pipe: Pipeline) -> None:
    direct = pipe.generate(MESSAGES, max_tokens=6, temperature=0)
    prepared = pipe.prepare(MESSAGES, max_tokens=6, temperature=0)
    via = pipe.generate(prepared)
    assert via.token_ids == direct.token_ids and via.text == direct.text
    kinds = [e.event_type for e in via.trace][:4]
    assert kinds == [e.event_type for e in direct.trace][:4] == [
        "request.accepted", "request.normalized", "context.rendered", "input.tokenized"]
    # a copy with another budget and id shares the tokens: nothing is tokenized again
    assert prepared.tokenized
    shorter = prepared.with_request(attrs.evolve(
        prepared.request, request_id="short",
        generation_config=attrs.evolve(prepared.request.generation_config, max_tokens=2)))
    assert shorter.tokens is prepared.tokens
    got = pipe.generate(shorter)
    assert got.request_id == "short" and got.token_ids == direct.token_ids[:2]


def test_what_would_change_the_prompt_is_refused(pipe: Pipeline) -> None:
    prepared = pipe.prepare(MESSAGES, max_tokens=4)
    other = attrs.evolve(prepared.request, messages=({"role": "user", "content": "hi"},))
    with pytest.raises(InvalidValueError) as caught:
        prepared.with_request(other)
    assert caught.value.field == "messages"
    with pytest.raises(InvalidValueError, match="carries its options") as caught:
        pipe.submit(prepared, max_tokens=3)
    assert caught.value.field == "options"
    with build("tiny") as second, pytest.raises(InvalidValueError, match="another pipeline"):
        second.submit(prepared)


def test_bad_input_is_refused_when_prepared(pipe: Pipeline) -> None:
    with pytest.raises(InvalidValueError) as caught:
        pipe.prepare("hi", logit_bias={10**9: 1.0})
    assert caught.value.field == "logit_bias"
