"""Anthropic ``thinking`` and OpenAI ``reasoning_effort`` over a model whose chat template has a
thinking switch: Qwen3's real template and tokenizer, through the official SDKs.

The model is scripted as Qwen3 writes: ``<think>``, ``\\n``, "a" four times (a token each),
``\\n``, ``</think>``, then ``\\n\\nDone.``. When the block is already closed (Qwen3's
template writes ``<think>\\n\\n</think>\\n\\n`` into the prompt when ``enable_thinking`` is
false; a reasoning budget forces ``</think>``) it answers at once. Oracles: transformers'
``apply_chat_template`` with and without ``enable_thinking`` (the token counts the server
reports for each ``thinking`` setting), and the script itself (what each setting must show,
the layout newlines dropped as Qwen3's model card drops them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import anthropic
import openai
import pytest

from pipeline.builder import build
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from pipeline.contracts.request import Message
from qwen_files import IM_END, IM_START, oracle_render, qwen_dir, tokenizer
from tests.http_support import config, running
from transports.http import Gateway, ServerConfig

ASK = [{"role": "user", "content": "Think, then answer."}]


def qwen_thinker() -> Pipeline:
    """The scripted Qwen3 model described in the module docstring."""
    tok = tokenizer()
    header = len(tok.encode_text("assistant\n"))
    a, newline = tok.encode_text("a")[0], tok.encode_text("\n")[0]
    think, end_think = (tok.encode_text(m, special=True)[0] for m in ("<think>", "</think>"))

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        written = tok.decode(ids[start + 1 + header:], skip_special_tokens=False)
        if "</think>" in written:  # closed (by the template, the model or the budget)
            target = written[:written.index("</think>")] + "</think>\n\nDone."
            rest = target[len(written):]
            return tok.encode_text(rest, special=True)[0] if rest else IM_END
        if not written:
            return think
        if written == "<think>" or (written.count("a") == 4 and not written.endswith("\n")):
            return newline
        return a if written.count("a") < 4 else end_think

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0))
    return build(qwen_dir(), backend=backend)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
        return qwen_thinker()

    cfg = config(tmp_path_factory.mktemp("usage"), models={"qwen": Path("qwen")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.fixture
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def blocks(message: anthropic.types.Message) -> list[tuple[str, str]]:
    return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", "")) for b in
            message.content]


# thinking setting -> the blocks the script must show
EXPECTED = {
    # the budget counts the tokens after <think>: "\n", "a", "a"
    "enabled": ({"type": "enabled", "budget_tokens": 3}, [("thinking", "aa"), ("text", "Done.")]),
    "adaptive": ({"type": "adaptive"}, [("thinking", "aaaa"), ("text", "Done.")]),
    "between_tools": ({"type": "between_tools"}, [("thinking", "aaaa"), ("text", "Done.")]),
    "displayed": ({"type": "enabled", "budget_tokens": 64, "display": "omitted"},
                  [("thinking", "aaaa"), ("text", "Done.")]),
    "disabled": ({"type": "disabled"}, [("text", "Done.")]),
    "absent": (None, [("thinking", "aaaa"), ("text", "Done.")]),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_thinking_through_messages_create_and_stream(claude: anthropic.Anthropic,
                                                     case: str) -> None:
    thinking, expected = EXPECTED[case]
    extra = {} if thinking is None else {"thinking": thinking}
    whole = claude.messages.create(model="qwen", messages=ASK, max_tokens=40, **extra)  # type: ignore[arg-type]
    assert blocks(whole) == expected and whole.stop_reason == "end_turn"
    with claude.messages.stream(model="qwen", messages=ASK, max_tokens=40, **extra) as stream:  # type: ignore[arg-type]
        kinds = [event.content_block.type for event in stream
                 if event.type == "content_block_start"]
        final = stream.get_final_message()
    assert blocks(final) == expected and kinds == [kind for kind, _ in expected]
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_the_thinking_switch_reaches_the_template(claude: anthropic.Anthropic) -> None:
    """count_tokens and the answer's input tokens follow transformers' template with
    ``enable_thinking`` as ``thinking`` sets it (disabled: the template's empty block)."""
    question = [Message("user", ASK[0]["content"])]
    for thinking, enable in (({"type": "disabled"}, False), ({"type": "adaptive"}, True),
                             ({"type": "enabled", "budget_tokens": 3}, True)):
        oracle = len(oracle_render(question, tokenize=True, enable_thinking=enable))
        counted = claude.messages.count_tokens(model="qwen", messages=ASK, thinking=thinking)  # type: ignore[arg-type]
        answered = claude.messages.create(model="qwen", messages=ASK, max_tokens=40,  # type: ignore[arg-type]
                                          thinking=thinking)  # type: ignore[arg-type]
        assert counted.input_tokens == answered.usage.input_tokens == oracle, thinking
    assert len(oracle_render(question, tokenize=True, enable_thinking=False)) > len(
        oracle_render(question, tokenize=True))


def test_a_thinking_block_sent_back_is_the_turn_s_reasoning(claude: anthropic.Anthropic) -> None:
    """A multi-turn conversation that returns the thinking block: the count equals the
    template's rendering of the assistant turn with that reasoning."""
    first = claude.messages.create(model="qwen", messages=ASK, max_tokens=40,  # type: ignore[arg-type]
                                   thinking={"type": "adaptive"})
    turn = [b.model_dump(exclude_none=True) for b in first.content]
    follow = [*ASK, {"role": "assistant", "content": turn}, {"role": "user", "content": "Again"}]
    counted = claude.messages.count_tokens(model="qwen", messages=follow)  # type: ignore[arg-type]
    oracle = oracle_render([Message("user", ASK[0]["content"]),
                            Message("assistant", "Done.", reasoning_content="aaaa"),
                            Message("user", "Again")], tokenize=True)
    assert counted.input_tokens == len(oracle)


def test_openai_reasoning_effort_none_turns_thinking_off(oai: openai.OpenAI) -> None:
    default = oai.chat.completions.create(model="qwen", messages=ASK, max_tokens=40)  # type: ignore[arg-type]
    message = default.choices[0].message
    assert message.content == "Done." and (message.model_extra or {})["reasoning_content"] == "aaaa"
    for effort in ("low", "high"):
        out = oai.chat.completions.create(model="qwen", messages=ASK, max_tokens=40,  # type: ignore[arg-type]
                                          reasoning_effort=effort)  # type: ignore[arg-type]
        assert (out.choices[0].message.model_extra or {}).get("reasoning_content") == "aaaa"
    off = oai.chat.completions.create(model="qwen", messages=ASK, max_tokens=40,  # type: ignore[arg-type]
                                      reasoning_effort="none")
    assert off.choices[0].message.content == "Done."
    assert (off.choices[0].message.model_extra or {}).get("reasoning_content") is None
    assert off.usage is not None and default.usage is not None
    assert off.usage.prompt_tokens == len(oracle_render(
        [Message("user", ASK[0]["content"])], tokenize=True, enable_thinking=False))
    chunks = list(oai.chat.completions.create(model="qwen", messages=ASK, max_tokens=40,  # type: ignore[call-overload]
                                              stream=True))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("aaaa", "Done.")
