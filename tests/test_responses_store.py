"""Stored responses: ``GET`` and ``DELETE /v1/responses/{id}`` through the official ``openai``
SDK (``client.responses.retrieve``, ``client.responses.delete``), on 127.0.0.1.

A stored response comes back as ``POST /v1/responses`` answered it (streamed or not), only to
a key that made it; deleting it forgets it for ``GET`` and for ``previous_response_id``;
anything not kept for the caller is a 404 in OpenAI's error shape. Oracles: the SDK (it parses
the objects into its own types and raises its own ``NotFoundError`` for a 404), the answer the
creation itself returned, and the OpenAPI document, checked with ``jsonschema``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.http_support import config, polite_model, running
from transports.http import Gateway, ServerConfig
from transports.http.dialects.openapi import openapi_document

KEY, OTHER_KEY = "sk-maker", "sk-other"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    def builder(folder: Path | None, cfg: ServerConfig) -> Any:
        return polite_model()

    cfg = config(tmp_path_factory.mktemp("stored"), api_keys={KEY, OTHER_KEY})
    with running(Gateway(cfg, builder)) as url:
        yield url


def _client(base_url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


def _not_found(err: pytest.ExceptionInfo[openai.NotFoundError], response_id: str) -> None:
    """The 404 in OpenAI's error shape, naming the id."""
    body = err.value.body
    assert isinstance(body, dict)
    assert body["type"] == "invalid_request_error" and body["code"] == "response_not_found"
    assert body["param"] == "response_id" and response_id in body["message"]


def _conforms(base_url: str, method: str, status: int, body: Any) -> None:
    """``body`` is what the server's own OpenAPI document says ``method`` on a stored
    response answers with ``status``."""
    document = httpx.get(f"{base_url}/openapi.json").json()
    operation = document["paths"]["/v1/responses/{response_id}"][method]
    schema = operation["responses"][str(status)]["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": document["components"]}
                                    ).validate(body)


def test_a_stored_response_comes_back_as_it_was_answered(base_url: str) -> None:
    client = _client(base_url)
    made = client.responses.create(model="default", input="Hi", metadata={"k": "v"})
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    assert got.output_text == made.output_text != ""
    raw = httpx.get(f"{base_url}/v1/responses/{made.id}",
                    headers={"authorization": f"Bearer {KEY}"})
    assert raw.status_code == 200
    _conforms(base_url, "get", 200, raw.json())


def test_a_streamed_response_is_stored_as_its_completed_event_says(base_url: str) -> None:
    client = _client(base_url)
    events = list(client.responses.create(model="default", input="Hi", stream=True))
    final = next(e.response for e in events if e.type == "response.completed")
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_delete_forgets_the_response_and_its_conversation(base_url: str) -> None:
    client = _client(base_url)
    made = client.responses.create(model="default", input="Hi")
    deleted = httpx.delete(f"{base_url}/v1/responses/{made.id}",
                           headers={"authorization": f"Bearer {KEY}"})
    assert deleted.status_code == 200
    assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    _conforms(base_url, "delete", 200, deleted.json())
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(made.id)
    _not_found(err, made.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="default", input="And?", previous_response_id=made.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.delete(made.id)  # once
    _not_found(err, made.id)
    again = client.responses.create(model="default", input="Hi")
    assert client.responses.delete(again.id) is None  # the SDK's own delete: no error


def test_only_a_key_that_made_it_reads_or_deletes_it(base_url: str) -> None:
    maker, other = _client(base_url), _client(base_url, OTHER_KEY)
    made = maker.responses.create(model="default", input="Hi")
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.retrieve(made.id)
    _not_found(err, made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(made.id)
    assert maker.responses.retrieve(made.id).id == made.id  # still there for its maker


@pytest.mark.parametrize("response_id", ["resp_0123456789abcdef", "x", "resp with space"])
def test_an_unknown_or_unstored_id_is_a_404(base_url: str, response_id: str) -> None:
    client = _client(base_url)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(response_id)
    assert response_id in err.value.body["message"]  # type: ignore[index]
    unstored = client.responses.create(model="default", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(unstored.id)
    _not_found(err, unstored.id)


@pytest.mark.parametrize("query", [{"stream": "true"}, {"include[]": "reasoning.encrypted_content"},
                                   {"starting_after": "3"}])
def test_a_query_the_store_cannot_honour_is_a_400_naming_it(
        base_url: str, query: dict[str, str]) -> None:
    client = _client(base_url)
    made = client.responses.create(model="default", input="Hi")
    got = httpx.get(f"{base_url}/v1/responses/{made.id}", params=query,
                    headers={"authorization": f"Bearer {KEY}"})
    assert got.status_code == 400
    assert got.json()["error"]["param"] == next(iter(query))
    fine = httpx.get(f"{base_url}/v1/responses/{made.id}", params={"stream": "false"},
                     headers={"authorization": f"Bearer {KEY}"})
    assert fine.status_code == 200 and fine.json()["id"] == made.id


def test_the_openapi_document_lists_both_operations() -> None:
    paths = openapi_document(["default"])["paths"]
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
