"""Constrained output that always finishes valid: within ``max_tokens``, with no repeated keys
or unique items, and for the constraint kinds servers take (docs/design.md §11).

Oracles: ``jsonschema`` (a maintained validator, not ours) on every JSON output, Python's
``json`` with an ``object_pairs_hook`` for repeated keys, Python's ``re.fullmatch`` for regular
expressions and for the languages of the grammars (each chosen to be a regular language), and
the constraint's own definition for choices. The closing path is checked the same way: the
text it completes validates.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import llguidance
import pytest

from pipeline import Grammar, build
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MODEL_DIR
from stages.structured.closing import Closer
from stages.structured.guard import ANY, JsonGuard, JsonScan, unique_paths
from stages.structured.vocab import ll_tokenizer, token_table
from stages.tokenize import HFTokenizer

ASK = [{"role": "user", "content": "Describe a city as JSON."}]
OPEN = {"type": "object", "properties": {"city": {"type": "string"},
                                         "population": {"type": "integer"}}}
NESTED = {"type": "object", "required": ["name", "tags", "owner"], "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                         "minItems": 2},
    "owner": {"type": "object", "required": ["id", "email"],
              "properties": {"id": {"type": "integer"},
                             "email": {"type": "string", "format": "email"}}}}}
UNIQUE = {"type": "object", "required": ["tags", "ids"], "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "minItems": 3},
    "ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 4}}}


@pytest.fixture(scope="module")
def tiny() -> Any:
    with build("tiny", options={"num_slots": 8}) as p:
        yield p


@pytest.fixture(scope="module")
def vocab() -> tuple[HFTokenizer, list[bytes], Any]:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    table = token_table(tok)
    return tok, table, ll_tokenizer(tok, table)


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {keys}"
    return dict(pairs)


def _each(pipe: Any, n: int, **kwargs: Any) -> list[Any]:
    handles = [pipe.submit(ASK, seed=seed, **kwargs) for seed in range(n)]
    return [h.result() for h in handles]


def _least_budget(pipe: Any, schema: Any) -> int:
    """The smallest ``max_tokens`` the pipeline does not refuse for ``schema``."""
    for budget in range(2, 400):
        try:
            pipe.stages.request_checks[0].check_request(
                pipe.request(ASK, json_schema=schema, max_tokens=budget).generation_config,
                pipe.tokenize(ASK).input_ids)
            return budget
        except InvalidValueError:
            continue
    raise AssertionError("no budget admitted")


@pytest.mark.parametrize("schema", [OPEN, NESTED, UNIQUE, {"type": "array", "items": {
    "type": "number"}}], ids=["open", "nested", "unique", "numbers"])
@pytest.mark.parametrize("extra", [0, 6, 40])
def test_every_output_ends_valid_within_the_budget(tiny: Any, schema: Any, extra: int) -> None:
    # from the least budget the pipeline admits (the edge) upwards
    max_tokens = _least_budget(tiny, schema) + extra
    for done in _each(tiny, 12, json_schema=schema, max_tokens=max_tokens, temperature=1.2):
        value = json.loads(done.text, object_pairs_hook=_no_repeated_keys)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        assert done.finish_reason.value == "eos", done.text
        assert len(done.token_ids) <= max_tokens


def test_json_object_mode_never_repeats_a_key_and_ends(tiny: Any) -> None:
    for done in _each(tiny, 16, json_object=True, max_tokens=48, temperature=1.3):
        assert isinstance(json.loads(done.text, object_pairs_hook=_no_repeated_keys), dict)
        assert done.finish_reason.value == "eos"


def test_a_budget_that_holds_no_instance_is_refused_before_generating(tiny: Any) -> None:
    schema = {"type": "object", "required": ["summary"], "properties": {
        "summary": {"type": "string", "minLength": 60}}}
    with pytest.raises(InvalidValueError, match="max_tokens=8: cannot hold any output"):
        tiny.generate(ASK, json_schema=schema, max_tokens=8)
    done = tiny.generate(ASK, json_schema=schema, max_tokens=96, seed=1)
    jsonschema.validate(json.loads(done.text), schema)


@pytest.mark.parametrize("schema,prefix", [
    (NESTED, '{"name": "Lyon", "tags": ["a'),
    (NESTED, '{"name": "Lyon", "tags": ["a", "b"], "owner": {"id": 12'),
    (UNIQUE, '{"tags": ["x", "y"'),
    (UNIQUE, '{"tags": ["x", "y", "z"], "ids": [0, 1, '),
    ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,}$"}, '"AB'),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}},
      "required": ["when"]}, '{"when": "20'),
], ids=["in-array", "in-number", "unique-strings", "unique-numbers", "pattern", "date-time"])
def test_the_closing_path_completes_a_valid_instance(vocab: Any, schema: Any,
                                                     prefix: str) -> None:
    tok, table, ll = vocab
    grammar = Grammar.json_schema(schema)
    matcher = llguidance.LLMatcher(ll, grammar.engine_source(), log_level=0)
    ids = tok.encode_text(prefix)
    assert matcher.try_consume_tokens(ids) == len(ids)
    scan = JsonScan(unique_paths(json.loads(grammar.source)))
    scan.feed(prefix.encode())
    path = Closer(tok, table).path(matcher, scan, JsonGuard(table))
    assert path is not None
    value = json.loads(prefix + tok.decode(path))
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def test_the_guard_names_the_tokens_that_would_repeat() -> None:
    table = [b'"', b'a"', b'b"', b', "a"', b'1,', b'1', b'2,', b",", b"]", b'c', b'"a"']
    guard = JsonGuard(table)
    scan = JsonScan(frozenset({("xs",)}))
    scan.feed(b'{"a": 1, "')
    assert sorted(guard.forbidden(scan)) == [1]          # would close the key "a" again
    scan = JsonScan(frozenset({("xs",)}))
    scan.feed(b'{"a": 1')
    assert sorted(guard.forbidden(scan)) == [3, 10]      # ', "a"' would write it whole
    scan = JsonScan(frozenset({("xs",)}))
    scan.feed(b'{"xs": [1, ')
    assert guard.forbidden(scan) == []                   # a number not yet begun
    scan.feed(b"1")
    assert sorted(set(guard.forbidden(scan))) == [3, 7, 8]    # ",", "]" or ", \"a\"" would end a 1 again
    scan = JsonScan(frozenset())
    scan.feed(b'{"xs": [1, 1')
    assert guard.forbidden(scan) == []                   # not a unique array


@pytest.mark.parametrize("pattern", [r"[A-Z]{3}-\d{3}", r"(yes|no)", r"\d{4}-\d{2}-\d{2}"])
def test_a_regular_expression_is_matched_whole(tiny: Any, pattern: str) -> None:
    for done in _each(tiny, 8, regex=pattern, max_tokens=24, temperature=1.0):
        assert re.fullmatch(pattern, done.text), done.text
        assert done.finish_reason.value == "eos"


def test_a_choice_is_one_of_its_strings(tiny: Any) -> None:
    options = ["positive", "negative", "neutral", "mixed feelings"]
    for done in _each(tiny, 8, choice=options, max_tokens=16, temperature=1.5):
        assert done.text in options


@pytest.mark.parametrize("grammar,language", [
    ('root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | [0-9]+', r"\((?:[a-z]+|[0-9]+)"
                                                                    r"(?:,(?:[a-z]+|[0-9]+))*\)"),
    ('start: "[" NUM (";" NUM)* "]"\nNUM: /[0-9]{1,3}/', r"\[[0-9]{1,3}(?:;[0-9]{1,3})*\]"),
], ids=["ebnf", "lark"])
def test_a_context_free_grammar_in_ebnf_or_lark(tiny: Any, grammar: str, language: str) -> None:
    for done in _each(tiny, 8, grammar=grammar, max_tokens=32, temperature=1.0):
        assert re.fullmatch(language, done.text), done.text
        assert done.finish_reason.value == "eos"


def test_the_constraint_is_in_the_trace(tiny: Any) -> None:
    done = tiny.generate(ASK, regex="[a-c]{2}", max_tokens=8)
    normalized = next(e for e in done.trace if e.event_type == "request.normalized")
    assert normalized.payload["generation_config"]["grammar"]["kind"] == "regex"
    assert normalized.payload["generation_config"]["grammar"]["source"] == "[a-c]{2}"


def test_bad_constraints_are_errors_that_name_them(tiny: Any) -> None:
    with pytest.raises(InvalidValueError, match="look-around"):
        tiny.generate(ASK, regex="(?=a)b")
    with pytest.raises(InvalidValueError, match="choice"):
        tiny.generate(ASK, choice=[])
    with pytest.raises(InvalidValueError, match="EBNF"):
        tiny.generate(ASK, grammar="root ::= (")
    with pytest.raises(InvalidValueError, match="give one of"):
        tiny.generate(ASK, regex="a", choice=["a"])


def test_unique_enum_items_never_run_into_a_dead_end(tiny: Any) -> None:
    # once "admin" is taken, '"admin' leads nowhere; once every value is taken, neither does
    # another item: the guard must see that before, not leave the grammar no token
    schemas = [
        {"type": "object", "required": ["scopes"], "additionalProperties": False,
         "properties": {"scopes": {"type": "array", "minItems": 1, "uniqueItems": True,
                                   "items": {"enum": ["read:orders", "write:orders", "admin",
                                                      "admin:all"]}}}},
        {"type": "array", "minItems": 1, "uniqueItems": True,
         "items": {"enum": ["a", "b", "c"]}},
    ]
    for schema in schemas:
        for done in _each(tiny, 16, json_schema=schema, max_tokens=64, temperature=1.3):
            jsonschema.validate(json.loads(done.text), schema)
            assert done.finish_reason.value == "eos"


def _state(scan: JsonScan) -> Any:
    frames = [(f.kind, f.path, list(f.seen), f.expect, f.start, f.key, f.unique)
              for f in scan.stack]
    where = next((i for i, f in enumerate(scan.stack) if f is scan.string_frame), None)
    return (bytes(scan.text), frames, scan.string, where, scan.escaped, scan.scalar)


def test_a_scans_copy_is_its_deep_copy_and_independent() -> None:
    # JsonScan.copy (the closing search's per-character copy) against copy.deepcopy, cut at
    # every byte of outputs with unique arrays, escapes, open strings and open numbers
    import copy

    texts = [b'{"tags": ["x", "y\\"z", "x"], "ids": [0, 1, 12', b'[["a", "b"], ["a", "b"]]',
             b'{"a": {"tags": ["q"]}, "tags": [true, null, -1.5e3, "t', b'{"ids": [3, 4, 3]}']
    for text in texts:
        for cut in range(len(text) + 1):
            scan = JsonScan(frozenset({("tags",), ("ids",), (ANY,)}))
            scan.feed(text[:cut])
            mine, theirs = scan.copy(), copy.deepcopy(scan)
            assert _state(mine) == _state(theirs) == _state(scan)
            mine.feed(text[cut:])
            theirs.feed(text[cut:])
            assert _state(mine) == _state(theirs)
            assert _state(scan)[0] == text[:cut]   # the original did not move
