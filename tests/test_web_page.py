"""The web chat page at ``GET /``: over plain HTTP, and in a real headless Chromium.

The browser tests drive the system's Chromium through playwright (never a browser playwright
downloads): the page, served by a real server with an API key, asks for the key when the
server answers 401, lists the models under their served name and what each model is, streams
answers (showing "thinking" until the first token) and keeps the conversations in a list,
keeps each version of a regenerated answer behind a switcher, stops an answer, downloads a
request's trace and shows the server's errors; its inspector colours tokens by the model's
own probability and says in words where two answers part; its scripts come from this server,
each pinned by its integrity (``test_web_page_inspector.py`` covers the rest).
Oracles: the library's own generation of the same conversation (``pipe.generate``, greedy or
seeded), its token count of the whole conversation (the trace's ``input.tokenized`` must
match it, so the history was really sent), the trace invariants, the requests the browser
really sent, a scripted model whose probabilities are known in closed form, and the token
probabilities computed here from the JSONL traces' raw logits.

Without a Chromium binary the browser tests skip, unless ``PIPELINE_REQUIRE_BROWSER=1`` or
``CI`` is set (``make test`` sets the first and installs the browser): then they fail.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import transports.http.page

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


def markup_model(text: str = MARKUP, height: float = 30.0,
                 gate: threading.Event | None = None) -> Pipeline:
    """A scripted model over the embedded tokenizer that answers ``text`` (``MARKUP``): each
    token's logit is ``height``, every other one 0. With ``gate``, each model call waits
    until the gate is open (the answer's first token waits for it)."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    answer = tok.encode_text(text) + [IM_END]
    header = len(tok.encode_text("assistant\n"))

    def choose(ids: list[int]) -> int:
        if gate is not None:
            gate.wait(TIMEOUT_MS / 1000)
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        return answer[min(len(ids) - (start + 1 + header), len(answer) - 1)]

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, height))
    return build(TINY_MODEL_DIR, backend=backend)


HALF_TEXT = "Paris is in France."
VOCAB = HFTokenizer.from_dir(TINY_MODEL_DIR).vocab_size
HALF = math.log(VOCAB - 1)
"""The "half" model's logit for its chosen token: the softmax gives it exactly 1/2 (its
logit's exponential equals the sum over the vocabulary's other ids, each exp(0) = 1)."""
GATE = threading.Event()
"""Opens the "gated" model's calls (closed: its first token waits)."""


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "endless":
        return endless_model(delay_s=0.01)[0]
    if folder is not None and folder.name == "markup":
        return markup_model()
    if folder is not None and folder.name == "half":
        return markup_model(HALF_TEXT, HALF)
    if folder is not None and folder.name == "gated":
        return markup_model(HALF_TEXT, gate=GATE)
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("web"), api_keys={KEY},
                 models={"default": None, "endless": Path("endless"),
                         "markup": Path("markup"), "half": Path("half"),
                         "gated": Path("gated")})
    GATE.set()
    with running(Gateway(cfg, builder)) as url:
        yield url
    GATE.set()


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
    web = Path(transports.http.page.__file__).parent / "web"
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


OPEN_TURNS = ("(() => { const kept = JSON.parse(localStorage.getItem('pipeline.chats'));"
              " return kept.chats.find((c) => c.id === kept.current).turns; })()")
"""The turns of the conversation the page has open, as it keeps them (localStorage)."""


def kept_answer(page: Any, index: int) -> str:
    """The text of the ``index``-th turn of the conversation the page keeps (localStorage):
    what the model wrote, before the page renders it as Markdown."""
    return page.evaluate(OPEN_TURNS)[index]["content"]  # type: ignore[no-any-return]


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


# --- versions, conversations, "thinking", the model's name ----------------------------------


def open_turns(page: Any) -> list[dict[str, Any]]:
    """The turns of the conversation the page has open, as it keeps them."""
    kept: list[dict[str, Any]] = page.evaluate(OPEN_TURNS)
    return kept


