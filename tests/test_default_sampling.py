"""The sampling a request gets when it names none: answers that end, one ``max_tokens``.

The defaults were chosen by measuring (``benchmarks/loops.py``, docs/performance.md, "Loops
at the defaults"); these tests pin what the choice promises on the default model itself:
the question whose answers looped at the old defaults (temperature 0.2, top_p 0.9, no guard)
now ends by itself, and the same seeds without the guard still loop, so the test sees the
defect it guards against. The loop oracle is the answer-quality rubric's own loop rule
(``benchmarks/answer_quality.py``: the same run of 6 words three times, or the same line
four times), not the guard's arithmetic."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from pipeline import build
from pipeline.pipe import Pipeline
from pipeline.sampling_defaults import PIPELINE_DEFAULT
from pipeline.testing import ScriptedBackend, build_scripted
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import DEFAULT_MAX_TOKENS, GenerationConfig
from transports.http.dialects.common import ServerDefaults
from transports.http.server.config import ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from answer_quality import faults  # noqa: E402

QUESTION = "What is the capital of France?"
LOOPED = (1, 2)
"""Seeds whose answer to QUESTION began "L'Étoile, la Marseillaise, la femme, la femme au
martyre" and repeated that to the limit at the old defaults (seen in the issue and here)."""


@pytest.fixture()
def pipe() -> Iterator[Pipeline]:
    with build(options={"num_slots": 4}) as p:
        yield p


def test_the_default_model_recommends_nothing_so_the_pipeline_default_applies(
        pipe: Pipeline) -> None:
    assert pipe.defaults_source == "pipeline default"
    assert pipe.defaults == GenerationConfig(**PIPELINE_DEFAULT)
    assert pipe.defaults.dry_multiplier > 0          # the loop guard is on


def test_answers_that_looped_at_the_old_defaults_now_end(pipe: Pipeline) -> None:
    old = {"dry_multiplier": 0.0, "temperature": 0.2, "top_p": 0.9, "min_p": 0.0}
    handles = [(seed, pipe.submit(QUESTION, seed=seed, max_tokens=256, **old),
                pipe.submit(QUESTION, seed=seed)) for seed in LOOPED]
    for seed, before, now in handles:
        looped, ended = before.result(), now.result()
        assert looped.finish_reason is FinishReason.LENGTH, (seed, looped.text)
        assert "repetition" in faults(looped.text), (seed, looped.text)
        assert ended.finish_reason is FinishReason.EOS, (seed, ended.text)
        assert "repetition" not in faults(ended.text), (seed, ended.text)


def _endless(tokens: Sequence[int]) -> torch.Tensor:
    """A model that never ends: byte "a" (97) far ahead of everything else."""
    out = torch.zeros(300)
    out[97 + len(tokens) % 20] = 9.0                 # a slow cycle, never an end
    return out


def test_one_default_max_tokens_for_the_library_the_command_line_and_the_server(
        tmp_path: Path) -> None:
    assert GenerationConfig().max_tokens == DEFAULT_MAX_TOKENS
    assert ServerDefaults().max_tokens == DEFAULT_MAX_TOKENS
    assert ServerConfig({"default": None}, data_dir=tmp_path).default_max_tokens == \
        DEFAULT_MAX_TOKENS
    with build_scripted(ScriptedBackend(300, _endless, max_context=4096)) as scripted:
        done = scripted.generate("go", temperature=0)
    assert done.finish_reason is FinishReason.LENGTH
    assert done.usage.completion_tokens == DEFAULT_MAX_TOKENS


def test_the_server_fills_the_loop_guard_like_the_library(pipe: Pipeline, tmp_path: Path
                                                          ) -> None:
    """Through the OpenAI SDK: a body that leaves the guard out gets the pipeline's (the
    answer ends, as in the library), and one that turns it off (``dry_multiplier: 0``, an
    extension field as llama.cpp spells it) loops as before."""
    import openai

    from tests.http_support import config, running
    from transports.http import Gateway

    library = pipe.generate(QUESTION, seed=LOOPED[0], max_tokens=256).text
    with running(Gateway(config(tmp_path), lambda f, c: pipe)) as url:      # closes pipe
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        ask = [{"role": "user", "content": QUESTION}]
        guarded = client.chat.completions.create(model="default", messages=ask,  # type: ignore[arg-type]
                                                 seed=LOOPED[0], max_tokens=256)
        off = client.chat.completions.create(model="default", messages=ask,  # type: ignore[arg-type]
                                             seed=LOOPED[0], max_tokens=256,
                                             extra_body={"dry_multiplier": 0})
    assert guarded.choices[0].finish_reason == "stop", guarded.choices[0].message.content
    assert off.choices[0].finish_reason == "length"
    assert guarded.choices[0].message.content == library


def test_the_servers_defaults_line_names_what_still_acts_when_greedy() -> None:
    """At temperature 0 the truncation fields skip the row (argmax-invariant processors) but
    the loop guard and the penalties do not (the chain's own ``order_for`` is the oracle)."""
    from pipeline.sampling_defaults import sampling_summary
    from stages.process import DEFAULT_ORDER, ProcessorChain, make_processor
    from pipeline.contracts.decode import Row

    config = GenerationConfig(temperature=0, top_p=0.9, dry_multiplier=0.8,
                              repetition_penalty=1.1)
    row = Row("r", config, (1,), (1, 2, 3), 4, 0, frozenset({0}))
    acting = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER]).order_for(row)
    line = sampling_summary(config)
    assert acting == ("repetition_penalty", "dry")
    assert line == "greedy (temperature 0), repetition_penalty 1.1, dry_multiplier 0.8"
