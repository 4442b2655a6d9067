"""A wrong API key, sent by the real SDKs: the 401 names the header the client used.

The OpenAI SDK sends ``Authorization: Bearer``; the Anthropic SDK sends ``Authorization`` or
``x-api-key`` by version and settings (a key given as the ``x-api-key`` header, as its older
versions and its documentation's curl examples do, is sent there). The oracle for which
header went out is the SDK's own HTTP client (a request hook sees the request as sent, after
the SDK's auth flow), not the server's view of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest

from tests.http_support import config, endless_model, running
from transports.http import Gateway

KEY = "sk-right"
HEADERS = {"authorization": "Authorization", "x-api-key": "x-api-key"}
"""A header as it goes over the wire → as the message names it."""


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pipe, _ = endless_model()
    tmp: Path = tmp_path_factory.mktemp("keys")
    with running(Gateway(config(tmp, api_keys={KEY}), lambda f, c: pipe)) as url:
        yield url


class Sent:
    """An HTTP client for an SDK that notes the key headers of each request it sends, as the
    message names them."""

    def __init__(self) -> None:
        self.headers: list[list[str]] = []
        self.client = httpx2.Client(event_hooks={"request": [self._note]})

    def _note(self, request: httpx2.Request) -> None:
        self.headers.append([name for wire, name in HEADERS.items() if wire in request.headers])

    def last(self) -> list[str]:
        return self.headers[-1]


def _says(message: str, sent: list[str]) -> None:
    assert sent, "the SDK sent a key"
    assert f"invalid API key in the {' and '.join(sent)} header" in message
    for name in set(HEADERS.values()) - set(sent):  # never a header the client did not use
        assert name not in message


@pytest.mark.parametrize("how", [
    {"api_key": "wrong"},
    {"api_key": None, "default_headers": {"x-api-key": "wrong"}},
    {"api_key": None, "auth_token": "wrong"},
])
def test_the_anthropic_sdk_is_told_about_the_header_it_sent(
        base_url: str, how: dict[str, object]) -> None:
    sent = Sent()
    client = anthropic.Anthropic(base_url=base_url, max_retries=0, http_client=sent.client,
                                 **how)  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError) as err:
        client.messages.create(model="default", max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}])
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    _says(body["error"]["message"], sent.last())


@pytest.mark.parametrize("how", [{}, {"default_headers": {"x-api-key": "wrong too"}}])
def test_the_openai_sdk_is_told_about_the_header_it_sent(base_url: str,
                                                         how: dict[str, object]) -> None:
    sent = Sent()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0,
                           http_client=sent.client, **how)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model="default", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_api_key"
    _says(body["message"], sent.last())


def test_a_right_key_in_either_header_is_accepted(base_url: str) -> None:
    for how in ({"api_key": KEY}, {"api_key": None, "default_headers": {"x-api-key": KEY}}):
        client = anthropic.Anthropic(base_url=base_url, max_retries=0, **how)  # type: ignore[arg-type]
        answer = client.messages.create(model="default", max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
        assert answer.usage.output_tokens == 2
