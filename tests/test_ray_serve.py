"""Replicas behind Ray Serve (:mod:`transports.ray_serve`), on a local Ray, with a shared
PostgreSQL usage store.

Two replicas of the server (the tiny model) behind Ray Serve's proxy answer 200 concurrent
requests from the official OpenAI and Anthropic SDKs, streamed and not, with zero errors, and
PostgreSQL — a real server the test starts (:mod:`tests.test_usage_postgres`) — holds exactly one
usage row for each response id. A request naming a model no replica serves is the gateway's
404. Oracles: the SDKs' own parsing, the rows PostgreSQL returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.model_paths import TINY_MODEL_DIR
from tests.http_support import free_port
from tests.test_usage_postgres import Server, server  # noqa: F401  (the PostgreSQL fixture)
from transports.http import ServerConfig
from transports.http.usage_postgres import read_records

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def served(server: Server, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
           ) -> Iterator[tuple[str, Path]]:
    from transports.ray_serve import deployment

    server.clear()
    data = tmp_path_factory.mktemp("replicas")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(models={"default": TINY_MODEL_DIR}, data_dir=data, num_slots=8,
                              usage_database=server.url)
        serve.run(deployment(config, num_replicas=2).bind(), route_prefix="/")
        yield f"http://127.0.0.1:{port}", data
    finally:
        serve.shutdown()
        ray.shutdown()


async def _ask(url: str, i: int) -> str:
    """Request ``i`` through an SDK: OpenAI or Anthropic, streamed or not; its response id."""
    messages = [{"role": "user", "content": f"Say something about the number {i}."}]
    if i % 2 == 0:
        client: Any = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            if i % 4 == 0:
                stream = await client.chat.completions.create(
                    model="default", messages=messages, max_tokens=4, stream=True)
                ids = {chunk.id async for chunk in stream}
                assert len(ids) == 1
                return ids.pop()
            done = await client.chat.completions.create(model="default", messages=messages,
                                                        max_tokens=4)
            assert done.usage.completion_tokens <= 4
            rid: str = done.id
            return rid
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    async with client:
        if i % 4 == 1:
            async with client.messages.stream(model="default", messages=messages,
                                              max_tokens=4) as stream:
                final = await stream.get_final_message()
            return str(final.id)
        message = await client.messages.create(model="default", messages=messages, max_tokens=4)
        return str(message.id)


def test_two_replicas_answer_200_sdk_requests_each_recorded_once(
        served: tuple[str, Path], server: Server) -> None:  # noqa: F811
    url, data = served

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(_ask(url, i) for i in range(200)))

    ids = asyncio.run(all_of_them())  # an SDK error would raise here: zero errors
    assert len(set(ids)) == 200
    rows = read_records(server.url)
    assert sorted(r.request_id for r in rows) == sorted(ids)  # exactly one row each
    assert {r.endpoint for r in rows} == {"chat.completions", "messages"}
    assert len(list(data.glob("replica-*"))) == 2  # two servers, each its own data dir


def test_a_model_no_replica_serves_is_the_gateways_404(served: tuple[str, Path]) -> None:
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="default"):
        client.chat.completions.create(model="nope", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
