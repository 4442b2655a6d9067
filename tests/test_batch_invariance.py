"""Alone vs batched: a greedy or seeded request gives the same tokens whatever runs beside it.

The oracle is the request itself run alone (docs/design.md §9's reproducibility levels rest on it):
24 seeds per strategy and dtype, a third of them greedy and the rest sampled at other
temperatures and truncations, run one at a time in one pipeline, then all at once in another
whose engine cuts prompts into small chunks under a small token budget, while their shared
prefix hits the prefix cache. The tokens must be identical, in float32 and bfloat16, for every
strategy the library ships (and in float16 for one strategy of each family). The kernels' own row invariance is checked on its own too: a
product's rows, and a prompt position's attention, against the same computed in other company.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F

from backends.torch.invariant import GRID, grid_attention, tiled_rows
from pipeline import build
from pipeline.engine import EngineConfig
from pipeline.options import BackendOptions
from pipeline.pipe import Pipeline
from tests.http_support import config, running
from transports.http import Gateway

SEEDS = 24
"""Requests per autoregressive case: every sampling setting of ``_config`` (period 12) with
two prompt lengths each."""
ITERATIVE_SEEDS = 12
"""Requests per iterative case (masked diffusion, continuous diffusion, flow), whose every
request costs many model calls: each sampling setting once."""
STRATEGIES = [
    ("tiny", "autoregressive"), ("tiny", "speculative"),
    ("tiny-masked", "llada"), ("tiny-masked", "fast_dllm"), ("tiny-masked", "dfm"),
    ("tiny-continuous", "ddpm"), ("tiny-continuous", "ddim"), ("tiny-flow", "flow"),
]
CHOPPED = EngineConfig(token_budget=24, max_prefill_chunk=13)
"""The batched pipeline's engine: prompts cut into chunks of at most 13 tokens, and fewer
when other requests take the step's budget."""
SHARED = "The old lighthouse keeper wrote in his log every night before the storm came in: "