def wait_until(page: Any, done: Any, what: str) -> None:
    """Wait until ``done()`` holds (the page's CSP forbids the string evaluation playwright's
    ``wait_for_function`` would use)."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        page.wait_for_timeout(50)


def regenerated(page: Any) -> bool:
    """Whether the open conversation's answer has a second version."""
    turns = open_turns(page)
    return len(turns) == 2 and len(turns[1].get("versions", [])) == 1


def choose_model(page: Any, model: str) -> None:
    enter_key(page, KEY)
    page.wait_for_selector(f"#model option[value='{model}']", state="attached")
    page.select_option("#model", model)


def test_regenerate_keeps_each_version_behind_a_switcher_that_survives_a_reload(
        page: Any) -> None:
    from playwright.sync_api import expect

    choose_model(page, "default")
    page.fill("#temperature", "0.9")
    page.fill("#max-tokens", "8")
    question = "Tell me a story."
    page.fill("#seed", "1")
    answer = say(page, question)
    first_id = answer.locator("button.trace").get_attribute("data-request-id")
    page.fill("#seed", "2")
    page.click("article.message.assistant button.regenerate")
    wait_until(page, lambda: regenerated(page), "a 2nd version")
    answer = page.locator("article.message.assistant")
    answer.locator(".stats").wait_for()
    second_id = answer.locator("button.trace").get_attribute("data-request-id")
    with build("tiny") as pipe:  # each version is what that seed writes
        texts = {seed: pipe.generate([{"role": "user", "content": question}], max_tokens=8,
                                     temperature=0.9, seed=seed).text for seed in (1, 2)}
    assert texts[1] != texts[2], "seeds 1 and 2 gave the same answer: pick others"
    assert second_id != first_id and kept_answer(page, 1) == texts[2]

    count = answer.locator(".versions .version-count")
    expect(count).to_have_text("2/2")
    assert answer.locator("button.version-next").is_disabled()
    answer.locator("button.version-previous").click()
    expect(count).to_have_text("1/2")
    assert kept_answer(page, 1) == texts[1]
    assert answer.locator("button.trace").get_attribute("data-request-id") == first_id

    page.reload()
    answer = page.locator("article.message.assistant")
    expect(answer.locator(".version-count")).to_have_text(  # kept, as it was shown
        "1/2", timeout=TIMEOUT_MS)
    assert answer.locator("button.trace").get_attribute("data-request-id") == first_id
    answer.locator("button.version-next").click()
    expect(answer.locator(".version-count")).to_have_text("2/2")
    assert answer.locator("button.trace").get_attribute("data-request-id") == second_id
    answer.locator("button.version-previous").click()

    page.fill("#max-tokens", "2")  # the conversation goes on from the version shown
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        say(page, "And then?")
    messages = sent.value.post_data_json["messages"]
    assert messages[1] == {"role": "assistant", "content": texts[1]}
    assert page.locator("article.message.assistant").nth(0).locator(".version-count") \
        .text_content() == "1/2"


def chat_titles(page: Any) -> list[str]:
    return page.locator("#chat-list .chat-open").all_text_contents()  # type: ignore[no-any-return]


