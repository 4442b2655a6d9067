"""Raw prompts in the library: ``Request(prompt_ids=...)`` (the model's input ids as they are)
and the tokenizer's ``encode_document`` (text as the tokenizer alone encodes it, BOS rule
included).

Oracles: transformers' ``tokenizer(text)`` on the same tokenizer.json (with a BOS-adding
post-processor, as Llama's has, and without one), the same prompt given as text, and the trace
invariant checker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from pipeline import build
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.text import DocumentEncoder
from pipeline.trace import check
from pipeline.contracts.request import Request
from stages.tokenize import HFTokenizer
from tests.bos_tokenizer import bos_tokenizer_file

TEXTS = ["Once upon a time", "  leading spaces and\ttabs\n", "naïve 東京 👍🏽",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>tail"]


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    with build("tiny") as p:
        yield p


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_encode_document_is_the_tokenizer_alone(tmp_path: Path, bos: bool) -> None:
    path = bos_tokenizer_file(tmp_path) if bos else TINY_MODEL_DIR / "tokenizer.json"
    ours = HFTokenizer.from_files(path)
    oracle = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert isinstance(ours, DocumentEncoder)
    assert ours.leading_ids == ((1,) if bos else ())
    for text in TEXTS:
        assert ours.encode_document(text) == list(oracle(text)["input_ids"]), text


def test_prompt_ids_generate_as_the_same_prompt_given_as_text(pipe: Pipeline) -> None:
    tok = pipe.stages.tokenizer
    assert tok is not None
    text = TEXTS[0]
    ids = tok.encode_text(text)
    config = {"max_tokens": 10, "temperature": 0.8, "seed": 3}
    by_ids = pipe.generate(Request(prompt_ids=ids, generation_config=config, recording="full"))
    by_text = pipe.generate(Request(prompt=text, generation_config=config))
    assert by_ids.text == by_text.text and by_ids.token_ids == by_text.token_ids
    assert by_ids.usage.prompt_tokens == len(ids) == pipe.count_tokens(Request(prompt_ids=ids))
    assert tuple(pipe.tokenize(Request(prompt_ids=ids)).input_ids) == tuple(ids)
    report = check(list(by_ids.trace))
    assert report.ok, report.render()
    normalized = next(e for e in by_ids.trace if e.event_type == "request.normalized")
    assert normalized.payload["prompt_digest"] is not None


def test_special_ids_are_taken_as_they_are(pipe: Pipeline) -> None:
    """Ids spelling a chat turn are the control tokens themselves: the same as the messages
    rendered by the template, which text given as ``prompt`` (all content) would not be."""
    rendered = pipe.tokenize([{"role": "user", "content": "hi"}]).input_ids
    by_ids = pipe.generate(Request(prompt_ids=rendered, generation_config={
        "max_tokens": 8, "temperature": 0}))
    by_messages = pipe.generate([{"role": "user", "content": "hi"}], max_tokens=8,
                                temperature=0)
    assert by_ids.text == by_messages.text


@pytest.mark.parametrize(("ids", "message"), [
    ([], "the prompt is empty"), ([-1], "non-negative"), ([1.5], "non-negative"),
    ("abc", "list of token ids"), ([10**7], "outside the vocabulary")])
def test_bad_prompt_ids_are_refused(pipe: Pipeline, ids: object, message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        pipe.generate(Request(prompt_ids=ids))  # type: ignore[arg-type]


def test_one_prompt_form_only() -> None:
    with pytest.raises(InvalidValueError, match="exactly one of"):
        Request(prompt="x", prompt_ids=[1])
