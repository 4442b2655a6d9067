"""The chat page as a place to look: Markdown, a kept conversation, regenerate and edit, the
key prompt, and the inspector (token probabilities, alternatives, timeline, compare); and the
inspector's endpoints over plain HTTP (``GET /traces/{id}/inspect``, ``GET /traces/{a}/diff/{b}``).

One server (the tiny model, and a scripted model that answers Markdown with hostile markup)
and one headless Chromium (the system's, through playwright, as in ``test_web_page.py``) serve
the whole module. Oracles: the traces the server kept (the rendered prompt holds the system
prompt and the edited message; the first differing token found by reading both traces' selected
tokens here), highlight.js's own classes, the vendored files' bytes, and the clipboard.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.builder import build
from pipeline.events import Event
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from stages.tokenize import HFTokenizer
from tests.http_support import config, running
from tests.test_web_page import OPEN_TURNS, TIMEOUT_MS, chromium_context, markup_model
from transports.http import Gateway, ServerConfig

KEY, OTHER = "sk-inspector", "sk-someone-else"
AUTH = {"Authorization": f"Bearer {KEY}"}
CODE = "def add(x, y):\n    return x + y"
MARKDOWN = ("Here is **code**:\n\n```python\n" + CODE + "\n```\n\n"
            '<img src="x" onerror="document.title=\'owned\'"> <script>document.title="owned"'
            "</script> [click](javascript:document.title='owned')\n")
SYSTEM = "You are terse."


def markdown_model() -> Pipeline:
    """A scripted model over the embedded tokenizer that answers ``MARKDOWN``."""
    return markup_model(MARKDOWN)


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "markdown":
        return markdown_model()
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("inspector"), api_keys={KEY, OTHER},
                 models={"default": None, "markdown": Path("markdown")})
    with running(Gateway(cfg, builder)) as url:
        yield url


# --- the endpoints over plain HTTP -----------------------------------------------------------


def chat(base_url: str, *, seed: int, temperature: float, key: str = KEY,
         content: str = "Tell me a story.") -> str:
    """One non-streamed chat request recorded at ``full``; its request id."""
    response = httpx.post(f"{base_url}/v1/chat/completions", headers={
        "Authorization": f"Bearer {key}", "x-pipeline-recording": "full"}, json={
        "model": "default", "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": temperature, "seed": seed}, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def selected(base_url: str, request_id: str) -> list[int]:
    """The request's selected token ids, read from its JSONL trace."""
    text = httpx.get(f"{base_url}/traces/{request_id}", headers=AUTH).text
    events = [Event.from_json(json.loads(line)) for line in text.splitlines()]
    steps = sorted((e.payload["step"], e.payload["token_id"]) for e in events
                   if e.event_type == "token.selected")
    return [token for _, token in steps]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i + 1 for i in range(max(len(a), len(b)))
                 if i >= len(a) or i >= len(b) or a[i] != b[i]), None)


def test_the_diff_endpoint_finds_the_known_first_divergence(base_url: str) -> None:
    greedy = [chat(base_url, seed=s, temperature=0) for s in (1, 2)]
    same = httpx.get(f"{base_url}/traces/{greedy[0]}/diff/{greedy[1]}", headers=AUTH).json()
    assert same["divergence"] is None and same["first_token_step"] is None
    assert same["shared_level"] == "system"

    sampled = [chat(base_url, seed=s, temperature=1.0) for s in (1, 2)]
    report = httpx.get(f"{base_url}/traces/{sampled[0]}/diff/{sampled[1]}", headers=AUTH)
    assert report.status_code == 200 and report.headers["cache-control"] == "no-store"
    body = report.json()
    # the same prompt and model, different seeds: the random streams are the first difference
    assert body["divergence"]["product"] == "rng" and body["divergence"]["level"] == "selection"
    assert body["divergence"]["step"] == 1 and body["shared_level"] == "model"
    ids = [selected(base_url, request_id) for request_id in sampled]
    step = first_difference(*ids)
    assert body["first_token_step"] == step
    # the first different committed token, with both tokens, their text and probabilities
    first, tok = body["first_token"], HFTokenizer.from_dir(TINY_MODEL_DIR)
    assert first["step"] == step and first["agree_tokens"] == step - 1
    for side, tokens in zip((first["a"], first["b"]), ids):
        assert side["token_id"] == tokens[step - 1]
        assert side["text"] == tok.decode([side["token_id"]])
        assert 0 < side["processed_prob"] <= 1
        assert side["raw_prob"] is not None or side["raw_prob_at_most"] is not None
    assert "earliest internal difference: the random draw (rng) at step 1" in body["text"]
    assert "first divergence" not in body["text"]

    # another prompt: the input differs first
    prompt = chat(base_url, seed=1, temperature=0, content="Something else.")
    assert httpx.get(f"{base_url}/traces/{greedy[0]}/diff/{prompt}",
                     headers=AUTH).json()["divergence"]["level"] == "input"