def test_conversations_are_listed_switched_deleted_and_kept_across_reloads(page: Any) -> None:
    from playwright.sync_api import expect

    choose_model(page, "markup")
    say(page, "What is a list?")
    assert chat_titles(page) == ["What is a list?"]  # titled by the first message
    page.click("#clear")
    assert page.locator("article.message").count() == 0
    assert chat_titles(page) == ["New chat", "What is a list?"]
    page.fill("#system", "Be brief.")
    say(page, "What is a tuple?")
    assert chat_titles(page) == ["What is a tuple?", "What is a list?"]

    page.reload()
    page.locator("article.message.assistant .stats").wait_for()
    assert chat_titles(page) == ["What is a tuple?", "What is a list?"]
    assert page.locator("#chat-list .chat-item[aria-current='true'] .chat-open") \
        .text_content() == "What is a tuple?"
    assert page.locator("article.message.user .content").text_content() == "What is a tuple?"
    assert page.input_value("#system") == "Be brief."

    page.locator("#chat-list .chat-open", has_text="What is a list?").click()
    expect(page.locator("article.message.user .content")).to_have_text("What is a list?")
    assert page.input_value("#system") == ""  # each conversation has its own system prompt
    assert kept_answer(page, 1) == MARKUP
    assert chat_titles(page) == ["What is a list?", "What is a tuple?"]  # most recent first

    page.locator("#chat-list .chat-item", has_text="What is a tuple?") \
        .locator(".chat-delete").click()
    assert chat_titles(page) == ["What is a list?"]
    page.locator("#chat-list .chat-item", has_text="What is a list?") \
        .locator(".chat-delete").click()  # the open one: a fresh conversation takes its place
    assert chat_titles(page) == ["New chat"] and page.locator("article.message").count() == 0
    page.reload()
    page.locator("#chat-list .chat-open").first.wait_for()
    assert chat_titles(page) == ["New chat"]
    kept = json.loads(page.evaluate("localStorage.getItem('pipeline.chats')"))
    assert [chat["turns"] for chat in kept["chats"]] == [[]]


def test_a_conversation_kept_by_the_earlier_page_is_taken_over(page: Any) -> None:
    earlier = {"system": "Be brief.", "turns": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello."}]}
    page.evaluate(f"localStorage.setItem('pipeline.chat', {json.dumps(json.dumps(earlier))})")
    page.reload()
    page.locator("article.message.assistant").wait_for()
    assert chat_titles(page) == ["Hi"] and open_turns(page) == earlier["turns"]
    assert page.input_value("#system") == "Be brief."
    assert page.evaluate("localStorage.getItem('pipeline.chat')") is None


def test_thinking_shows_until_the_first_token_and_goes_on_stop_or_error(page: Any) -> None:
    from playwright.sync_api import expect

    choose_model(page, "gated")
    answer = page.locator("article.message.assistant")
    typing = answer.locator(".typing")
    GATE.clear()  # the model's first call waits: the prompt is being read
    try:
        page.fill("#input", "Where is Paris?")
        page.press("#input", "Enter")
        expect(typing).to_be_visible(timeout=TIMEOUT_MS)
        assert answer.locator(".content").text_content() == ""
        GATE.set()  # the first token comes
        answer.locator(".stats").wait_for()
        expect(typing).to_have_count(0)
        assert kept_answer(page, 1) == HALF_TEXT

        GATE.clear()  # stopped before the first token
        page.fill("#input", "And Rome?")
        page.press("#input", "Enter")
        expect(answer.nth(1).locator(".typing")).to_be_visible(timeout=TIMEOUT_MS)
        page.click("#stop")
        expect(page.locator(".typing")).to_have_count(0, timeout=TIMEOUT_MS)
        assert page.is_enabled("#send")
    finally:
        GATE.set()

    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=503, json={"error": {"message": "overloaded", "type": "server_error"}}))
    page.fill("#input", "And Berlin?")
    page.press("#input", "Enter")
    expect(page.locator("#error")).to_have_text("503: overloaded", timeout=TIMEOUT_MS)
    expect(page.locator(".typing")).to_have_count(0, timeout=TIMEOUT_MS)


def test_the_page_sends_max_tokens_only_when_the_user_sets_it(page: Any) -> None:
    choose_model(page, "markup")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        say(page, "Hi")
    assert "max_tokens" not in sent.value.post_data_json  # the server's default applies
    page.fill("#max-tokens", "3")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        say(page, "Again")
    assert sent.value.post_data_json["max_tokens"] == 3


def default_model_builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    return build(options={"num_slots": cfg.num_slots})  # the default model, as `serve` does


