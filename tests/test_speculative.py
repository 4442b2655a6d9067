"""Speculative decoding end to end: greedy output equals plain greedy decoding, token for
token, with n-gram drafts and with a draft model, alone and batched, whatever ends the run;
the trace's cache lengths follow every rollback and pass the invariant checks; cancellation
mid-speculation frees both models' slots; a forced token ends a block; bad options are clear
errors; n-gram lookup agrees with a brute-force search.

The oracle for greedy runs is the same model decoding one token per step (the
``autoregressive`` strategy). The draft model is the tiny model cut to its first two layers:
the same tokenizer, a different (worse) model, so drafts are both accepted and rejected.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import RuntimeLimits, build
from pipeline.engine import EngineConfig
from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.events import Event
from pipeline.contracts.forcing import Forcing
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.decode import Row
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_logits
from pipeline.trace import check, diff, load
from pipeline.contracts.output import Completion
from pipeline.contracts.request import GenerationConfig
from stages.process import ProcessorChain
from stages.select import SamplingSelector
from stages.strategies import SpeculativeStrategy
from stages.strategies.proposers import NgramProposer
from trace_runs import edit, is_

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "Why is the sky blue?",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "List the numbers: 1 2 3 4 5 1 2 3 4 5 1 2 3",
    "Write a short poem about the sea.",
    "Translate 'good morning' into French.",
    "a b c d e f g a b c d e f g a b c",
    "What is 12 times 12?",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples,",
    "Tell me about Python dictionaries.",
]


def draft_folder(dst: Path, layers: int) -> Path:
    """The tiny model cut to its first ``layers`` layers (same tokenizer)."""
    shutil.copytree(TINY_MODEL_DIR, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(dst / "model.safetensors")
    kept = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


STEADY = EngineConfig(step_latency_ratio=None)
"""Prefill chunks sized by tokens only: with pacing they follow measured step times, and on
the bfloat16 tiny model a different chunking can move a logit by an ulp and flip a near-tie
between a batched and a solo run."""


@pytest.fixture(scope="module")
def plain() -> Iterator[Any]:
    with build("tiny", engine=STEADY) as p:
        yield p


@pytest.fixture(scope="module")
def ngram() -> Iterator[Any]:
    with build("tiny", strategy="speculative", engine=STEADY,
               strategy_options={"num_draft_tokens": 4}) as p:
        yield p


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return draft_folder(tmp_path_factory.mktemp("draft") / "model", 2)


@pytest.fixture(scope="module")
def drafted(draft_dir: Path) -> Iterator[Any]:
    with build("tiny", strategy="speculative", engine=STEADY,
               strategy_options={"draft_model": str(draft_dir), "num_draft_tokens": 3}) as p:
        yield p


def events(c: Completion, kind: str) -> list[Event]:
    return [e for e in c.trace if e.event_type == kind]


def accepted(c: Completion) -> tuple[int, int]:
    verified = events(c, "spec.verified")
    return (sum(e.payload["accepted"] for e in verified),
            sum(e.payload["proposed"] for e in verified))


def ended_mid_block(c: Completion) -> bool:
    """Whether the run's last token came from a verifying call whose block went past it
    (so positions after the stop were verified, and must not have been emitted)."""
    trace = load(c)
    last = max(trace.by_step("token.selected"))
    source, _ = trace.sources()[last]
    if source.event_type != "decode.completed":
        return False
    fed = source.payload.get("token_ids", [source.payload["token_id"]])
    return last < source.payload["step"] + len(fed)


def same(a: Completion, b: Completion) -> None:
    assert b.token_ids == a.token_ids
    assert b.text == a.text
    assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)


# --- greedy: identical to plain decoding ---------------------------------------------------


@pytest.mark.parametrize("which", ["ngram", "drafted"])
def test_greedy_equals_plain_alone_and_batched(which: str, plain, request) -> None:
    spec = request.getfixturevalue(which)
    options = {"max_tokens": 48, "temperature": 0}
    want = [plain.generate(p, **options) for p in PROMPTS]
    for p, a in zip(PROMPTS, want):
        same(a, spec.generate(p, **options))
    handles = [spec.submit(p, **options) for p in PROMPTS]
    got = [h.result() for h in handles]
    for a, b in zip(want, got):
        same(a, b)
    taken, proposed = map(sum, zip(*(accepted(c) for c in got)))
    assert 0 < taken < proposed  # drafts were both accepted and rejected
    assert any(c.finish_reason.value == "eos" for c in got)


@pytest.mark.parametrize("which", ["ngram", "drafted"])
def test_endings_inside_a_block_emit_nothing_after_the_stop(which: str, plain, request) -> None:
    spec = request.getfixturevalue(which)
    mid = 0
    for p in PROMPTS[:6]:
        free = plain.generate(p, max_tokens=40, temperature=0, ignore_eos=True)
        half = len(free.token_ids) // 2
        text = free.text[len(free.text) // 2:][:3]
        cases: list[dict[str, Any]] = [
            {"max_tokens": half + 1},
            {"stop_token_ids": [free.token_ids[half]]},
            {"limits": RuntimeLimits(max_context_tokens=len(plain.tokenize(p)) + half)},
        ]
        if text.strip():
            cases.append({"stop": [text]})
        for case in cases:
            options = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, **case}
            a = plain.generate(p, **options)
            b = spec.generate(p, **options, recording="full")
            same(a, b)
            assert check(b).ok, check(b).render()
            mid += ended_mid_block(b)
    assert mid >= 3  # several runs really stopped with verified positions after the stop


def test_penalties_and_logprobs_see_each_positions_history(plain, ngram, drafted) -> None:
    options = {"max_tokens": 40, "temperature": 0, "repetition_penalty": 1.3,
               "presence_penalty": 0.4, "frequency_penalty": 0.3, "min_tokens": 12,
               "logprobs": True, "top_logprobs": 3}
    for p in PROMPTS[:5]:
        a = plain.generate(p, **options)
        for spec in (ngram, drafted):
            b = spec.generate(p, **options)
            same(a, b)
            assert a.logprobs is not None and b.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id
                assert abs(x.logprob - y.logprob) < 0.05  # logits may differ by an ulp
                assert [t.token_id for t in x.top] == [t.token_id for t in y.top]


def test_a_forced_prefix_is_drafted_and_kept(plain, ngram) -> None:
    prefix = plain.stages.tokenizer.encode_text("Sure, here it is: the sky")
    options = {"max_tokens": 24, "temperature": 0, "forced_prefix": list(prefix)}
    a = plain.generate(PROMPTS[0], **options)
    b = ngram.generate(PROMPTS[0], **options)
    same(a, b)
    assert b.token_ids[:len(prefix)] == tuple(prefix)
    forced = [e for e in events(b, "spec.drafted") if e.payload["proposer"] == "forced"]
    assert forced and forced[0].payload["step"] == 2


def test_the_default_model_with_ngram_drafts() -> None:
    prompts = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
               "Fix the typo in this line of code: pritn('hello world')",
               "List the days of the week."]
    with build(options={"num_slots": 2}) as plain:
        want = [plain.generate(p, max_tokens=24, temperature=0) for p in prompts]
        backend, tokenizer, renderer = (plain.engine.backend, plain.stages.tokenizer,
                                        plain.stages.renderer)
    with build(backend=backend, tokenizer=tokenizer, renderer=renderer,
               strategy="speculative") as spec:
        got = [spec.generate(p, max_tokens=24, temperature=0) for p in prompts]
    for a, b in zip(want, got):
        same(a, b)
    assert sum(accepted(c)[0] for c in got) > 0


# --- the trace ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(plain, ngram, drafted) -> list[Completion]:
    out = []
    for spec in (ngram, drafted):
        for p in PROMPTS[1:4]:
            out.append(spec.generate(p, max_tokens=32, temperature=0, recording="full"))
            out.append(spec.generate(p, max_tokens=32, temperature=0.8, top_p=0.9, seed=7,
                                     recording="digest"))
    return out


def test_speculative_traces_pass_every_invariant(runs, plain) -> None:
    decode = lambda ids: plain.stages.tokenizer.decode(ids)  # noqa: E731
    for c in runs:
        report = check(c, detokenize=decode)
        assert report.ok, report.render()
    assert any(events(c, "cache.rollback") for c in runs)


def test_cache_lengths_after_rejected_drafts(runs) -> None:
    seen = 0
    for c in runs:
        m = c.usage.prompt_tokens
        last_step, fed_len = 0, 0
        for e in c.trace:
            p = e.payload
            if e.event_type == "token.selected":
                last_step = p["step"]
            elif e.event_type == "decode.completed":
                fed_len = len(p.get("token_ids", [p["token_id"]]))
                assert p["cache_len"] == m + p["step"] - 1 + fed_len
            elif e.event_type == "spec.verified":
                rejected = p["rejected"]
            elif e.event_type == "cache.rollback":
                seen += 1
                assert p["positions"] == rejected > 0
                # the cache holds the prompt and every committed token but the last
                assert p["cache_len"] == m + last_step - 1
                assert set(p["layers"]["k"]) == set(p["layers"]["v"]) == {p["cache_len"]}
    assert seen >= 5


def _verified_draft(trace: tuple[Event, ...]) -> tuple[int, int]:
    """(event id, offset) of a decode.completed whose fed draft at that offset was accepted."""
    for e in trace:
        if e.event_type == "spec.verified" and e.payload["accepted"] > 0:
            call = max((d for d in trace if d.event_type == "decode.completed"
                        and d.event_id < e.event_id), key=lambda d: d.event_id)
            return call.event_id, 1
    raise AssertionError("no accepted draft in the trace")


def test_corrupt_speculative_traces_are_reported(runs) -> None:
    trace = next(c for c in runs if events(c, "cache.rollback")).trace
    bad = edit(trace, is_("cache.rollback"), lambda p: p.update(cache_len=p["cache_len"] + 1))
    assert 3 in check(bad).violated
    no_rollback = [e for e in trace if e.event_type != "cache.rollback"]
    assert 3 in check(no_rollback).violated
    full = next(c for c in runs if events(c, "spec.verified")
                and any(e.payload["accepted"] for e in events(c, "spec.verified"))
                and load(c).instance["recording"] == "full")
    call, offset = _verified_draft(full.trace)

    def swap(p: dict[str, Any]) -> None:
        p["token_ids"][offset] = (p["token_ids"][offset] + 1) % 6144
    wrong = edit(full.trace, lambda e: e.event_id == call, swap)
    report = check(wrong)
    assert 3 in report.violated and "assume draft" in report.render()


def test_diff_finds_the_first_divergence_inside_a_block(runs) -> None:
    full = next(c for c in runs if load(c).instance["recording"] == "full"
                and any(e.payload["accepted"] >= 2 for e in events(c, "spec.verified")))
    assert diff(full, full).divergence is None
    verified = next(e for e in events(full, "spec.verified") if e.payload["accepted"] >= 2)
    # block_logits[i] is z at step s + 1 + i for the call at step s (whose first draft is at
    # step s + 1): with two drafts accepted, the token at s + 3 was selected from [2]
    step = verified.payload["step"] + 2
    call = max((d for d in full.trace if d.event_type == "decode.completed"
                and d.event_id < verified.event_id), key=lambda d: d.event_id)

    def perturb(p: dict[str, Any]) -> None:
        p["block_logits"][2]["digest"] = "sha256:" + "0" * 64
    other = edit(full.trace, lambda e: e.event_id == call.event_id, perturb)
    report = diff(full, list(other))
    assert report.divergence is not None
    assert (report.divergence.product, report.divergence.step) == ("raw logits", step)
    assert report.shared_level == "input"


def test_sampled_runs_replay_and_depend_on_the_seed(ngram) -> None:
    p = PROMPTS[1]
    a = ngram.generate(p, max_tokens=32, temperature=0.9, seed=11, recording="full")
    b = ngram.generate(p, max_tokens=32, temperature=0.9, seed=11, recording="full")
    c = ngram.generate(p, max_tokens=32, temperature=0.9, seed=12, recording="full")
    assert a.token_ids == b.token_ids and diff(a, b).divergence is None
    assert diff(a, c).divergence.product == "rng"
    both = [ngram.submit(p, max_tokens=32, temperature=0.9, seed=s) for s in (11, 12)]
    assert [h.result().token_ids for h in both] == [a.token_ids, c.token_ids]


# --- lifecycle: cancellation, draft slots, failures ---------------------------------------


def scripted(draft: ScriptedBackend, delay: float = 0.0) -> tuple[Any, ScriptedBackend]:
    vocab = ByteTokenizer.VOCAB
    target = ScriptedBackend(vocab, hashed_logits(vocab, context=1, scale=2.0), num_slots=4,
                             delay_s=delay)
    pipe = build_scripted(target, strategy="speculative",
                          strategy_options={"draft_model": draft, "num_draft_tokens": 3})
    return pipe, target


def test_cancelling_mid_speculation_frees_both_models() -> None:
    vocab = ByteTokenizer.VOCAB
    draft = ScriptedBackend(vocab, hashed_logits(vocab, context=2, scale=2.0), num_slots=4)
    pipe, target = scripted(draft, delay=0.02)
    with pipe:
        handle = pipe.submit("hello there", max_tokens=400, temperature=0, ignore_eos=True,
                             recording="full")
        seen = 0
        for _ in handle.deltas():
            seen += 1
            if seen == 6:
                handle.cancel()
        c = handle.result(timeout=10)
        assert c.finish_reason.value == "cancelled"
        assert 0 < len(c.token_ids) < 400
        deadline = time.monotonic() + 5
        while (target.busy_slots or draft.busy_slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert target.busy_slots == 0 and draft.busy_slots == 0
        assert events(c, "spec.verified") and check(c).ok, check(c).render()


def test_a_failing_draft_model_only_turns_drafting_off() -> None:
    vocab = ByteTokenizer.VOCAB
    draft = ScriptedBackend(vocab, hashed_logits(vocab, context=1, scale=2.0), num_slots=4,
                            fail=lambda tokens: len(tokens) > 40)
    pipe, target = scripted(draft)
    reference = build_scripted(ScriptedBackend(vocab, hashed_logits(vocab, context=1,
                                                                    scale=2.0)))
    with pipe, reference:
        c = pipe.generate("hello there", max_tokens=60, temperature=0, ignore_eos=True)
        want = reference.generate("hello there", max_tokens=60, temperature=0, ignore_eos=True)
    assert c.token_ids == want.token_ids
    errors = [e for e in events(c, "spec.drafted") if "error" in e.payload]
    assert len(errors) == 1 and "draft model failed" in errors[0].payload["error"]
    assert draft.busy_slots == 0 and target.busy_slots == 0


# --- options ------------------------------------------------------------------------------


@pytest.mark.parametrize("options, error, words", [
    ({"num_draft_token": 4}, UnknownFieldError, "num_draft_tokens"),
    ({"num_draft_tokens": 0}, InvalidValueError, "1..64"),
    ({"num_draft_tokens": 4.5}, InvalidValueError, "integer"),
    ({"min_n": 3, "max_n": 2}, InvalidValueError, "max_n"),
    ({"proposer": "medusa"}, InvalidValueError, "ngram, draft"),
    ({"proposer": "draft"}, InvalidValueError, "needs a draft_model"),
    ({"proposer": "ngram", "draft_model": "tiny"}, InvalidValueError, "no draft model"),
    ({"draft_model": "tiny", "draft_options": {"slots": 2}}, UnknownFieldError, "num_slots"),
    ("fast", InvalidValueError, "mapping"),
])
def test_bad_options_are_clear_errors(options: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        build("tiny", strategy="speculative", strategy_options=options)


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    folder = draft_folder(tmp_path / "draft", 1)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidValueError, match="tokenizer is not the target's: token 30"):
        build("tiny", strategy="speculative",
              strategy_options={"draft_model": str(folder)})


def test_ngram_lookup_takes_the_longest_most_recent_match() -> None:
    def brute(tokens: list[int], k: int, max_n: int, min_n: int) -> tuple[int, ...]:
        for n in range(max_n, min_n - 1, -1):
            if len(tokens) <= n:
                continue
            for end in range(len(tokens) - 2, n - 2, -1):
                if tokens[end - n + 1:end + 1] == tokens[-n:]:
                    return tuple(tokens[end + 1:end + 1 + k])
        return ()

    rng = random.Random(3)
    config = GenerationConfig()
    for trial in range(200):
        max_n = rng.randint(1, 4)
        proposer = NgramProposer(max_n=max_n, min_n=rng.randint(1, max_n))
        prompt = tuple(rng.randrange(5) for _ in range(rng.randint(1, 12)))
        row = Row("r", config, prompt, (), 1, 0, frozenset())
        state = proposer.start(row)
        output: list[int] = []
        for _ in range(rng.randint(1, 10)):  # grow the output a few tokens at a time
            output += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
            row = Row("r", config, prompt, tuple(output), len(output) + 1, 0, frozenset())
            k = rng.randint(1, 5)
            got = proposer.propose([state], [row], [k])[0].ids
            assert got == brute([*prompt, *output], k, proposer.max_n, proposer.min_n)


def test_a_forced_token_ends_the_block_and_rejects_the_drafts_after_it() -> None:
    nxt = {3: 4, 4: 5, 5: 1, 1: 2, 2: 7, 7: 3, 8: 0, 0: 0}
    prompt = (1, 2, 3, 4, 5, 1, 2, 7)  # 7 opens a think block; 8 closes it

    def z(last: int) -> torch.Tensor:
        out = torch.zeros(9)
        out[nxt[last]] = 5.0
        return out

    strategy = SpeculativeStrategy(ProcessorChain([]), SamplingSelector(), NgramProposer(), 4)
    config = GenerationConfig(temperature=0)
    row = Row("r", config, prompt, (), 1, 0, frozenset())
    forcing = Forcing.for_request((), 2, (7, 8), prompt)  # at most 2 thinking tokens
    first = strategy.update([strategy.start(row, forcing)], [row], [z(7)[None]])[0]
    assert [t.token_id for t in first.taken] == [3]
    plan = strategy.plan(first.state)
    assert plan.token_ids == (3, 4, 5, 1, 2)  # y1, then what followed the earlier 3
    logits = torch.stack([z(t) for t in plan.token_ids])
    row = Row("r", config, prompt, (3,), 2, 0, frozenset())
    update = strategy.update([first.state], [row], [logits])[0]
    # 4 is accepted; the budget then forces 8 where the draft (and the model) said 5
    assert [t.token_id for t in update.taken] == [4, 8]
    assert update.taken[1].forced is not None
    assert update.taken[1].forced[0] == "reasoning.budget_reached"
    assert update.rollback == 3
    assert update.events[0][1] == {"step": 2, "proposed": 4, "accepted": 1, "rejected": 3}


def test_strategy_options_without_a_strategy_that_takes_them_are_refused() -> None:
    with pytest.raises(InvalidValueError, match="takes no options"):
        build("tiny", strategy_options={"num_draft_tokens": 4})
