"""The capability model: what each strategy says it keeps of a request, checked at submit.

Every built-in strategy declares :class:`~pipeline.contracts.strategy.Honours`. The oracle for a
declaration is the output itself, not the declaration: a strategy that says it keeps a forced
prefix must begin its output with it, one that says it keeps logprobs must give one per
token for the token it committed, one that says it keeps a grammar must end in text the
grammar accepts (JSON here, checked by ``json.loads``). What a strategy does not keep is
refused when the request is submitted, naming the field, and nothing reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import attrs
from typing import Any

import pytest

from pipeline import Honours, Strategy, build, hookimpl
from pipeline.errors import InvalidValueError, RegistryError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.registry import Component
from pipeline.contracts.request import GenerationConfig
from stages.strategies.autoregressive import AutoregressiveStrategy

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("tiny", "autoregressive"), ("tiny", "speculative"), ("tiny-masked", "llada"),
         ("tiny-masked", "fast_dllm"), ("tiny-masked", "dfm"), ("tiny-continuous", "ddim"),
         ("tiny-flow", "flow")]

PREFIX = (40, 41, 42)


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}:{s}" for m, s in CASES])
def pipe(request: pytest.FixtureRequest) -> Iterator[Pipeline]:
    model, strategy = request.param
    with build(model, strategy=strategy, options={"dtype": "float32"}) as built:
        yield built


def honours(pipe: Pipeline) -> Honours:
    assert pipe.engine is not None
    strategy = pipe.engine.strategy(None)
    assert isinstance(strategy, Strategy)
    return strategy.honours


def test_what_a_strategy_says_it_keeps_it_keeps(pipe: Pipeline) -> None:
    kept = honours(pipe)
    common: dict[str, Any] = {"max_tokens": 8, "seed": 3, "ignore_eos": True}
    if kept.forced_prefix:
        c = pipe.generate("hi", forced_prefix=PREFIX, **common)
        assert c.token_ids[:len(PREFIX)] == PREFIX
    if kept.logprobs:
        c = pipe.generate("hi", logprobs=True, **common)
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
        assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
        assert all(lp.logprob <= 0 for lp in c.logprobs)
    if kept.grammar:
        c = pipe.generate("hi", json_object=True, max_tokens=24, seed=3)
        assert isinstance(json.loads(c.text), dict)
    if kept.reasoning_budget:  # accepted (these models have no think markers to force)
        assert len(pipe.generate("hi", reasoning_budget_tokens=2, **common).token_ids) == 8


def test_what_a_strategy_does_not_keep_is_refused_at_submit(pipe: Pipeline) -> None:
    kept = honours(pipe)
    asks: list[tuple[str, dict[str, Any], str]] = [
        ("grammar", {"json_object": True}, "json_object"),
        ("forced_prefix", {"forced_prefix": PREFIX}, "forced_prefix"),
        ("reasoning_budget", {"reasoning_budget_tokens": 4}, "reasoning_budget_tokens"),
        ("logprobs", {"logprobs": True}, "logprobs"),
    ]
    assert pipe.engine is not None
    for control, ask, field in asks:
        if getattr(kept, control):
            continue
        with pytest.raises(InvalidValueError) as caught:
            pipe.submit("hi", max_tokens=4, **ask)
        assert caught.value.field == field
        assert repr(pipe.engine.strategy(None).name) in str(caught.value)
        assert pipe.engine.queue_depth == 0 and pipe.engine.active_slots == 0
        # a prepared request's copy that adds the control is refused the same way
        prepared = pipe.prepare("hi", max_tokens=4)
        config = pipe.request("hi", max_tokens=4, **ask).generation_config
        with pytest.raises(InvalidValueError) as caught:
            pipe.submit(prepared.with_request(attrs.evolve(prepared.request,
                                                           generation_config=config)))
        assert caught.value.field == field


def test_the_declarations_of_the_built_in_strategies() -> None:
    # the model of each family: token-at-a-time strategies keep everything; masked diffusion
    # commits a block's positions in order (forcing works) but predicts them at once (no
    # grammar); continuous strategies denoise embeddings (no forced token, no grammar)
    assert Honours.ALL == Honours(True, True, True, True)
    assert Honours(logprobs=True).refusal(GenerationConfig(), "x") is None
    refused = Honours(logprobs=True).refusal(GenerationConfig(forced_prefix=(5,)), "flow")
    assert refused is not None and refused.field == "forced_prefix"
    assert "'flow' strategy cannot force output tokens" in str(refused)


class Silent:
    """A third party's strategy that does not declare what it keeps (autoregressive inside)."""

    name = "silent"

    def __init__(self, chain: Any, selector: Any) -> None:
        self.inner = AutoregressiveStrategy(chain, selector)
        self.order, self.start, self.plan = self.inner.order, self.inner.start, self.inner.plan
        self.update, self.finish = self.inner.update, self.inner.finish


class SilentPlugin:
    @hookimpl
    def pipeline_components(self) -> list[Component]:
        return [Component("strategy", "silent", lambda ctx: Silent)]


def test_a_strategy_that_declares_nothing_is_named() -> None:
    with build(TINY_MODEL_DIR, strategy="silent", plugins=[SilentPlugin()]) as p:
        with pytest.raises(RegistryError, match="'silent'.*honours"):
            p.submit("hi", max_tokens=2)


def test_build_takes_a_strategy_instance() -> None:
    from stages.process import DEFAULT_ORDER, ProcessorChain, make_processor
    from stages.select.greedy import GreedySelector

    chain = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER])
    mine = AutoregressiveStrategy(chain, GreedySelector())
    with build("tiny", strategy=mine) as p, build("tiny") as named:
        assert p.engine is not None and p.engine.strategy(None) is mine
        got = p.generate("hi", max_tokens=6, temperature=0, ignore_eos=True)
        assert got.token_ids == named.generate("hi", max_tokens=6, temperature=0,
                                               ignore_eos=True).token_ids
        with pytest.raises(InvalidValueError) as caught:
            p.submit("hi", max_tokens=2, processor_order=("temperature",))
        assert caught.value.field == "processor_order"
    with pytest.raises(InvalidValueError) as caught:
        build("tiny", strategy=mine, steps=4)
    assert caught.value.field == "steps"
    with pytest.raises(InvalidValueError) as caught:
        build("tiny", strategy=object())  # type: ignore[arg-type]
    assert caught.value.field == "strategy"