def test_the_page_names_the_model_a_served_default_is(browser: Any,
                                                      tmp_path: Path) -> None:
    from playwright.sync_api import expect

    cfg = config(tmp_path, models={"default": None}, num_slots=1)
    with running(Gateway(cfg, default_model_builder)) as url:
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        # the shipped default model: SmolLM2-135M-Instruct (a llama), as its GGUF file says
        assert [m["id"] for m in listed] == ["default"]
        assert listed[0]["display_name"].startswith("SmolLM2-135M-Instruct")
        assert listed[0]["description"].startswith("LlamaForCausalLM, 135M parameters")
        tab = browser.new_page()
        try:
            tab.goto(f"{url}/")
            option = tab.locator("#model option[value='default']")
            expect(option).to_have_text(re.compile(r"^default \(SmolLM2-135M-Instruct"),
                                        timeout=TIMEOUT_MS)
            expect(tab.locator("#model-about")).to_contain_text("LlamaForCausalLM",
                                                                timeout=TIMEOUT_MS)
            tab.fill("#max-tokens", "2")
            answer = say(tab, "Hi")
            assert "SmolLM2-135M-Instruct" in answer.locator(".role").text_content()
        finally:
            tab.evaluate("localStorage.clear()")
            tab.close()


# --- the inspector: the model's own probability, and where two answers part -----------------


def pct(p: float) -> str:
    """A probability as the page writes it (one decimal from 10 %, else two)."""
    return f"{100 * p:.1f}%" if p >= 0.1 else f"{100 * p:.2f}%"


def test_the_inspector_colours_by_the_models_own_probability_and_explains_it(
        page: Any, base_url: str) -> None:
    choose_model(page, "half")
    page.fill("#temperature", "0.5")
    page.fill("#top-p", "0.9")
    answer = say(page, "Where is Paris?")
    request_id = answer.locator("button.trace").get_attribute("data-request-id")
    answer.locator("button.inspect").click()
    tokens = page.locator("#inspector .tokens").first.locator(".tok")
    tokens.first.wait_for()
    inspected = httpx.get(f"{base_url}/traces/{request_id}/inspect",
                          headers={"Authorization": f"Bearer {KEY}"}).json()
    steps = inspected["steps"]
    assert tokens.count() == len(steps) == len(HFTokenizer.from_dir(TINY_MODEL_DIR)
                                                .encode_text(HALF_TEXT)) + 1
    half = math.exp(HALF) / (math.exp(HALF) + VOCAB - 1)  # 1/2, in closed form
    for i, step in enumerate(steps):
        token = tokens.nth(i)
        assert step["raw_prob"] == pytest.approx(half, abs=1e-5)
        assert float(token.get_attribute("data-raw-prob")) == pytest.approx(step["raw_prob"],
                                                                            abs=1e-4)
        assert float(token.get_attribute("data-processed-prob")) == pytest.approx(
            step["processed_prob"], abs=1e-4)
        assert step["processed_prob"] > 0.9  # temperature 0.5 and top-p: near certain
        assert "p2" in token.get_attribute("class").split()  # 30–60 %: the model's 1/2
    legend = page.locator("#inspector .legend .basis")
    assert "the model's own probability" in legend.text_content()
    assert "before temperature" in legend.get_attribute("title")

    tokens.first.hover()
    tip = page.locator("#tip")
    probs = tip.locator(".probs").text_content()
    assert f"the model's probability: {pct(half)}" in probs
    assert re.search(r"after .*temperature.*top-p: (99\.\d|100\.0)%", probs)
    for header in tip.locator("th").all():
        assert header.get_attribute("title"), header.text_content()  # each term explained
    chosen = tip.locator("tr.chosen td").all_text_contents()
    assert chosen[1] == pct(half)
    notes = page.locator("#inspector").text_content()
    assert re.search(r"sampling settings applied, in order: .*temperature → .*top-p", notes)
    assert "declared chain" not in notes and "processed" not in notes


def trace_events(base_url: str, request_id: str) -> list[Event]:
    text = httpx.get(f"{base_url}/traces/{request_id}",
                     headers={"Authorization": f"Bearer {KEY}"}).text
    return events_of(text)


