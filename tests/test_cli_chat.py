"""``pipeline chat`` as a user meets it, in a subprocess with the tiny model: turns with
history, the slash commands, Ctrl-C during an answer (through pipes and through a real
pseudo-terminal), and a conversation that outgrows the window.

Oracles: the library's own ``generate`` and ``count_tokens`` on the same conversation (the
REPL adds no behaviour of its own, so greedy answers must be equal), and the trace each turn
leaves (``--trace``), whose ``input.tokenized`` event says how many tokens were really sent.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, IO

import pytest

from pipeline import build
from pipeline.pipe import Pipeline
from pipeline.trace import load_all

CHAT = [sys.executable, "-m", "pipeline", "chat", "--model", "tiny", "--temperature", "0"]
LONG = ["--max-tokens", "2000", "--min-tokens", "2000"]  # an answer that is still streaming


@pytest.fixture(scope="module")
def tiny() -> Iterator[Pipeline]:
    with build("tiny", options={"num_slots": 1}) as pipe:
        yield pipe


def _chat(lines: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CHAT + list(args), input="".join(line + "\n" for line in lines),
                          capture_output=True, text=True, timeout=300)


def _tokens_sent(trace: Path) -> list[int]:
    """The prompt length of each turn's request, from its trace."""
    return [next(e.payload["tokens"] for e in t.events if e.event_type == "input.tokenized")
            for t in load_all(trace)]


def test_turns_keep_the_history_and_the_commands_work(tmp_path: Path, tiny: Pipeline) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    trace = tmp_path / "chat.jsonl"
    done = _chat(["Hello there", "And then?", "/system", "/system Be brief.", "/system",
                  f"/save {first}", "/reset", "", "Third question", f"/save {second}",
                  "/nope", "//slash", "/exit", "never read"],
                 "--max-tokens", "8", "--trace", str(trace))
    assert done.returncode == 0 and "Traceback" not in done.stderr
    user = [{"role": "user", "content": c}
            for c in ("Hello there", "And then?", "Third question", "/slash")]
    system = {"role": "system", "content": "Be brief."}
    history: list[dict[str, str]] = []
    answers = []
    for turn in ([user[0]], [user[1]]):
        history += turn
        text = tiny.generate(history, temperature=0, max_tokens=8).text
        history.append({"role": "assistant", "content": text})
        answers.append(text)
    third = [system, user[2]]
    answers.append(tiny.generate(third, temperature=0, max_tokens=8).text)
    third.append({"role": "assistant", "content": answers[-1]})
    answers.append(tiny.generate(third + [user[3]], temperature=0, max_tokens=8).text)
    assert done.stdout == "".join(a + "\n" for a in answers[:2]) + \
        "(no system prompt)\nBe brief.\n" + "".join(a + "\n" for a in answers[2:])

    saved = json.loads(first.read_text())
    assert saved == [system] + history
    assert json.loads(second.read_text()) == third
    tiny.generate(saved + [{"role": "user", "content": "More?"}], max_tokens=2)  # accepted
    sent = _tokens_sent(trace)
    assert sent == [tiny.count_tokens([user[0]]), tiny.count_tokens(history[:3]),
                    tiny.count_tokens(third[:2]), tiny.count_tokens(third + [user[3]])]
    assert sent[1] > sent[0] + 8 // 2  # the first turn really went with the second
    notes = done.stderr.splitlines()
    assert "unknown command /nope: /help lists the commands" in notes
    assert [n for n in notes if "nope" in n] == ["unknown command /nope: /help lists the commands"]
    assert "conversation cleared (the system prompt stays)" in notes


