"""The whole text path on the real Qwen3 tokenizer: build() from a tokenizer-only folder,
exact counting against transformers, and generation over a scripted model with the real
renderer, tokenizer, detokenizer and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pipeline import FinishReason, Message, build
from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.testing import ScriptedBackend, peaked
from qwen_files import CONVERSATIONS, oracle_render, qwen_dir, tokenizer


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_a_tokenizer_only_folder_counts_exactly_like_transformers(name: str) -> None:
    messages, tools, kwargs = CONVERSATIONS[name]
    with build(qwen_dir()) as pipe:
        assert pipe.engine is None
        request = pipe.request(messages, tools=tools, template_kwargs=kwargs)
        assert pipe.count_tokens(request) == len(oracle_render(messages, tools, tokenize=True,
                                                               **kwargs))


def test_a_tokenizer_only_pipeline_refuses_to_generate() -> None:
    with build(qwen_dir()) as pipe:
        with pytest.raises(ArtifactError, match="no model backend"):
            pipe.generate("hi")


def _spelling_backend(answer_ids: list[int], prompt_len: int, vocab: int,
                      eos: int) -> ScriptedBackend:
    def choose(tokens: Sequence[int]) -> int:
        at = len(tokens) - prompt_len
        return answer_ids[at] if at < len(answer_ids) else eos

    return ScriptedBackend(vocab, peaked(vocab, choose))


def test_generation_streams_whole_characters_and_trims_the_stop_string() -> None:
    tok = tokenizer()
    answer = "Rayleigh 散射 makes the sky 🌤️ blue. END and more text"
    answer_ids = tok.encode_text(answer)
    question = [Message("user", "Why is the sky blue?")]
    with build(qwen_dir()) as counter:
        m = counter.count_tokens(question)
    eos = min(tok.eos_token_ids)
    backend = _spelling_backend(answer_ids, m, tok.vocab_size, eos)
    with build(qwen_dir(), backend=backend) as pipe:
        handle = pipe.submit(question, max_tokens=100, temperature=0, stop=["END"])
        deltas = list(handle.deltas())
        done = handle.result()
    assert done.text == "Rayleigh 散射 makes the sky 🌤️ blue. "
    assert done.finish_reason is FinishReason.STOP_STRING and done.stop_reason == "END"
    assert "".join(d.text for d in deltas) == done.text
    assert all("\ufffd" not in d.text and "E" not in d.text for d in deltas)


def test_logit_bias_outside_the_vocabulary_is_rejected_once_it_is_known() -> None:
    tok = tokenizer()
    backend = _spelling_backend([], 0, tok.vocab_size, min(tok.eos_token_ids))
    with build(qwen_dir(), backend=backend) as pipe:
        with pytest.raises(InvalidValueError, match="logit_bias") as info:
            pipe.submit("hi", logit_bias={tok.vocab_size + 5: 3.0})
        assert info.value.value == tok.vocab_size + 5
        assert pipe.generate("hi", max_tokens=2, temperature=0).finish_reason is FinishReason.EOS
