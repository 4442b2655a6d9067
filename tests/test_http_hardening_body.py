"""Request bodies and access lines, in process (Starlette's test client over the real app; no
model is loaded, so a body that passes parsing is answered 503 "loading", and one that does
not is the dialect's 400):

- a key given twice in one JSON object, at any depth, is refused naming its path, in the
  request's dialect (a parser that keeps the first key would judge another request than the
  one Python's last-one-wins would serve);
- ``cache_control`` on Anthropic system, message and tool-result blocks is checked as the
  top-level one is;
- a 4xx access line says why, in one line whatever the client sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.http_support import config
from transports.http import Gateway, create_app
from transports.http.accounting.logs import REASON_CHARS

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
USER = '{"role": "user", "content": "hi"}'


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app over a gateway whose models are never loaded: nothing is generated here."""
    gateway = Gateway(config(tmp_path_factory.mktemp("body")))
    with TestClient(create_app(gateway), raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, path: str, raw: str) -> Any:
    """Send ``raw`` exactly as written (duplicate keys cannot be made with a dict)."""
    return client.post(path, content=raw.encode(),
                       headers={"content-type": "application/json"})


def openai_error(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]  # type: ignore[no-any-return]


def anthropic_error(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error"
    return body["error"]  # type: ignore[no-any-return]


# --- duplicate keys ---------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "path"), [
    ('{"model": "default", "messages": [%s], "model": "other"}' % USER, "model"),
    ('{"model": "default", "messages": [{"role": "user", "role": "system", "content": "x"}]}',
     "messages[0].role"),
    ('{"model": "default", "messages": [%s], "tools": [{"type": "function", "function": '
     '{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", '
     '"type": "integer"}}}}}]}' % USER, "tools[0].function.parameters.properties.a.type"),
], ids=["top level", "in a message", "deep in a tool schema"])
def test_a_repeated_key_is_a_400_naming_its_path_openai(client: TestClient, raw: str,
                                                       path: str) -> None:
    json.loads(raw)  # Python's own parser takes it: last one wins
    error = openai_error(post(client, CHAT, raw))
    assert error["param"] == path
    assert error["code"] == "invalid_value"
    assert "twice" in error["message"]


def test_a_repeated_key_is_a_400_in_the_anthropic_shape(client: TestClient) -> None:
    raw = ('{"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": '
           '[{"type": "text", "text": "a", "text": "b"}]}]}')
    error = anthropic_error(post(client, MESSAGES, raw))
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages[0].content[0].text"


def test_the_same_body_without_the_repeat_gets_past_parsing(client: TestClient) -> None:
    raw = '{"model": "default", "messages": [{"role": "user", "content": "x"}]}'
    response = post(client, CHAT, raw)
    assert response.status_code == 503  # parsed and valid; the model is not loaded
    assert response.json()["error"]["code"] == "model_loading"


def test_a_repeat_beside_nesting_too_deep_to_walk_is_still_a_400(client: TestClient) -> None:
    deep = "[" * 5000 + "]" * 5000
    raw = '{"a": {"k": 1, "k": 2}, "b": %s}' % deep
    error = openai_error(post(client, CHAT, raw))
    assert error["param"] is not None and error["param"].endswith("k")


# --- cache_control on blocks ------------------------------------------------------------------

def messages_body(**fields: Any) -> str:
    body = {"model": "default", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body)


def tool_exchange(hint: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "sunny",
                                                       "cache_control": hint}]}]}]


PLACES = {
    "system": (lambda hint: {"system": [{"type": "text", "text": "Be brief.",
                                          "cache_control": hint}]}, "system[0].cache_control"),
    "message": (lambda hint: {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": hint}]}]},
        "messages[0].content[0].cache_control"),
    "tool_result": (lambda hint: {"messages": tool_exchange(hint)},
                    "messages[2].content[0].content[0].cache_control"),
}


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize(("hint", "suffix"), [
    ({"type": "persistent"}, ".type"), ({"type": "ephemeral", "ttl": "2h"}, ".ttl"),
    ({"type": "ephemeral", "scope": "global"}, ".scope"), ({}, ".type"), ("ephemeral", ""),
], ids=["bad type", "bad ttl", "unknown key", "no type", "not an object"])
def test_a_bad_cache_control_on_a_block_is_a_400_naming_its_path(
        client: TestClient, place: str, hint: Any, suffix: str) -> None:
    fields, path = PLACES[place]
    error = anthropic_error(post(client, MESSAGES, messages_body(**fields(hint))))
    assert error["param"] == path + suffix


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("hint", [{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"},
                                  None])
def test_a_good_cache_control_on_a_block_is_accepted(client: TestClient, place: str,
                                                     hint: Any) -> None:
    fields, _ = PLACES[place]
    response = post(client, MESSAGES, messages_body(**fields(hint)))
    assert response.status_code == 503, response.text  # past parsing: the model is loading


def test_count_tokens_checks_block_hints_too(client: TestClient) -> None:
    body = json.loads(messages_body(**PLACES["system"][0]({"type": "x"})))
    del body["max_tokens"]
    error = anthropic_error(post(client, f"{MESSAGES}/count_tokens", json.dumps(body)))
    assert error["param"] == "system[0].cache_control.type"


# --- why a 4xx was refused, in its access line ------------------------------------------------

def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline.serve.access"]


def reason_of(line: str) -> tuple[str, str]:
    """The ``reason=`` token's text, decoded as the JSON string it is written as, and what
    follows it on the line."""
    token = line.split(" reason=", 1)[1]
    reason, end = json.JSONDecoder().raw_decode(token)
    return reason, token[end:]


def test_a_4xx_access_line_says_why(client: TestClient,
                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pipeline.serve.access"):
        response = post(client, MESSAGES, '{"model": "default", "max_tokens": 4, '
                                          '"messages": [{"role": "robot", "content": "x"}]}')
    told = anthropic_error(response)
    (line,) = access_lines(caplog)
    assert line.startswith("POST /v1/messages 400 ")
    assert " error=invalid_request_error " in line
    assert reason_of(line) == (told["message"], " request_id=- client=testclient:50000")


def test_a_404_and_a_401_say_why(tmp_path_factory: pytest.TempPathFactory,
                                 caplog: pytest.LogCaptureFixture) -> None:
    gateway = Gateway(config(tmp_path_factory.mktemp("keys"), api_keys={"sk-right"}))
    with TestClient(create_app(gateway)) as c, caplog.at_level(logging.INFO,
                                                              "pipeline.serve.access"):
        c.get("/nowhere")
        c.get("/v1/models", headers={"authorization": "Bearer sk-wrong"})
    missing, denied = access_lines(caplog)
    assert " 404 " in missing and " error=not_found " in missing
    assert " 401 " in denied and " error=invalid_api_key " in denied


def test_client_text_cannot_forge_or_stretch_a_log_line(client: TestClient,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    forged = ('x\\n2025-01-31 12:00:00.000 INFO pipeline.serve.access: GET / 200 1.0ms '
              'request_id=- client=\\"1.2.3.4' + "y" * 500)
    raw = '{"model": "default", "messages": [%s], "%s": 1, "%s": 2}' % (USER, forged, forged)
    with caplog.at_level(logging.INFO, "pipeline.serve.access"):
        told = openai_error(post(client, CHAT, raw))
    assert "\n" in told["message"]  # the key's newline, as the client sent it
    (line,) = access_lines(caplog)
    assert "\n" not in line and "\r" not in line
    reason, rest = reason_of(line)
    assert reason == told["message"][:REASON_CHARS] + "..."
    assert rest == " request_id=- client=testclient:50000"  # the line's own last fields
