"""Support for the HTTP tests: a real uvicorn server on 127.0.0.1 in a background thread,
and a scripted "tool-using" model over the embedded model's tokenizer and chat template."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from stages.tokenize import HFTokenizer
from transports.http import Gateway, ServerConfig, Timeouts, create_app
from transports.http.server.timeouts import HTTPImpl, uvicorn_config

IM_START, IM_END, TOOL_RESPONSE = 1, 2, 6140
TOOL_CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  '</tool_call>')
ANSWER_TEXT = "It is 18 degrees in Paris."


@contextmanager
def running(gateway: Gateway, wait: bool = True, *, timeouts: Timeouts | None = None,
            http: HTTPImpl = "httptools") -> Iterator[str]:
    """Serve ``gateway`` on 127.0.0.1 (a free port) with the server's own uvicorn configuration;
    yields the base URL. ``wait``: start serving only once the models are loaded."""
    gateway.loader.load(wait=wait)
    server = uvicorn.Server(uvicorn_config(create_app(gateway), "127.0.0.1", 0, "error",
                                           timeouts or gateway.config.timeouts, http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tool_model(delay_s: float = 0.0, num_slots: int = 8) -> tuple[Pipeline, ScriptedBackend]:
    """A scripted model with the embedded model's tokenizer and template: asked with tools it
    calls ``get_weather``; given the tool's response it answers ``ANSWER_TEXT``."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    call = tok.encode_text(TOOL_CALL_TEXT, special=True) + [IM_END]
    answer = tok.encode_text(ANSWER_TEXT) + [IM_END]

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        header = len(tok.encode_text("assistant\n"))
        produced = len(ids) - (start + 1 + header)
        script = answer if TOOL_RESPONSE in ids else call
        return script[min(produced, len(script) - 1)]

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0),
                              num_slots=num_slots, delay_s=delay_s)
    return build(TINY_MODEL_DIR, backend=backend), backend


def config(tmp: Path, **fields: object) -> ServerConfig:
    """A server config serving the tiny embedded model as ``default``, data in ``tmp``."""
    fields.setdefault("models", {"default": TINY_MODEL_DIR})
    return ServerConfig(data_dir=tmp, **fields)  # type: ignore[arg-type]


def endless_model(delay_s: float = 0.0, num_slots: int = 8,
                  tokenizer: object | None = None) -> tuple[Pipeline, ScriptedBackend]:
    """A scripted model over the embedded tokenizer that writes "a" until it is stopped."""
    plain = HFTokenizer.from_dir(TINY_MODEL_DIR)
    tok = tokenizer if tokenizer is not None else plain
    a, vocab = plain.encode_text("a")[0], plain.vocab_size
    backend = ScriptedBackend(vocab, peaked(vocab, lambda ids: a, 30.0), num_slots=num_slots,
                              delay_s=delay_s)
    return build(TINY_MODEL_DIR, backend=backend, tokenizer=tok), backend  # type: ignore[arg-type]


THINK, END_THINK = 6142, 6143


def thinker_model() -> Pipeline:
    """A scripted model that opens ``<think>``, writes "a" until ``</think>`` appears (it never
    closes the block itself), then answers "Done." and stops."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    a = tok.encode_text("a")[0]
    answer = tok.encode_text("Done.") + [IM_END]

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        out = list(ids[start + 1 + len(tok.encode_text("assistant\n")):])
        if END_THINK in out:
            return answer[min(len(out) - 1 - out.index(END_THINK), len(answer) - 1)]
        return a if THINK in out else THINK

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0))
    return build(TINY_MODEL_DIR, backend=backend)


POLITE_TEXT = "No tools needed."


def polite_model() -> Pipeline:
    """A scripted model that answers ``POLITE_TEXT`` unless its output already began a tool
    call, which it then completes as ``TOOL_CALL_TEXT`` (text-level, so it continues any
    forced prefix however that was tokenized)."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    header = len(tok.encode_text("assistant\n"))

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        text = tok.decode(ids[start + 1 + header:], skip_special_tokens=False)
        target = TOOL_CALL_TEXT if text and TOOL_CALL_TEXT.startswith(text) else POLITE_TEXT
        rest = target[len(text):] if target.startswith(text) else ""
        return tok.encode_text(rest, special=True)[0] if rest else IM_END

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0))
    return build(TINY_MODEL_DIR, backend=backend)


class Fatal(BaseException):
    """Ends the engine thread (nothing in the loop catches a BaseException)."""


def fragile_model(message: str) -> tuple[Pipeline, ScriptedBackend, threading.Event]:
    """A scripted model over the embedded tokenizer that writes "a" (2 slots, 10 ms a step);
    returns the pipeline, its backend and an event. Once the event is set, the next step
    raises :class:`Fatal` with ``message``, which ends its engine thread (once: the event
    clears)."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    a = tok.encode_text("a")[0]
    armed = threading.Event()

    def choose(ids: Sequence[int]) -> int:
        if armed.is_set():
            armed.clear()
            raise Fatal(message)
        return a

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0),
                              num_slots=2, delay_s=0.01)
    return build(TINY_MODEL_DIR, backend=backend), backend, armed
