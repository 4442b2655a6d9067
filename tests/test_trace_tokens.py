"""Trace reports a reader can follow, on real runs of the default model: where the answers'
committed tokens first differ (both tokens, their text and probabilities) next to the earliest
internal difference, token text in ``trace show``, and ``trace check`` finding the tokenizer
of a trace the default model wrote.

The oracles are outside the trace tools: the completions' own token ids and logprobs, a
separate run that forces the agreed prefix and then takes one token at temperature 1 with no
other processor (its logprobs are the model's raw distribution there), and the default
model's tokenizer loaded alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline import build
from pipeline.tokenizing import load_tokenizer
from pipeline.events import digest_text, event_line
from pipeline.trace import check, diff, load, show
from pipeline.trace.commands import main
from pipeline.contracts.output import Completion

PROMPT = "hi"
SAMPLING = {"temperature": 0.2, "max_tokens": 8}


def _run(pipe, seed: int, **options) -> Completion:
    return pipe.generate(PROMPT, **{**SAMPLING, "seed": seed, **options})


def _first_difference(a: Completion, b: Completion) -> int | None:
    """The 0-based index of the first different committed token (or of the first token
    only one run has), from the completions' own ids."""
    x, y = list(a.token_ids), list(b.token_ids)
    return next((i for i in range(max(len(x), len(y)))
                 if i >= len(x) or i >= len(y) or x[i] != y[i]), None)


@pytest.fixture(scope="module")
def runs():
    """Full traces of seeds until two differ in their tokens after a shared prefix and two
    give the same tokens; digest-level traces of the differing pair; a shorter run of A."""
    with build() as pipe:
        full: dict[int, Completion] = {}
        differ = same = None
        for seed in range(1, 9):
            full[seed] = _run(pipe, seed, recording="full", logprobs=True, top_logprobs=5)
            for other in list(full)[:-1]:
                at = _first_difference(full[other], full[seed])
                if at is None:
                    same = same or (other, seed)
                elif at > 0:
                    differ = differ or (other, seed)
            if differ and same:
                break
        assert differ and same, f"no usable seeds: {[c.text for c in full.values()]}"
        a, b = full[differ[0]], full[differ[1]]
        at = _first_difference(a, b)
        # the model's own distribution after the agreed prefix: the prefix forced through
        # the same decode steps, then one token at temperature 1 with no other processor
        raw = pipe.generate(PROMPT, forced_prefix=list(a.token_ids[:at]), max_tokens=at + 1,
                            temperature=1.0, processor_order=("temperature",), logprobs=True,
                            top_logprobs=20)
        yield {
            "a": a, "b": b, "at": at, "raw": raw.logprobs[at],
            "same": (full[same[0]], full[same[1]]),
            "digest": [_run(pipe, seed, recording="digest") for seed in differ],
            "short": _run(pipe, differ[0], recording="full", max_tokens=at + 1),
            "seeds": differ,
        }


def _raw_oracle(raw, token: int) -> float | None:
    """The model's own probability of ``token`` after the agreed prefix (None when it is
    not among the one-token run's top 20)."""
    return next((math.exp(t.logprob) for t in raw.top if t.token_id == token), None)


def test_the_report_names_the_first_different_committed_token(runs) -> None:
    a, b, at = runs["a"], runs["b"], runs["at"]
    report = diff(a, b)
    found = report.first_token
    assert found is not None and found.step == at + 1 and found.agree_tokens == at
    for side, run in ((found.a, a), (found.b, b)):
        assert side.token_id == run.token_ids[at]
        assert side.text == run.logprobs[at].text
        # after the sampling settings: the completion's own logprob of its token
        assert side.processed_prob == pytest.approx(math.exp(run.logprobs[at].logprob),
                                                    rel=1e-4, abs=1e-6)
    # raw: the model's distribution after the agreed prefix, from a separate run (A's
    # prefix is B's too); within the recorded top-8 exactly, outside it bounded
    for side in (found.a, found.b):
        want = _raw_oracle(runs["raw"], side.token_id)
        if side.raw_prob is not None:
            assert want is not None and side.raw_prob == pytest.approx(want, rel=1e-4)
        else:
            assert side.raw_prob_at_most is not None
            assert want is None or want <= side.raw_prob_at_most * (1 + 1e-4)
    assert found.missing is None


def test_the_report_does_not_read_as_a_contradiction(runs) -> None:
    a, b, at = runs["a"], runs["b"], runs["at"]
    report = diff(a, b)
    d = report.divergence
    assert (d.product, d.step) == ("rng", 1)
    text = report.render()
    assert "first divergence" not in text
    tokens = (json.dumps(a.logprobs[at].text, ensure_ascii=False),
              json.dumps(b.logprobs[at].text, ensure_ascii=False))
    line = next(x for x in text.splitlines() if x.startswith("the answers agree for"))
    assert f"for {at} token" in line and f"first different token at step {at + 1}" in line
    assert f"A {tokens[0]}" in line and f"vs B {tokens[1]}" in line
    assert "raw" in line and "after sampling settings" in line
    earliest = next(x for x in text.splitlines() if x.startswith("earliest internal"))
    assert "(rng) at step 1 (selection level)" in earliest
    assert (f"it changed no token until step {at + 1}" in earliest) == (at + 1 > 1)