def _config(i: int) -> dict[str, Any]:
    """Request i's sampling: greedy rows, and seeded rows at other temperatures/truncations."""
    if i % 3 == 0:
        return {"temperature": 0.0}
    return {"temperature": (0.6, 0.9, 1.3)[i % 3 - 1 + (i // 3) % 2],
            "top_k": (0, 5, 40)[i % 3], "top_p": (1.0, 0.9)[(i // 2) % 2], "seed": 1000 + i}


def _prompt(i: int) -> str:
    return SHARED + f"entry {i}, " + "the wind " * (i % 5)


def _pipelines(model: str, strategy: str, dtype: str) -> Iterator[tuple[Pipeline, Pipeline]]:
    opts = BackendOptions(dtype=dtype)  # the default: batch-invariant on CPU
    with build(model, strategy=strategy, options=opts) as alone, \
            build(model, strategy=strategy, options=opts, engine=CHOPPED) as batched:
        yield alone, batched


CASES = [(m, s, d) for d in ("float32", "bfloat16") for m, s in STRATEGIES] + [
    ("tiny", "autoregressive", "float16"), ("tiny-masked", "llada", "float16"),
    ("tiny-flow", "flow", "float16")]
"""Every strategy in float32 and bfloat16; one of each family in float16 too."""


@pytest.mark.parametrize(("model", "strategy", "dtype"), CASES)
def test_alone_and_batched_give_the_same_tokens(model: str, strategy: str, dtype: str) -> None:
    count = SEEDS if model == "tiny" else ITERATIVE_SEEDS
    for alone, batched in _pipelines(model, strategy, dtype):
        assert alone.model_info().dtype == dtype
        solo = [alone.generate(_prompt(i), max_tokens=16, **_config(i)).token_ids
                for i in range(count)]
        handles = [batched.submit(_prompt(i), max_tokens=16, **_config(i))
                   for i in range(count)]
        together = [h.result(timeout=300).token_ids for h in handles]
        differ = [i for i in range(count) if solo[i] != together[i]]
        assert not differ, f"{len(differ)} of {count} differ alone vs batched: {differ}"


def _declared(pipeline: Pipeline) -> Any:
    trace = pipeline.generate("hi", max_tokens=1).trace
    return next(e.payload for e in trace if e.event_type == "request.normalized")["batch_invariant"]


def test_the_trace_declares_batch_invariance() -> None:
    with build("tiny", options=BackendOptions(batch_invariant=False)) as off, \
            build("tiny") as on:
        assert _declared(on) is True
        assert _declared(off) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tiled_products_rows_do_not_depend_on_their_company(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 192, generator=gen).to(dtype)
    x = torch.randn(70, 192, generator=gen).to(dtype)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, weight)

    alone = torch.cat([tiled_rows(x[i:i + 1], product, 8) for i in range(70)])
    for count in (2, 7, 8, 9, 33, 70):
        assert torch.equal(tiled_rows(x[:count], product, 8), alone[:count]), count
    assert torch.equal(tiled_rows(x[5:20], product, 8), alone[5:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 37])
def test_a_prompt_positions_attention_does_not_depend_on_its_chunk(
        dtype: torch.dtype, window: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 2 * GRID + 40, 6, 2, 32
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
    whole = grid_attention(q, k, v, 0, window)
    for cuts in ([1], [13, 64], [GRID - 1, GRID + 1], [100, 101, 150]):
        bounds = [0, *cuts, n]
        pieces = [grid_attention(q[a:b], k[:, :, :b], v[:, :, :b], a, window)
                  for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(pieces), whole), cuts
    # ... and it is attention: torch's kernel on the whole prompt, up to rounding
    from backends.torch.model import attend

    reference = attend(q.float(), k.float(), v.float(), 0, window)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    assert torch.allclose(whole.float(), reference, atol=tol, rtol=tol)


def test_over_http_sixteen_concurrent_clients_get_what_each_gets_alone(tmp_path: Path) -> None:
    """The served tiny model (bfloat16, its own dtype): 16 clients with a shared system prompt,
    greedy and seeded, alone one after another, then all at once: the same answers."""
    gateway = Gateway(config(tmp_path))

    def body(i: int) -> dict[str, Any]:
        sampling = ({"temperature": 0} if i % 2 == 0 else
                    {"temperature": (0.7, 1.1)[i % 4 // 2], "top_p": 0.95, "seed": 7 + i,
                     "top_k": 20})
        return {"model": "default", "max_tokens": 24, **sampling,
                "messages": [{"role": "system", "content": SHARED * 2},
                             {"role": "user", "content": f"Question {i}: what did he see?"}]}

    def ask(url: str, i: int) -> str:
        r = httpx.post(f"{url}/v1/chat/completions", json=body(i), timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    with running(gateway) as url:
        alone = [ask(url, i) for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda i: ask(url, i), range(16)))
    differ = [i for i in range(16) if alone[i] != together[i]]
    assert not differ, f"{len(differ)} of 16 differ alone vs concurrent: {differ}"


def test_the_diff_says_when_a_model_level_divergence_may_come_from_batching() -> None:
    """The same request on the same weights, batch-invariant products vs library products:
    the raw logits differ in their last bits, and the diff names the run that did not declare
    batch invariance; between two invariant runs nothing differs."""
    from pipeline.trace import diff

    with build("tiny", options=BackendOptions(dtype="float32", batch_invariant=False)) as off, \
            build("tiny", options=BackendOptions(dtype="float32")) as on:
        ask = {"max_tokens": 4, "temperature": 0.0}
        a = on.generate("Once upon a time", **ask).trace
        b = off.generate("Once upon a time", **ask).trace
        c = on.generate("Once upon a time", **ask).trace
    report = diff(a, b)
    assert report.divergence is not None and report.divergence.level == "model"
    assert report.batch_invariant == (True, False)
    assert "run B did not declare batch invariance" in report.render()
    same = diff(a, c)
    assert same.divergence is None and same.caveat() is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompts_logits_do_not_depend_on_how_it_was_chunked(dtype: str) -> None:
    """The backend itself: the same prompt prefilled whole, in uneven chunks, and with a last
    chunk of one token (a prefix-cache hit can leave one), beside a decoding sequence or alone,
    gives bit-identical logits at its last position."""
    from backends.torch.backend import TorchBackend
    from pipeline.contracts.model import ModelCall, PrefillChunk

    with build("tiny", options=BackendOptions(dtype=dtype)) as p:
        engine: Any = p.engine.backend  # type: ignore[union-attr]
        # a backend of its own over the engine's model (the engine's manages its blocks)
        backend = TorchBackend(engine.model, engine.snapshot, num_slots=2, max_context=256)
        ids = tuple(p.tokenize(SHARED * 6).input_ids)[:90]
        assert len(ids) == 90

        def last_logits(cuts: list[int], beside: bool) -> torch.Tensor:
            slot, other = backend.allocate(), backend.allocate()
            try:
                backend.prefill([PrefillChunk(other, ids[:5], 0, True)])
                bounds = [0, *cuts, len(ids)]
                for a, b in zip(bounds, bounds[1:]):
                    calls = [ModelCall.chunk(PrefillChunk(slot, ids[a:b], a, b == len(ids)))]
                    if beside:
                        calls.append(ModelCall(other, (ids[0],), backend.cache.lengths[other],
                                               (0,)))
                    out = backend.forward(calls)
                return out[0]
            finally:
                backend.release(slot)
                backend.release(other)

        whole = last_logits([], False)
        for cuts, beside in (([89], False), ([89], True), ([13, 64], True), ([30, 31], False)):
            assert torch.equal(last_logits(cuts, beside), whole), (cuts, beside)
