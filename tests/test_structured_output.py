"""Structured output by construction (docs/design.md §11): the ``grammar`` processor on llguidance.

Oracles: ``jsonschema`` (a maintained validator, not ours) for every constrained output;
``json.loads``; solo runs for batched ones (a batch mixing constrained and unconstrained rows
gives each row what it gets alone); the autoregressive strategy for the speculative one
(greedy speculative decoding equals greedy decoding, grammar or not); and the plain
definition of the mask for the processor (no allowed token is one the grammar cannot take).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from pipeline import Grammar, ToolSpec, build
from pipeline.errors import InvalidValueError
from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.request import GenerationConfig
from pipeline.tools.grammars import HermesCalls
from stages.structured import GrammarProcessor
from stages.structured.bitmask import apply_bitmask, unpack_bits
from stages.tokenize import HFTokenizer
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.trace import check

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user"]}}}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                        "y": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def tiny() -> Any:
    with build("tiny", options={"num_slots": 8}) as p:
        yield p


def test_json_schema_output_validates_for_every_seed(tiny: Any) -> None:
    handles = [tiny.submit(ASK, json_schema=PERSON, max_tokens=64, seed=s) for s in range(24)]
    for h in handles:
        done = h.result()
        jsonschema.validate(json.loads(done.text), PERSON)
        assert done.finish_reason.value == "eos"


def test_json_object_mode_gives_one_json_object(tiny: Any) -> None:
    for seed in range(6):
        done = tiny.generate(ASK, json_object=True, max_tokens=96, seed=seed,
                             temperature=0.7)
        if done.finish_reason.value == "eos":
            assert isinstance(json.loads(done.text), dict)
        else:   # cut by max_tokens: still a prefix of an object
            assert done.text.startswith("{")


def test_a_batch_mixing_grammars_and_none_equals_each_row_alone(tiny: Any) -> None:
    asks: list[dict[str, Any]] = [
        dict(json_schema=PERSON, seed=1), dict(seed=2), dict(json_schema=POINT, seed=3),
        dict(json_object=True, seed=4, temperature=0), dict(seed=5, temperature=0)]
    together = [tiny.submit(ASK, max_tokens=24, **a) for a in asks]
    texts = [h.result().text for h in together]
    alone = [tiny.generate(ASK, max_tokens=24, **a).text for a in asks]
    assert texts == alone
    jsonschema.validate(json.loads(texts[2]), POINT)


def test_speculative_decoding_under_a_grammar_equals_autoregressive() -> None:
    # the prompt holds JSON the n-gram proposer copies from, so drafts are made, some
    # of which the grammar forbids (rejected), some it allows (accepted)
    prompt = [{"role": "user", "content": 'Copy: {"name": "Ada", "age": 36, "role": "admin"}'}]
    with build("tiny") as plain, build(
            "tiny", strategy="speculative", strategy_options={"num_draft_tokens": 4}) as spec:
        proposed = accepted = 0
        for seed in range(3):
            args: dict[str, Any] = dict(json_schema=PERSON, max_tokens=48, temperature=0,
                                        seed=seed)
            want = plain.generate(prompt, **args).text
            got = spec.generate(prompt, **args, recording="full")
            assert got.text == want
            jsonschema.validate(json.loads(got.text), PERSON)
            assert check(got).ok, check(got).render()     # docs/design.md §8 on the engine's trace
            verified = [e.payload for e in got.trace if e.event_type == "spec.verified"]
            proposed += sum(v["proposed"] for v in verified)
            accepted += sum(v["accepted"] for v in verified)
    # drafts were made, and the grammar let some through and refused others
    assert proposed > accepted > 0


def test_the_mask_allows_only_what_the_grammar_can_continue_with() -> None:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    padded = tok.vocab_size + 40                         # a model vocabulary padded beyond it
    proc = GrammarProcessor(tok)
    config = GenerationConfig(grammar=Grammar.json_schema(POINT))
    so_far = '{"x": -'
    ids = tok.encode_text(so_far)
    row = Row("r", config, (1,), ids, len(ids) + 1, 0, tok.eos_token_ids)
    free = Row("f", GenerationConfig(), (1,), ids, len(ids) + 1, 0, tok.eos_token_ids)
    logits = torch.zeros(2, padded)
    out = proc(Scores(logits.clone()), Batch((row, free), padded)).values
    assert torch.equal(out[1], logits[1])                # the unconstrained row untouched
    allowed = (out[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tok.vocab_size     # never a padded id
    for token in allowed:                                # each continues a valid instance
        text = so_far + tok.token_bytes(token).decode("utf-8", errors="replace")
        assert text[len(so_far):][0].isdigit(), text
    assert not set(allowed) & tok.eos_token_ids


def test_eos_only_once_the_output_is_whole() -> None:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    proc = GrammarProcessor(tok)
    config = GenerationConfig(grammar=Grammar.json_schema(POINT))
    for text, whole in (('{"x": 5, "y": true', False), ('{"x": 5, "y": true}', True)):
        ids = tok.encode_text(text)
        row = Row("r" + text, config, (1,), ids, len(ids) + 1, 0, tok.eos_token_ids)
        out = proc(Scores(torch.zeros(1, tok.vocab_size)), Batch((row,), tok.vocab_size))
        finite = set((out.values[0] > float("-inf")).nonzero().flatten().tolist())
        assert (finite == set(tok.eos_token_ids)) if whole else not finite & tok.eos_token_ids


def test_rows_that_go_back_and_forth_are_masked_as_if_fresh() -> None:
    # speculative rows of one request: ids that extend, then roll back, then diverge
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    config = GenerationConfig(grammar=Grammar.json_schema(POINT))
    shared = GrammarProcessor(tok)
    texts = ('{"x": 1', '{"x": 12, "y', '{"x', '{"x": 3, "y": false', '{"x": 3, "z',
             '{"x": 3, "zz', '{"x": 3, "y": true}', '{"x": 3, "z', '{"x": 4')
    for text in texts:
        ids = tok.encode_text(text)
        row = Row("one", config, (1,), ids, len(ids) + 1, 0, tok.eos_token_ids)
        a = shared(Scores(torch.zeros(1, tok.vocab_size)), Batch((row,), tok.vocab_size))
        b = GrammarProcessor(tok)(Scores(torch.zeros(1, tok.vocab_size)),
                                  Batch((row,), tok.vocab_size))
        assert torch.equal(a.values, b.values), text
        finite = set((a.values[0] > float("-inf")).nonzero().flatten().tolist())
        if '"z' in text:   # left the grammar: only EOS remains for that row
            assert finite == set(tok.eos_token_ids), text
        else:
            assert finite and not finite <= set(tok.eos_token_ids) or text.endswith("}"), text


def test_apply_bitmask_is_the_plain_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 100):
        bits = torch.randint(0, 2, (3, vocab), generator=gen).bool()
        words = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int64)
        for i in range(vocab):
            words[:, i // 32] |= bits[:, i].long() << (i % 32)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        logits = torch.randn(3, vocab, generator=gen)
        want = torch.where(bits, logits, torch.tensor(float("-inf")))
        apply_bitmask(logits, words)
        assert torch.equal(logits, want)
        # the accelerator path (torch shifts on the logits' device), run here on the CPU
        assert torch.equal(unpack_bits(words, vocab), bits)


def test_unsupported_schema_features_are_errors_that_name_them(tiny: Any) -> None:
    with pytest.raises(InvalidValueError, match="at /properties/a: 'x-guidance'") as err:
        tiny.generate(ASK, json_schema={"type": "object", "properties": {
            "a": {"type": "string", "x-guidance": {"lenient": True}}}})
    assert err.value.field == "json_schema"
    with pytest.raises(InvalidValueError, match="if"):
        tiny.generate(ASK, json_schema={"type": "object", "if": {}})
    # a keyword the engine does not implement is named with its JSON Pointer
    with pytest.raises(InvalidValueError, match="at /properties/tags/items/not"):
        Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string", "not": {"pattern": "^a"}}}}})
    with pytest.raises(InvalidValueError, match="one of"):
        tiny.generate(ASK, json_schema=PERSON, json_object=True)
    with pytest.raises(InvalidValueError, match="tools\\[bad\\]"):
        HermesCalls().forced([ToolSpec("bad", "", {"type": "object", "if": {}})], parallel=False)


def test_a_required_tool_grammar_gives_a_valid_call(tiny: Any) -> None:
    tools = [ToolSpec("get_weather", "Weather", {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}}})]
    grammar = HermesCalls().forced(tools, parallel=False).grammar
    for seed in range(6):
        text = tiny.generate(ASK, tools=tools, grammar=grammar, max_tokens=64, seed=seed).text
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], tools[0].to_template()["function"]["parameters"])


def test_min_tokens_and_a_grammar_do_not_mix(tiny: Any) -> None:
    with pytest.raises(InvalidValueError, match="min_tokens"):
        tiny.generate(ASK, json_object=True, min_tokens=3)


def test_a_grammar_reads_back_from_the_recorded_config(tiny: Any) -> None:
    # the execution instance records the config as JSON; it must rebuild the same grammar
    done = tiny.generate(ASK, json_schema=POINT, max_tokens=32, seed=2)
    normalized = next(e for e in done.trace if e.event_type == "request.normalized")
    recorded = json.loads(json.dumps(normalized.payload["generation_config"]))
    rebuilt = GenerationConfig.from_dict({**recorded, "logit_bias": {}})
    assert rebuilt.grammar == Grammar.json_schema(POINT)


def test_a_prompt_that_opens_thinking_leaves_the_reasoning_free(tiny: Any) -> None:
    # the prompt ends in "<think>\n", as templates that start the reasoning write it; the
    # reasoning budget forces "</think>", after which the answer follows the schema
    from pipeline.contracts.request import Request

    tok = tiny.stages.tokenizer
    rendered = "<|im_start|>user\nDescribe a point.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tuple(tok.encode_text(rendered, special=True))
    for seed in range(3):
        done = tiny.generate(Request(prompt_ids=ids), json_schema=POINT, max_tokens=64,
                             seed=seed, reasoning_budget_tokens=8)
        reasoning, answer = done.text.split("</think>", 1)
        assert len(tok.encode_text(reasoning)) >= 4    # free text, not JSON-constrained
        jsonschema.validate(json.loads(answer), POINT)


def test_with_tools_and_a_format_both_openings_stay_allowed() -> None:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    tools = [ToolSpec("f", "", POINT)]
    proc = GrammarProcessor(tok)
    for answer, opening in ((Grammar.json_schema(POINT), "{"), (None, "Hello")):
        config = GenerationConfig(grammar=HermesCalls().optional(tools, answer))
        row = Row("t" + opening, config, (1,), (), 1, 0, tok.eos_token_ids)
        out = proc(Scores(torch.zeros(1, tok.vocab_size)), Batch((row,), tok.vocab_size))
        finite = set((out.values[0] > float("-inf")).nonzero().flatten().tolist())
        assert tok.encode_text("<tool_call>", special=True)[0] in finite
        assert tok.encode_text(opening)[0] in finite


def test_a_draft_model_drafts_under_the_grammar_too() -> None:
    # the draft model runs the same processor chain: its drafts obey the grammar, so a draft
    # model equal to the target has every draft accepted, and the output is plain decoding's
    with build("tiny") as plain, build("tiny", strategy="speculative", strategy_options={
            "draft_model": "tiny", "num_draft_tokens": 3}) as spec:
        args: dict[str, Any] = dict(json_schema=PERSON, max_tokens=48, temperature=0, seed=0)
        want = plain.generate(ASK, **args).text
        got = spec.generate(ASK, **args)
        verified = [e.payload for e in got.trace if e.event_type == "spec.verified"]
        assert got.text == want
        assert sum(v["proposed"] for v in verified) == sum(v["accepted"] for v in verified) > 0
        jsonschema.validate(json.loads(got.text), PERSON)


@pytest.mark.parametrize("model", ["tiny-masked", "tiny-flow"])
def test_a_grammar_on_a_strategy_that_commits_blocks_is_refused(model: str) -> None:
    # masked diffusion once answered json_object with "{{{{{": the grammar masked each
    # position of a block alone, so the committed block was no prefix of any JSON text
    from pipeline.errors import InvalidValueError

    with build(model) as pipe, pytest.raises(InvalidValueError, match="cannot constrain"):
        pipe.generate("hi", json_object=True, max_tokens=8)


def test_a_format_the_engine_cannot_assert_is_an_annotation() -> None:
    # JSON Schema: format is an annotation unless asserted; formats the engine knows stay
    # enforced, others are dropped instead of failing the request (a property named "format"
    # is a name, not the keyword, and stays)
    schema = {"type": "object", "required": ["format", "when"], "properties": {
        "format": {"type": "string", "format": "non-blank"},
        "when": {"type": "string", "format": "date-time"},
        "blob": {"type": "array", "items": {"type": "string", "format": "byte"}}}}
    kept = json.loads(Grammar.json_schema(schema).source)
    assert kept["properties"]["format"] == {"type": "string"}
    assert kept["properties"]["when"] == {"type": "string", "format": "date-time"}
    assert kept["properties"]["blob"]["items"] == {"type": "string"}
    assert list(kept["properties"]) == ["format", "when", "blob"] and kept["required"] == [
        "format", "when"]
