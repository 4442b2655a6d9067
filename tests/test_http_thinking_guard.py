"""The thinking guard: a request that states no thinking preference keeps room for its answer.

The model is scripted to open ``<think>`` and write "a" until ``</think>`` appears, which it
never writes itself, then to answer "Done." (``tests/http_support.thinker_model``): without
the guard every answer is thinking cut at ``max_tokens``. Oracles: the rule itself (the
reasoning budget is ``max_tokens - min(answer_reserve_tokens, max_tokens // 3) - 2``, the
two think markers counted, so the reasoning holds exactly that many "a"), the script's answer, and the official SDKs' parsing.
A client that states a preference (Anthropic ``thinking``, OpenAI ``reasoning_effort``) gets
what it asked for, guard or not.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai

from tests.http_support import config, running, thinker_model
from transports.http import Gateway


def test_no_preference_keeps_room_for_the_answer(tmp_path: Path) -> None:
    for reserve, max_tokens in ((4096, 30), (5, 30), (4096, 60)):
        gateway = Gateway(config(tmp_path / f"{reserve}-{max_tokens}",
                                 answer_reserve_tokens=reserve),
                          lambda f, c: thinker_model())
        budget = max_tokens - min(reserve, max_tokens // 3) - 2
        with running(gateway) as url:
            oa = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            chat = oa.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Think."}],
                max_tokens=max_tokens, temperature=0)
            message = chat.choices[0].message
            assert message.content == "Done.", (reserve, max_tokens, message)
            assert getattr(message, "reasoning_content") == "a" * budget
            assert chat.choices[0].finish_reason == "stop"
            an = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
            reply = an.messages.create(model="default", max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": "Think."}])
            kinds = [b.type for b in reply.content]
            assert kinds == ["thinking", "text"], reply.content
            assert reply.content[0].thinking == "a" * budget  # type: ignore[union-attr]
            assert reply.content[1].text == "Done."  # type: ignore[union-attr]
            assert reply.stop_reason == "end_turn"
        gateway.close()


def test_a_stated_preference_is_what_the_client_gets(tmp_path: Path) -> None:
    gateway = Gateway(config(tmp_path), lambda f, c: thinker_model())
    with running(gateway) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        chat = oa.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Think."}], max_tokens=30,
            temperature=0, reasoning_effort="high")
        assert chat.choices[0].finish_reason == "length" and not chat.choices[0].message.content
        an = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
        budgeted = an.messages.create(
            model="default", max_tokens=30, messages=[{"role": "user", "content": "Think."}],
            thinking={"type": "enabled", "budget_tokens": 7})
        assert budgeted.content[0].thinking == "a" * 7  # type: ignore[union-attr]
        assert budgeted.content[1].text == "Done."  # type: ignore[union-attr]
        unbounded = an.messages.create(
            model="default", max_tokens=30, messages=[{"role": "user", "content": "Think."}],
            thinking={"type": "adaptive"})  # type: ignore[typeddict-item]
        assert [b.type for b in unbounded.content] == ["thinking"]
        assert unbounded.stop_reason == "max_tokens"
    gateway.close()