def test_the_json_report_has_first_token(runs) -> None:
    a, b, at = runs["a"], runs["b"], runs["at"]
    body = json.loads(json.dumps(diff(a, b).to_json()))
    first = body["first_token"]
    assert first["step"] == at + 1 and first["agree_tokens"] == at
    for key, run in (("a", a), ("b", b)):
        side = first[key]
        assert {"token_id", "text", "raw_prob", "processed_prob"} <= set(side)
        assert side["token_id"] == run.token_ids[at] and side["text"] == run.logprobs[at].text
    assert body["divergence"]["product"] == "rng"   # the existing keys stay


def test_tokens_that_never_differ_are_said_to_agree(runs) -> None:
    x, y = runs["same"]
    assert list(x.token_ids) == list(y.token_ids)
    report = diff(x, y)
    assert report.first_token is None and report.to_json()["first_token"] is None
    assert report.divergence is not None and report.divergence.product == "rng"
    text = report.render()
    assert f"the answers agree on all {len(x.token_ids)} tokens" in text
    assert "it changed no token" in text


def test_a_run_that_stopped_earlier_is_a_prefix(runs) -> None:
    a, short, at = runs["a"], runs["short"], runs["at"]
    assert list(short.token_ids) == list(a.token_ids[:at + 1]) and len(a.token_ids) > at + 1
    report = diff(short, a)
    found = report.first_token
    assert found.step == at + 2 and found.agree_tokens == at + 1
    assert found.a is None and found.ended == short.finish_reason.value
    assert found.b.token_id == a.token_ids[at + 1] and found.b.text == a.logprobs[at + 1].text
    assert report.to_json()["first_token"]["a"] is None
    assert f"then run A ended ({short.finish_reason.value}) and run B went on" in report.render()


def _write(path: Path, completion: Completion) -> str:
    path.write_text("".join(event_line(e) + "\n" for e in completion.trace))
    return str(path)


def test_digest_traces_say_what_is_missing_and_how_to_get_it(runs, tmp_path, capsys) -> None:
    a, b, at = runs["a"], runs["b"], runs["at"]
    da, db = runs["digest"]
    assert list(da.token_ids) == list(a.token_ids) and list(db.token_ids) == list(b.token_ids)
    found = diff(da, db).first_token
    assert found.step == at + 1
    assert (found.a.token_id, found.b.token_id) == (a.token_ids[at], b.token_ids[at])
    assert found.a.raw_prob is None and found.a.processed_prob is None
    assert "--record full" in found.missing
    # the command line finds the default model's tokenizer for the text
    files = _write(tmp_path / "a.jsonl", da), _write(tmp_path / "b.jsonl", db)
    assert main(["diff", *files]) == 1
    out = capsys.readouterr().out
    assert all(json.dumps(r.logprobs[at].text, ensure_ascii=False) in out for r in (a, b))
    assert "record with --record full" in out


def test_show_lists_token_text(runs, tmp_path, capsys) -> None:
    a = runs["a"]
    texts = [lp.text for lp in a.logprobs]
    for source, label in ((a, "full"), (runs["digest"][0], "digest")):
        if label == "digest":     # the command line labels a digest trace with the tokenizer
            assert main(["show", _write(tmp_path / "d.jsonl", source)]) == 0
            out = capsys.readouterr().out
        else:                     # a full trace holds the text itself
            out = show(source)
        lines = [x for x in out.splitlines() if " token.selected " in x]
        assert len(lines) == len(texts)
        for line, token, text in zip(lines, a.token_ids, texts):
            assert f"token_id={token} text={text!r}" in line, (label, line)


def test_check_finds_the_default_models_tokenizer(runs, tmp_path, capsys) -> None:
    a, digest = runs["a"], runs["digest"][0]
    # the oracle: the default model's tokenizer, loaded alone, is the traces' own
    assert load_tokenizer()[0].digest == load(digest).instance["tokenizer_version"]
    assert main(["check", _write(tmp_path / "d.jsonl", digest)]) == 0
    assert "note:" not in capsys.readouterr().out
    path = _write(tmp_path / "f.jsonl", a)
    assert main(["check", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokenizer_note"] is None
    assert not [n for n in report["notes"] if n["invariant"] == 5]
    # the tokenizer is really used: a streamed text changed with its digests is caught
    lines = Path(path).read_text().splitlines()
    events = [json.loads(x) for x in lines]
    delta = next(e for e in events if e["event_type"] == "stream.delta"
                 and len(e["payload"]["text"]) >= 2)
    old = delta["payload"]["text"]
    new = old[:-1] + ("x" if old[-1] != "x" else "y")
    delta["payload"].update(text=new, digest=digest_text(new))
    end = next(e for e in events if e["event_type"] == "generation.finished")
    end["payload"]["text_digest"] = digest_text(a.text.replace(old, new, 1))
    Path(path).write_text("".join(json.dumps(e) + "\n" for e in events))
    assert check(path).ok   # without a tokenizer the change passes unseen
    assert main(["check", path]) == 1
    assert "is not a prefix of the detokenized tokens" in capsys.readouterr().out
