"""Schema-constrained numbers end: bounded by the schema's bounds where given, otherwise by the
documented defaults (``pipeline.schema_compat``; docs/structured_output.md, "Numbers").

Oracles: ``json.loads`` (each number's text and its value as a double), ``decimal`` for digit
counts, ``jsonschema`` for the schema's own bounds, and the official ``openai`` and
``anthropic`` SDKs for the issue's schema on the default model. The collection's outputs come
from a pseudo-random model (hashed logits over the tiny model's vocabulary): it has no idea
when a number should end, so it writes digits for as long as the grammar lets it, which is
the case the bounds are for, and it is fast enough to run every schema of the collection.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from pipeline import EngineConfig, Grammar, build
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.testing import ScriptedBackend, hashed_logits
from stages.structured.guard import JsonGuard, JsonScan, unique_paths
from stages.structured.vocab import token_table
from stages.tokenize import HFTokenizer
from tests.http_support import config, running
from transports.http import Gateway

EXACT = 2**53 - 1
"""The integers every JSON parser keeps exactly (IEEE doubles)."""
FRACTION_DIGITS = 6
SIGNIFICANT = 15
ENTRIES: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "schemas" / "collection.json").read_text())
POPULATION = {"type": "object", "additionalProperties": False,
              "required": ["city", "population"],
              "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}
ASK = [{"role": "user", "content": "What is the population of Paris?"}]
KEY = "sk-test-key"


def numbers(text: str) -> list[str]:
    """The text of every number in the JSON ``text`` (which must parse)."""
    found: list[str] = []

    def keep(kind: type) -> Any:
        return lambda s: (found.append(s), kind(s))[1]

    json.loads(text, parse_int=keep(int), parse_float=keep(Decimal),
               parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    return found


def check_number(text: str, fraction_digits: int = FRACTION_DIGITS) -> None:
    """A number as the defaults allow it: plain decimal, an integer within ±(2^53 − 1), a
    fraction of at most ``fraction_digits`` digits and 15 significant ones, a value a double
    holds as written."""
    assert "e" not in text.lower(), text
    value = Decimal(text)
    assert math.isfinite(float(value)), text
    if "." not in text:
        assert abs(int(text)) <= EXACT and float(int(text)) == int(text), text
        return
    digits = value.as_tuple()
    assert -int(digits.exponent) <= fraction_digits, text
    assert len(str(abs(value)).replace(".", "").lstrip("0")) <= SIGNIFICANT, text
    assert Decimal(repr(float(text))) == value, text   # a double keeps it exactly


def _fraction_digits(schema: Any) -> int:
    """The digits after the point a ``multipleOf`` of ``schema`` may ask for (the default
    when it has none)."""
    steps = [Decimal(str(m)) for m in _values(schema, "multipleOf")]
    return max([FRACTION_DIGITS, *(-int(s.as_tuple().exponent) for s in steps)])


def _values(node: Any, word: str) -> Iterator[Any]:
    if isinstance(node, dict):
        if word in node:
            yield node[word]
        for value in node.values():
            yield from _values(value, word)
    elif isinstance(node, list):
        for value in node:
            yield from _values(value, word)


def test_the_fixture_collection_has_no_bound_beyond_the_defaults() -> None:
    # a check of the fixture data, not of the bounding: what the collection check below
    # relies on is that no bound of a schema's own lies beyond the
    # exact range, so every integer it admits is within ±(2^53 - 1) either way
    for entry in ENTRIES:
        for word in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            for bound in _values(entry["schema"], word):
                assert isinstance(bound, bool) or abs(bound) <= EXACT, entry["name"]


def test_every_number_of_the_collection_is_exact_and_within_its_bounds() -> None:
    picked = []
    for entry in ENTRIES:
        text = json.dumps(entry["schema"])
        if '"integer"' in text or '"number"' in text:
            try:
                Grammar.json_schema(entry["schema"])
            except InvalidValueError:
                continue   # refused (test_schema_collection checks how)
            picked.append(entry)
    assert len(picked) >= 130
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    backend = ScriptedBackend(tok.vocab_size, hashed_logits(tok.vocab_size), num_slots=8)
    seen = 0
    with build(TINY_MODEL_DIR, backend=backend) as pipe:
        handles = [pipe.submit(f"An example of {e['name']} as JSON.", json_schema=e["schema"],
                               max_tokens=256, seed=i, temperature=1.0)
                   for i, e in enumerate(picked)]
        for entry, handle in zip(picked, handles, strict=True):
            done = handle.result()
            assert done.finish_reason.value == "eos", (entry["name"], done.text)
            schema = entry["schema"]
            jsonschema.validators.validator_for(schema)(schema).validate(json.loads(done.text))
            digits = _fraction_digits(schema)
            for number in numbers(done.text):
                check_number(number, digits)
                seen += 1
    assert seen >= 100   # the outputs do hold numbers


@pytest.mark.parametrize("schema", [
    {"type": "integer"}, {"type": "number"}, {"type": "array", "items": {"type": "integer"}},
    {"type": "object"}, True])
def test_a_number_alone_ends_within_the_defaults(schema: Any) -> None:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    backend = ScriptedBackend(tok.vocab_size, hashed_logits(tok.vocab_size), num_slots=8)
    with build(TINY_MODEL_DIR, backend=backend) as pipe:
        handles = [pipe.submit("A number.", json_schema=schema, max_tokens=96, seed=seed,
                               temperature=1.0) for seed in range(8)]
        for handle in handles:
            done = handle.result()
            assert done.finish_reason.value == "eos", done.text
            for number in numbers(done.text):
                check_number(number)


def test_a_schema_s_own_bounds_stand_and_a_tight_budget_still_ends() -> None:
    bounded = {"type": "object", "additionalProperties": False, "required": ["n", "x"],
               "properties": {"n": {"type": "integer", "minimum": -3, "exclusiveMaximum": 40},
                              "x": {"type": "number", "minimum": 0.5, "maximum": 2}}}
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    backend = ScriptedBackend(tok.vocab_size, hashed_logits(tok.vocab_size), num_slots=8)
    with build(TINY_MODEL_DIR, backend=backend) as pipe:
        handles = [pipe.submit("Numbers.", json_schema=schema, max_tokens=budget, seed=seed,
                               temperature=1.0)
                   for schema in (bounded, POPULATION) for budget in (20, 28, 64)
                   for seed in range(4)]
        for handle in handles:
            done = handle.result()
            assert done.finish_reason.value == "eos", done.text
            value = json.loads(done.text)
            if "n" in value:
                jsonschema.validate(value, bounded)
            for number in numbers(done.text):
                check_number(number)


@pytest.mark.parametrize("current", [
    '{"label": "a", "score": 1.0', '{"label": "a", "score": 1.00', '{"label": "a", "score": 1',
    '{"label": "a", "score": 0.5'])
def test_a_unique_array_of_objects_gets_no_repeat_even_by_value(current: str) -> None:
    # bounded numbers may still be written with trailing zeros (1.0, 1.00): a unique array's
    # object item is told from an earlier one by value, as JSON Schema compares them
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    table = token_table(tok)
    guard = JsonGuard(table)
    earlier = {"label": "a", "score": 1.0}
    scan = JsonScan(unique_paths({"type": "array", "uniqueItems": True}))
    scan.feed(f"[{json.dumps(earlier)}, {current}".encode())
    banned = set(guard.forbidden(scan))
    decoder = json.JSONDecoder()
    checked = 0
    for token, data in enumerate(table):
        if data[:1].isspace() or re.search(rb"\s[\]},]|[\n\t\r]", data):
            continue   # blank where the output's layout (json.dumps') has none
        try:
            text = (current.encode() + data).decode()
            item, end = decoder.raw_decode(text)   # the item closes within this token
        except (UnicodeDecodeError, ValueError):
            continue
        if text[end:end + 1] not in ("", ",", "]", " "):
            continue   # not a way the array goes on
        checked += 1
        assert (token in banned) == (item == earlier), (current, data)
    assert checked > 0


# --- the schema on the default model, through the three APIs -----------------------

@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("numbers"), api_keys={KEY}, models={"default": None})
    unpaced = EngineConfig(step_latency_ratio=None)   # as test_structured_default_model's
    with running(Gateway(cfg, lambda folder, c: build(options={"num_slots": 8},
                                                      engine=unpaced))) as url:
        yield url


def test_the_population_integer_ends_through_every_api(base_url: str) -> None:
    # at temperature 0 the default model wrote a 32-digit population before numbers had bounds
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
    claude = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    strict = {"name": "city", "schema": POPULATION, "strict": True}

    def chat() -> tuple[str, str | None]:
        done = oai.chat.completions.create(
            model="default", messages=ASK, max_tokens=300, temperature=0,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": strict})  # type: ignore[typeddict-item]
        return done.choices[0].message.content or "", done.choices[0].finish_reason

    def messages() -> tuple[str, str | None]:
        done = claude.messages.create(
            model="default", messages=ASK, max_tokens=300,  # type: ignore[arg-type]
            output_config={"format": {"type": "json_schema", "schema": POPULATION}},
            extra_body={"temperature": 0})
        return "".join(b.text for b in done.content if b.type == "text"), done.stop_reason

    def responses() -> tuple[str, str | None]:
        done = oai.responses.create(model="default", input=ASK, max_output_tokens=300,  # type: ignore[arg-type]
                                    temperature=0, text={"format": {"type": "json_schema",
                                                                    **strict}})  # type: ignore[typeddict-item]
        return done.output_text, done.status

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda ask: ask(), (chat, messages, responses)))
    for text, finish in answers:
        assert finish in ("stop", "end_turn", "completed"), (text, finish)
        value = json.loads(text)
        jsonschema.validate(value, POPULATION)
        assert abs(value["population"]) <= EXACT, text
        for number in numbers(text):
            check_number(number)