def test_the_inspector_endpoints_keep_the_trace_access_rule(base_url: str) -> None:
    mine = chat(base_url, seed=1, temperature=0.7)  # 1.0 would apply no processor
    theirs = chat(base_url, seed=2, temperature=0.7, key=OTHER)
    other = {"Authorization": f"Bearer {OTHER}"}
    for url, headers in ((f"/traces/{mine}/diff/{theirs}", AUTH),
                         (f"/traces/{mine}/diff/{theirs}", other),
                         (f"/traces/{mine}/inspect", other)):
        response = httpx.get(base_url + url, headers=headers)
        assert response.status_code == 404, url
        assert response.json()["error"]["code"] == "trace_not_found"
    assert httpx.get(f"{base_url}/traces/{mine}/inspect").status_code == 401
    bad = httpx.get(f"{base_url}/traces/{'x' * 129}/inspect", headers=AUTH)
    assert bad.status_code == 400 and "request id" in bad.json()["error"]["message"]
    bad = httpx.get(f"{base_url}/traces/{mine}/diff/a%20b", headers=AUTH)
    assert bad.status_code == 400 and "b=" in bad.json()["error"]["message"]
    wrong = httpx.post(f"{base_url}/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={**AUTH, "x-pipeline-recording": "everything"})
    assert wrong.status_code == 400 and "x-pipeline-recording" in wrong.text

    # several choices: a choice's id names one trace, the request's id is refused
    several = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "n": 2}).headers["x-request-id"]
    assert httpx.get(f"{base_url}/traces/{several}/inspect", headers=AUTH).status_code == 400
    assert httpx.get(f"{base_url}/traces/{several}-1/inspect", headers=AUTH).status_code == 200

    seen = httpx.get(f"{base_url}/traces/{mine}/inspect", headers=AUTH).json()
    tokens = selected(base_url, mine)
    assert [s["token_id"] for s in seen["steps"]] == tokens
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    step = seen["steps"][0]
    assert seen["recording"] == "full" and "temperature" in step["processors"]
    chain = iter(seen["processor_chain"])  # applied: in the declared chain's order
    assert all(name in chain for name in step["processors"])
    assert len(step["raw"]) == len(step["processed"]) == 8
    assert step["processed"][0]["text"] == tok.decode([step["processed"][0]["token_id"]])
    assert 0 < sum(p["prob"] for p in step["processed"]) <= 1 + 1e-6
    names = {p["name"] for p in seen["timeline"]["phases"]}
    assert {"request", "prepare", "queue", "prefill", "select 1", "decode 1"} <= names
    assert seen["timeline"]["stops"][0]["reason"] == "length"


# --- in a real browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory, base_url: str) -> Iterator[Any]:
    with chromium_context(tmp_path_factory.mktemp("chromium-inspector"),
                          viewport={"width": 1400, "height": 900}) as context:
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base_url)
        yield context


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    """A fresh tab on the chat page with an empty conversation; fails the test on any
    console error or script error."""
    tab = browser.new_page()
    problems: list[str] = []
    tab.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    tab.on("console", lambda message: problems.append(message.text)
           if message.type == "error" and "401" not in message.text else None)
    tab.goto(f"{base_url}/")
    yield tab
    tab.evaluate("localStorage.clear()")  # the next test's tab shares this origin's storage
    tab.close()
    assert not problems


