"""The web chat page at ``GET /``: over plain HTTP, and in a real headless Chromium.

The browser tests drive the system's Chromium through playwright (never a browser playwright
downloads): the page, served by a real server with an API key, asks for the key when the
server answers 401, lists the models, streams answers and keeps the conversation, stops an
answer, downloads a request's trace and shows the server's errors; its scripts come from this
server, each pinned by its integrity (``test_web_page_inspector.py`` covers the rest).
Oracles: the library's own greedy generation of the same conversation (``pipe.generate``),
its token count of the whole conversation (the trace's ``input.tokenized`` must match it, so
the history was really sent), and the trace invariants.

Without a Chromium binary the browser tests skip, unless ``PIPELINE_REQUIRE_BROWSER=1`` or
``CI`` is set (``make test`` sets the first and installs the browser): then they fail.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import transports.http

from pipeline.builder import build
from pipeline.events import MINIMAL_TIMELINE, Event
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from pipeline.trace import check
from stages.tokenize import HFTokenizer
from tests.http_support import IM_END, IM_START, config, endless_model, running
from transports.http import Gateway, ServerConfig

KEY = "sk-web-page"
MAX_TOKENS = 24
# What this machine's Chromium needs headless (playwright adds --headless itself), and no
# traffic of its own: updates, sync, field trials.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]
TIMEOUT_MS = 60_000
"""How long the browser waits for what the page must show: a bound on a hang, not a speed
test (a loaded machine runs the scripted models many times slower than an idle one)."""
# An answer that is markup: the page must show it as text, never build elements from it.
MARKUP = '<img src="x" id="injected"><b>bold</b> & <script>document.title="owned"</script>'


def markup_model(text: str = MARKUP) -> Pipeline:
    """A scripted model over the embedded tokenizer that answers ``text`` (``MARKUP``)."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    answer = tok.encode_text(text) + [IM_END]
    header = len(tok.encode_text("assistant\n"))

    def choose(ids: list[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        return answer[min(len(ids) - (start + 1 + header), len(answer) - 1)]

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0))
    return build(TINY_MODEL_DIR, backend=backend)


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "endless":
        return endless_model(delay_s=0.01)[0]
    if folder is not None and folder.name == "markup":
        return markup_model()
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("web"), api_keys={KEY},
                 models={"default": None, "endless": Path("endless"),
                         "markup": Path("markup")})
    with running(Gateway(cfg, builder)) as url:
        yield url


# --- plain HTTP ------------------------------------------------------------------------------


def inline_sources(html: str, tag: str) -> set[str]:
    """CSP hash sources of each inline ``<tag>`` of the page, computed here independently."""
    html = re.sub(r"<!--.*?-->", "", html, flags=re.DOTALL)
    return {"'sha256-" + base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
            + "'" for block in re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)}