def raw_probability(events: list[Event], step: int, token: int) -> str:
    """How the page must write the model's probability of ``token`` at ``step``, computed
    from the trace's raw logits record (top-k and logsumexp) of that step."""
    sources = [e for e in events if e.event_type in ("prefill.completed", "decode.completed")]
    record = next(e.payload["logits"] for e in sources
                  if (e.event_type == "prefill.completed" and step == 1)
                  or (e.event_type == "decode.completed" and e.payload.get("step") == step - 1))
    probs = {int(i): math.exp(v - record["logsumexp"]) for i, v in record["top"]}
    return pct(probs[token]) if token in probs else "below " + pct(min(probs.values()))


def compared_versions(page: Any, base_url: str, temperature: str, taps: bool = False
                      ) -> tuple[list[list[Event]], list[list[int]], int]:
    """Ask a story at ``temperature`` with seed 1 (``taps``: with layer taps), regenerate
    it with seed 2, open the inspector's comparison of the two versions; each version's
    trace events and chosen tokens, and the first step where the tokens differ."""
    choose_model(page, "default")
    if taps:
        page.check("#taps")
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", "8")
    page.fill("#seed", "1")
    say(page, "Tell me a story.")
    page.fill("#seed", "2")
    page.click("article.message.assistant button.regenerate")
    wait_until(page, lambda: regenerated(page), "a 2nd version")
    page.locator("article.message.assistant .stats").wait_for()
    page.click("article.message.assistant button.inspect")
    page.locator("#inspector button.compare").click()
    page.locator("#inspector .first-token").wait_for()
    kept = open_turns(page)[1]
    runs = [trace_events(base_url, kept["requestId"]),
            trace_events(base_url, kept["versions"][0]["requestId"])]
    chosen = [[e.payload["token_id"] for e in sorted(
        (e for e in run if e.event_type == "token.selected"), key=lambda e: e.payload["step"])]
        for run in runs]
    step = next(i + 1 for i in range(min(map(len, chosen))) if chosen[0][i] != chosen[1][i])
    return runs, chosen, step


def test_the_compare_view_says_how_long_the_answers_agree_and_where_they_part(
        page: Any, base_url: str) -> None:
    runs, chosen, step = compared_versions(page, base_url, "0.9")
    sentence = page.locator("#inspector .first-token")
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    agree = step - 1
    said = sentence.text_content()
    assert said.startswith(
        (f"The answers agree for {agree} token{'' if agree == 1 else 's'}; first different "
         f"token at step {step}: " if agree else "The answers differ from their first token "
         "(step 1): ") + "A (this answer) chose ")
    for name, run, ids in zip(("A (this answer)", "B (the other)"), runs, chosen):
        text = json.dumps(tok.decode([ids[step - 1]]), ensure_ascii=False)
        assert (f"{name} chose {text} (the model's probability "
                f"{raw_probability(run, step, ids[step - 1])}, after the sampling settings ") \
            in said
    internal = page.locator("#inspector .divergence").text_content()
    assert internal.startswith("Earliest internal difference: the random draw at step 1")
    if step > 1:
        assert f"it changed no token until step {step}" in internal


def test_with_layer_taps_the_compare_view_says_in_which_layer_the_answers_part(
        page: Any, base_url: str) -> None:
    """Two sampled answers to one prompt compute the same hidden states until one feeds a
    different token: the table names the step after the first different token, from the
    embedding on, and marks that first different layer."""
    runs, chosen, step = compared_versions(page, base_url, "1.5", taps=True)
    assert all(e.payload.get("taps") for run in runs for e in run
               if e.event_type == "prefill.completed")
    assert step < min(map(len, chosen)), "the answers part too late to see their layers"
    table = page.locator("#inspector table.layers")
    table.wait_for()
    assert "no alternatives per step" not in page.locator("#inspector").text_content()
    assert table.locator("caption").text_content() == (
        f"Inside the model: the layers first differ at step {step + 1}, from embed")
    assert table.locator("tr.first td").first.text_content() == "embed"