def give_key(page: Any, key: str = KEY) -> None:
    """Answer the key prompt the page shows after the server's 401."""
    page.locator("#key-dialog[open]").wait_for()
    page.fill("#key-input", key)
    page.click("#key-ok")


def ready(page: Any, model: str = "default") -> None:
    give_key(page)
    page.wait_for_selector(f"#model option[value='{model}']", state="attached")
    page.select_option("#model", model)


def say(page: Any, text: str) -> Any:
    """Send ``text``; the locator of the answer it gets, once that answer has ended."""
    answers = page.locator("article.message.assistant")
    before = answers.count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    answer = answers.nth(before)
    answer.locator(".stats").wait_for()
    return answer


def turns(page: Any) -> list[dict[str, Any]]:
    """The conversation the page keeps (localStorage)."""
    kept: list[dict[str, Any]] = page.evaluate(OPEN_TURNS)
    return kept


def until(page: Any, done: Callable[[list[dict[str, Any]]], bool]) -> None:
    """Wait until the kept conversation satisfies ``done`` (the page's CSP forbids the
    string evaluation ``wait_for_function`` would use)."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not done(turns(page)):
        assert time.monotonic() < deadline, f"the conversation never got there: {turns(page)}"
        page.wait_for_timeout(50)


def rendered_prompt(base_url: str, request_id: str) -> str:
    text = httpx.get(f"{base_url}/traces/{request_id}", headers=AUTH).text
    events = [json.loads(line) for line in text.splitlines()]
    rendered: str = next(e["payload"]["text"] for e in events
                         if e["event_type"] == "context.rendered")
    return rendered


def test_markdown_is_rendered_highlighted_copyable_and_sanitized(page: Any) -> None:
    ready(page, "markdown")
    answer = say(page, "Show me some code.")
    code = answer.locator(".content .code pre code")
    assert code.get_attribute("class") is not None and "hljs" in code.get_attribute("class")
    assert code.locator(".hljs-keyword").first.text_content() == "def"
    assert code.text_content() == CODE + "\n"  # marked ends a fenced block with a newline
    assert answer.locator(".content strong").text_content() == "code"
    answer.locator(".code-bar button.copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == CODE
    assert answer.locator(".code-bar button.copy").text_content() == "copied"
    # the markup in the answer is text, and the link lost its script URL
    assert answer.locator(".content img, .content script, .content [onerror]").count() == 0
    assert "<script>" in answer.locator(".content").text_content()
    link = answer.locator(".content a")
    assert link.count() == 0 or not (link.get_attribute("href") or "").startswith("javascript")
    assert page.title() == "pipeline chat"


def test_the_conversation_survives_a_reload_regenerate_and_edit(page: Any,
                                                                 base_url: str) -> None:
    ready(page)
    page.fill("#system", SYSTEM)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "6")
    first = say(page, "What is a list?")
    request_id = first.locator("button.trace").get_attribute("data-request-id")
    assert SYSTEM in rendered_prompt(base_url, request_id)
    stats = first.locator(".meta")
    assert float(stats.get_attribute("data-time-to-first-token-ms")) > 0
    assert re.search(r"first token \d+ ms · \d+\.\d tokens/s decode", stats.text_content())

    page.reload()
    page.locator("article.message.assistant .stats").wait_for()
    assert page.input_value("#system") == SYSTEM
    assert page.locator("article.message.user .content").text_content() == "What is a list?"
    kept = turns(page)
    assert [t["role"] for t in kept] == ["user", "assistant"]
    assert page.input_value("#temperature") == ""  # sampling fields are not kept: defaults
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "6")

    page.click("article.message.assistant button.regenerate")
    until(page, lambda kept: len(kept) == 2 and len(kept[1]["versions"]) == 1)
    again = turns(page)
    assert again[1]["requestId"] != request_id
    assert again[1]["versions"][0]["requestId"] == request_id
    assert again[1]["content"] == kept[1]["content"]  # greedy: the same answer

    page.click("article.message.user button.edit")
    page.fill("article.message.user .editor textarea", "What is a tuple?")
    page.click("article.message.user .editor button[type=submit]")
    until(page, lambda kept: len(kept) == 2 and kept[0]["content"] == "What is a tuple?")
    edited = turns(page)
    assert edited[1]["versions"] == []
    prompt = rendered_prompt(base_url, edited[1]["requestId"])
    assert "What is a tuple?" in prompt and "What is a list?" not in prompt
    assert page.locator("article.message.user").count() == 1

    page.click("#clear")
    assert turns(page) == [] and page.locator("article.message.user").count() == 0


def test_a_401_asks_for_the_key_and_the_request_is_retried(page: Any) -> None:
    give_key(page, "sk-wrong")  # the first prompt: the models could not be listed
    page.locator("#key-dialog[open]").wait_for()
    assert "refused" in page.locator("#key-reason").text_content()
    ready(page)
    assert page.evaluate("sessionStorage.getItem('pipeline.apiKey')") == KEY
    page.fill("#max-tokens", "3")
    page.evaluate("document.getElementById('key').value = 'sk-stale'")
    page.fill("#input", "Hello?")
    page.press("#input", "Enter")
    give_key(page)  # the chat request got a 401: asked, then sent again with the new key
    page.locator("article.message.assistant .stats").wait_for()
    assert page.locator("#error").is_hidden()
    assert [t["role"] for t in turns(page)] == ["user", "assistant"]


def test_the_inspector_colours_tokens_explains_them_and_compares(page: Any, base_url: str,
                                                                 tmp_path: Path) -> None:
    ready(page)
    page.fill("#temperature", "0.9")
    page.fill("#max-tokens", "8")
    page.fill("#seed", "1")
    say(page, "Tell me a story.")
    page.fill("#seed", "2")
    page.click("article.message.assistant button.regenerate")
    until(page, lambda kept: len(kept) == 2 and len(kept[1]["versions"]) == 1)
    page.locator("article.message.assistant .stats").wait_for()
    page.click("article.message.assistant button.inspect")

    inspector = page.locator("#inspector")
    tokens = inspector.locator(".tokens").first.locator(".tok")
    tokens.first.wait_for()
    assert tokens.count() >= 2
    classes = " ".join(tokens.nth(i).get_attribute("class") for i in range(tokens.count()))
    assert re.search(r"\bp[0-4]\b", classes)
    tokens.first.hover()
    tip = page.locator("#tip")
    assert tip.is_visible()
    assert tip.locator("th").all_text_contents() == ["token", "model", "after settings", "logit"]
    assert tip.locator("tr").count() >= 2 + 1
    assert re.search(r"processors applied in order: .*temperature", tip.text_content())
    tokens.nth(1).focus()  # the keyboard shows it too
    assert tip.is_visible() and "step 2" in tip.text_content()
    for phase in ("queue", "prefill", "decode 1"):
        assert inspector.locator(f".bar[data-phase='{phase}']").count() == 1
    assert "finish: length" in inspector.locator(".summary").text_content()

    inspector.locator("button.compare").click()
    inspector.locator(".divergence").wait_for()
    assert "the random draw at step 1 (rng, selection level)" in \
        inspector.locator(".divergence").text_content()
    kept = turns(page)[1]
    step = first_difference(selected(base_url, kept["requestId"]),
                            selected(base_url, kept["versions"][0]["requestId"]))
    assert step is not None, "seeds 1 and 2 gave the same tokens"
    marked = inspector.locator(".tok.diverge")
    assert marked.count() == 2
    assert {marked.nth(i).get_attribute("data-step") for i in range(2)} == {str(step)}

    marked.first.hover()  # the picture shows a tooltip too
    shot = tmp_path / "inspector.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