def test_the_page_loads_without_a_key_under_a_strict_policy(base_url: str) -> None:
    page = httpx.get(f"{base_url}/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    html = page.text
    assert KEY not in html and "sk-" not in html
    assert not re.search(r"(https?:)?//[a-z0-9]", html, flags=re.IGNORECASE), \
        "the page must load nothing from elsewhere"
    policy = dict(d.strip().split(" ", 1) for d in page.headers["content-security-policy"]
                  .split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"
    assert "unsafe" not in page.headers["content-security-policy"]
    # the inline loader by its hash, and what it adds (each script pinned by its integrity)
    assert set(policy["script-src"].split()) == inline_sources(html, "script") | {
        "'strict-dynamic'"} != {"'strict-dynamic'"}
    assert set(policy["style-src"].split()) == inline_sources(html, "style") != set()
    assert page.headers["x-content-type-options"] == "nosniff"

    head = httpx.head(f"{base_url}/")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-security-policy"] == page.headers["content-security-policy"]
    assert httpx.post(f"{base_url}/").status_code == 405
    document = httpx.get(f"{base_url}/openapi.json").json()
    assert document["paths"]["/"]["get"]["security"] == []
    assert "/traces/{request_id}" in document["paths"]


def test_the_pages_scripts_are_served_here_and_pinned_by_their_integrity(base_url: str) -> None:
    html = httpx.get(f"{base_url}/").text
    manifest = json.loads(re.search(r'<script type="application/json" id="assets">(.*?)'
                                    r'</script>', html, flags=re.DOTALL).group(1))
    web = Path(transports.http.__file__).parent / "web"
    names = [entry["src"].removeprefix("/web/") for entry in manifest]
    assert names == ["purify.min.js", "marked.min.js", "highlight.min.js", "inspector.js",
                     "chat.js"]
    for entry, name in zip(manifest, names):
        script = httpx.get(base_url + entry["src"])  # no key needed
        assert script.status_code == 200
        assert script.headers["content-type"] == "text/javascript; charset=utf-8"
        assert script.headers["x-content-type-options"] == "nosniff"
        digest = base64.b64encode(hashlib.sha384(script.content).digest()).decode()
        assert entry["integrity"] == f"sha384-{digest}"
        shipped = web / name if (web / name).exists() else web / "vendor" / name
        assert script.content == shipped.read_bytes()
    assert (web / "vendor" / "README.md").exists()
    for missing in ("nothing.js", "..%2Findex.html", "vendor%2Fmarked.min.js"):
        assert httpx.get(f"{base_url}/web/{missing}").status_code == 404


# --- in a real browser -----------------------------------------------------------------------


def _required() -> bool:
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("PIPELINE_REQUIRE_BROWSER") == "1" or ci not in ("", "0", "false")


def _chromium() -> str:
    """The system's Chromium; skips (or fails, where a browser is required) without one."""
    for candidate in (os.environ.get("PIPELINE_CHROMIUM"), "chromium", "chromium-browser"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    why = ("no Chromium binary (chromium, chromium-browser or $PIPELINE_CHROMIUM) on PATH; "
           "install it with: apt-get install chromium")
    if _required():
        pytest.fail(why + " (a browser is required here: PIPELINE_REQUIRE_BROWSER=1 or CI)")
    pytest.skip(why)


@contextlib.contextmanager
def chromium_context(profile: Path, **launch: Any) -> Iterator[Any]:
    """A headless Chromium context (playwright over the system's browser) with a profile in
    ``profile`` and ``launch``'s extra options; skips, or fails where a browser is required,
    without Chromium or playwright."""
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if _required():
            raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            **launch)
        context.set_default_timeout(TIMEOUT_MS)
        yield context
        context.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium_context(tmp_path_factory.mktemp("chromium-profile"),
                          accept_downloads=True) as context:
        yield context


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    """A fresh tab on the chat page (its own sessionStorage); fails the test on a script
    error or a Content-Security-Policy violation."""
    tab = browser.new_page()
    problems: list[str] = []
    tab.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    tab.on("console", lambda message: problems.append(message.text)
           if "Content Security Policy" in message.text else None)
    tab.goto(f"{base_url}/")
    yield tab
    tab.evaluate("localStorage.clear()")  # the next test's tab shares this origin's storage
    tab.close()
    assert not problems


def enter_key(page: Any, key: str) -> None:
    """Answer the key prompt (the server answered the page's model listing with a 401)."""
    page.locator("#key-dialog[open]").wait_for()
    page.fill("#key-input", key)
    page.click("#key-ok")


def kept_answer(page: Any, index: int) -> str:
    """The text of the ``index``-th turn of the conversation the page keeps (localStorage):
    what the model wrote, before the page renders it as Markdown."""
    return page.evaluate(  # type: ignore[no-any-return]
        f"JSON.parse(localStorage.getItem('pipeline.chat')).turns[{index}].content")


def say(page: Any, text: str) -> Any:
    """Send ``text``; returns the locator of the answer it gets, once that answer has ended."""
    answers = page.locator("article.message.assistant")
    before = answers.count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    answer = answers.nth(before)
    answer.locator(".stats").wait_for()
    return answer


def events_of(text: str) -> list[Event]:
    return [Event.from_json(json.loads(line)) for line in text.splitlines()]


def download_trace(page: Any, answer: Any) -> tuple[str, list[Event]]:
    button = answer.locator("button.trace")
    with page.expect_download() as download:
        button.click()
    path = download.value.path()
    assert download.value.suggested_filename.endswith(".jsonl")
    return button.get_attribute("data-request-id"), events_of(Path(path).read_text())


def test_a_conversation_streams_greedy_answers_with_history_and_traces(page: Any) -> None:
    enter_key(page, KEY)
    page.wait_for_selector("#model option[value='default']", state="attached")
    page.select_option("#model", "default")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    first, second = "What is a list?", "And a tuple?"

    answer = say(page, first)
    with build("tiny") as pipe:
        conversation: list[dict[str, str]] = [{"role": "user", "content": first}]
        expected = pipe.generate(conversation, max_tokens=MAX_TOKENS, temperature=0).text
        assert kept_answer(page, 1) == expected
        stats = answer.locator(".meta")
        assert float(stats.get_attribute("data-tokens-per-second")) > 0
        assert float(stats.get_attribute("data-time-to-first-token-ms")) > 0
        assert re.search(r"first token \d+ ms · \d+\.\d tokens/s decode", stats.text_content())

        answer = say(page, second)
        conversation += [{"role": "assistant", "content": expected},
                         {"role": "user", "content": second}]
        again = pipe.generate(conversation, max_tokens=MAX_TOKENS, temperature=0).text
        assert kept_answer(page, 3) == again
        prompt_tokens = pipe.count_tokens(conversation)
    assert page.locator("article.message").count() == 4
    assert page.evaluate("sessionStorage.getItem('pipeline.apiKey')") == KEY

    request_id, events = download_trace(page, answer)
    assert {e.trace_id for e in events} == {request_id}
    assert set(MINIMAL_TIMELINE) <= {e.event_type for e in events}
    assert check(events).ok
    tokenized = next(e for e in events if e.event_type == "input.tokenized")
    assert tokenized.payload["tokens"] == prompt_tokens  # the history was sent


def test_stop_ends_a_growing_answer_and_the_server_cancels_it(page: Any, base_url: str) -> None:
    enter_key(page, KEY)
    page.wait_for_selector("#model option[value='endless']", state="attached")
    page.select_option("#model", "endless")
    page.fill("#max-tokens", "2000")
    page.fill("#input", "Go on forever.")
    page.press("#input", "Enter")
    content = page.locator("article.message.assistant .content")
    lengths: set[int] = set()
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(lengths - {0}) < 3:  # seen growing, token by token
        assert time.monotonic() < deadline, f"the answer did not grow: {lengths}"
        lengths.add(len(content.text_content() or ""))
    page.click("#stop")
    page.locator("article.message.assistant .stats").wait_for()
    assert "stopped" in page.locator("article.message.assistant .stats").text_content()
    assert page.is_enabled("#send") and page.is_disabled("#stop")

    request_id = page.get_attribute("button.trace", "data-request-id")
    while httpx.get(f"{base_url}/traces/{request_id}",  # the cancellation reaches the engine
                    headers={"Authorization": f"Bearer {KEY}"}).status_code == 404:
        assert time.monotonic() < deadline, "the stopped request never finished"
        time.sleep(0.05)
    _, events = download_trace(page, page.locator("article.message.assistant"))
    finished = [e.payload["reason"] for e in events if e.event_type == "generation.finished"]
    assert finished == ["cancelled"]


def test_a_refused_key_is_asked_for_again_and_a_cancelled_prompt_shows_the_401(
        page: Any) -> None:
    from playwright.sync_api import expect

    enter_key(page, KEY)
    page.wait_for_selector("#model option[value='default']", state="attached")
    page.fill("#key", "sk-wrong")
    page.press("#key", "Enter")
    page.locator("#key-dialog[open]").wait_for()  # asked again, with why
    expect(page.locator("#key-reason")).to_have_text(
        re.compile(r"refused this key \(invalid API key"))
    page.click("#key-cancel")
    error = page.locator("#error")
    expect(error).to_have_text(re.compile(r"^listing the models: 401: invalid API key"))

    page.fill("#input", "Hello?")
    page.press("#input", "Enter")
    page.locator("#key-dialog[open]").wait_for()
    page.click("#key-cancel")
    expect(error).to_have_text(re.compile(r"^401: invalid API key in the Authorization header"))
    assert page.locator("article.message").count() == 0  # the turn did not enter the chat
    assert page.input_value("#input") == "Hello?"


def test_an_answer_made_of_markup_is_shown_as_text(page: Any) -> None:
    enter_key(page, KEY)
    page.wait_for_selector("#model option[value='markup']", state="attached")
    page.select_option("#model", "markup")
    answer = say(page, "Show me some HTML.")
    assert kept_answer(page, 1) == MARKUP
    assert answer.locator(".content").text_content().strip() == MARKUP  # HTML shown as text
    assert answer.locator(".content img, .content b, .content script").count() == 0
    assert page.locator("#injected").count() == 0
    assert page.title() == "pipeline chat"