def test_help_and_bad_flags(tmp_path: Path) -> None:
    import shutil

    from pipeline.model_paths import TINY_MODEL_DIR

    done = _chat(["/help"])
    assert done.returncode == 0 and "/save FILE" in done.stdout and "/reset" in done.stdout
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, tmp_path / name)
    for args, says in ((["--temperature", "-1"], "temperature"),
                       (["--max-context", "0"], "max_context"),
                       (["--model", str(tmp_path)], "no weights")):
        bad = subprocess.run(CHAT + args, input="hi\n", capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and says in bad.stderr


def test_a_conversation_that_outgrows_the_window_says_so(tmp_path: Path) -> None:
    trace = tmp_path / "chat.jsonl"
    done = _chat(["hi", "again", "/reset", "hello", "word " * 100], "--max-context", "64",
                 "--max-tokens", "200", "--min-tokens", "200", "--trace", str(trace))
    assert done.returncode == 0 and "Traceback" not in done.stderr
    notes = done.stderr.splitlines()
    filled = [n for n in notes if "filled the model's window of 64 tokens" in n]
    too_long = [n for n in notes if "no longer fits" in n]
    assert len(filled) == 2 and all("/reset" in n for n in filled)
    assert len(too_long) == 2 and all("/reset" in n and "window 64" in n for n in too_long)
    assert len(load_all(trace)) == 2  # the refused turns never reached the model


class Reader:
    """A stream read on a thread, character by character."""

    def __init__(self, stream: IO[str]) -> None:
        self.text = ""
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        while char := stream.read(1):
            self._queue.put(char)

    def until(self, done: Any, timeout: float = 120) -> str:
        """Read until ``done(text)`` holds; returns the text so far."""
        deadline = time.monotonic() + timeout
        while not done(self.text):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; read so far: {self.text[-400:]!r}"
            try:
                self.text += self._queue.get(timeout=left)
            except queue.Empty:
                pass
        return self.text


def test_ctrl_c_stops_the_answer_and_the_session_goes_on(tmp_path: Path, tiny: Pipeline) -> None:
    saved, trace = tmp_path / "chat.json", tmp_path / "chat.jsonl"
    chat = subprocess.Popen(CHAT + LONG + ["--trace", str(trace)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert chat.stdin is not None and chat.stdout is not None and chat.stderr is not None
    out, err = Reader(chat.stdout), Reader(chat.stderr)
    try:
        for n, line in enumerate(["Tell me a story", "Go on"], start=1):
            chat.stdin.write(line + "\n")
            chat.stdin.flush()
            start = len(out.text)
            out.until(lambda text: len(text) > start + 20)
            chat.send_signal(signal.SIGINT)  # this test's own child, by its handle
            err.until(lambda text: text.count("[stopped]") == n)
        chat.stdin.write(f"/save {saved}\n")
        chat.stdin.close()
        assert chat.wait(timeout=120) == 0
    finally:
        if chat.poll() is None:
            chat.kill()
    err.until(lambda text: "saved 4 messages" in text)
    assert "Traceback" not in err.text
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    first, second = messages[1]["content"], messages[3]["content"]
    assert first and second
    out.until(lambda text: text.endswith(second + "\n"), timeout=10)  # the reader catches up
    assert out.text == first + "\n" + second + "\n"
    traces = load_all(trace)
    finishes = [next(e.payload["reason"] for e in t.events
                     if e.event_type == "generation.finished")
                for t in traces]
    assert finishes == ["cancelled", "cancelled"]
    assert _tokens_sent(trace)[1] == tiny.count_tokens(messages[:3])  # the partial answer went
    # the second answer continues the conversation as the library would
    want = tiny.generate(messages[:3], temperature=0, max_tokens=12, min_tokens=12).text
    assert want.startswith(second) or second.startswith(want)


def test_ctrl_c_at_a_terminal(tmp_path: Path) -> None:
    """The same over a pseudo-terminal, Ctrl-C typed as the terminal's interrupt character:
    the prompt, a stopped answer, a typed line cleared, then twice at an empty prompt ends."""
    pty = pytest.importorskip("pty")
    import fcntl
    import select
    import termios

    saved = tmp_path / "chat.json"
    master, slave = pty.openpty()

    def controlling_terminal() -> None:  # the child's own session, with the pty as its tty
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    chat = subprocess.Popen(CHAT + LONG, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=controlling_terminal)
    os.close(slave)
    seen = b""

    def more(timeout: float = 120) -> None:
        nonlocal seen
        ready, _, _ = select.select([master], [], [], timeout)
        assert ready, f"nothing more after {timeout} s: {seen[-400:]!r}"
        seen += os.read(master, 4096)

    def until(pattern: bytes, after: int = 0, timeout: float = 120) -> int:
        """Where the first ``pattern`` after ``after`` ends, once it has been read."""
        deadline = time.monotonic() + timeout
        while pattern not in seen[after:]:
            more(max(0.0, deadline - time.monotonic()))
        return seen.index(pattern, after) + len(pattern)

    try:
        until(b"/help for commands")
        until(b">>> ")
        os.write(master, b"Tell me a story\r")
        mark = until(b"story\r\n")
        while len(seen) < mark + 20:  # the answer is streaming
            more()
        os.write(master, b"\x03")
        mark = until(b"[stopped]", mark)
        until(b">>> ", mark)
        os.write(master, f"/save {saved}\r".encode())
        mark = until(b"saved 2 messages", mark)
        until(b">>> ", mark)
        os.write(master, b"half a line")
        mark = until(b"half a line", mark)
        # readline echoes a key, then goes back to waiting for keys; a signal between the
        # two is seen only with the next key (CPython's readline loop): type as a person would
        time.sleep(1.0)
        os.write(master, b"\x03")  # clears the line: the session goes on, no hint
        cleared, mark = mark, until(b">>> ", mark)
        assert b"Ctrl-C again" not in seen[cleared:mark]
        # the same after readline prints the prompt
        time.sleep(1.0)
        os.write(master, b"\x03")
        mark = until(b"Ctrl-C again or Ctrl-D", mark)
        until(b">>> ", mark)
        time.sleep(1.0)
        os.write(master, b"\x03")
        assert chat.wait(timeout=60) == 0
    finally:
        if chat.poll() is None:
            chat.kill()
        os.close(master)
    assert b"Traceback" not in seen
    messages = json.loads(saved.read_text())
    assert messages[0] == {"role": "user", "content": "Tell me a story"}
    assert messages[1]["role"] == "assistant" and messages[1]["content"]
