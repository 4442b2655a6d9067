"""The schema collection (``tests/schemas/collection.json``, 220 schemas written for the
project): what compiles, what is refused and how, and that the rewrites of keywords the engine
lacks never admit an invalid output.

Oracles: ``jsonschema`` with each schema's own draft and format checker (the collection's
checker validates every schema against its metaschema and every example instance), and
outputs of the tiny model under each schema that needed a rewrite, every one validated.
The default model's run over the whole collection is ``benchmarks/structured.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline import Grammar, build
from pipeline.errors import InvalidValueError

HERE = Path(__file__).parent / "schemas"
ENTRIES: list[dict[str, Any]] = json.loads((HERE / "collection.json").read_text())
REWRITTEN = ("dependentRequired", "dependencies", "dependentSchemas", "not", "propertyNames",
             "oneOf", "if", "uniqueItems")


def _uses(schema: Any, words: tuple[str, ...]) -> bool:
    text = json.dumps(schema)
    return any(f'"{w}":' in text for w in words)


def test_the_collection_is_valid_json_schema_with_valid_examples() -> None:
    sys.path.insert(0, str(HERE))
    try:
        import check_collection
    finally:
        sys.path.remove(str(HERE))
    assert check_collection.main([]) == 0


def test_at_least_97_percent_compile_and_each_refusal_names_where() -> None:
    refused = []
    for entry in ENTRIES:
        try:
            Grammar.json_schema(entry["schema"])
        except InvalidValueError as e:
            refused.append((entry["name"], str(e)))
    assert len(ENTRIES) >= 200
    assert (len(ENTRIES) - len(refused)) / len(ENTRIES) >= 0.97, refused
    for name, why in refused:
        assert " at /" in why, (name, why)
        assert "coerce_one_of" not in why


@pytest.fixture(scope="module")
def tiny() -> Any:
    with build("tiny", options={"num_slots": 8}) as p:
        yield p


def test_schemas_that_needed_a_rewrite_give_valid_outputs(tiny: Any) -> None:
    picked = []
    for entry in ENTRIES:
        if _uses(entry["schema"], REWRITTEN):
            try:
                Grammar.json_schema(entry["schema"])
                picked.append(entry)
            except InvalidValueError:
                continue
    assert len(picked) >= 40
    # all at once: the engine keeps its eight slots full as requests finish, instead of
    # waiting on the longest of each group of eight (seeds 0-7 by position in each group of
    # eight, as before; on the CPU the engine is batch-invariant, so these are the same
    # outputs)
    handles = [tiny.submit(f"An example of {e['name']} as JSON.", json_schema=e["schema"],
                           max_tokens=384, seed=i % 8, temperature=1.0)
               for i, e in enumerate(picked)]
    for entry, handle in zip(picked, handles, strict=True):
        done = handle.result()
        schema = entry["schema"]
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(done.text))
        assert done.finish_reason.value == "eos", (entry["name"], done.text)
