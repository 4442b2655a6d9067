"""Registers the built-in text-side stages through the ``pipeline_components`` hook.

Factories import their modules lazily, so listing the registry stays cheap (the tool-call
parsers, plain Python beside the tool loop in :mod:`pipeline.tools`, are listed from
:data:`~pipeline.tools.formats.PARSERS`).
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.hookspecs import hookimpl
from pipeline.registry import BuildContext, Component
from pipeline.tools.formats import PARSERS

PROCESSOR_SUMMARIES = {
    "allowed_tokens": "remove every token outside allowed_token_ids",
    "banned_tokens": "remove banned_token_ids",
    "logit_bias": "add logit_bias to the named tokens",
    "min_tokens": "remove EOS and stop tokens until min_tokens outputs exist",
    "repetition_penalty": "penalize prompt and output tokens multiplicatively",
    "presence_penalty": "subtract presence_penalty from tokens already output",
    "frequency_penalty": "subtract frequency_penalty per earlier occurrence",
    "dry": "penalize tokens that would extend a repeated run of the output (DRY)",
    "temperature": "divide logits by the temperature",
    "top_k": "keep the k most likely tokens",
    "top_p": "keep the smallest set with probability mass >= top_p",
    "min_p": "keep tokens with probability >= min_p times the top one",
    "typical_p": "locally typical sampling",
}
STOPPER_SUMMARIES = {
    "eos": "end at an EOS token or a stop_token_ids token",
    "max_tokens": "end after max_tokens outputs",
    "stop_strings": "end at a stop string, matched across token boundaries",
    "deadline": "end when runtime_limits.deadline_s has passed",
}


def _model_dir(ctx: BuildContext, what: str) -> Any:
    if ctx.model_dir is None:
        raise ArtifactError(f"the {what} needs a model or tokenizer folder")
    return ctx.model_dir


def _processor(name: str) -> Any:
    def factory(ctx: BuildContext) -> Any:
        from stages.process import make_processor

        return make_processor(name)

    return factory


def _grammar(ctx: BuildContext) -> Any:
    from stages.structured import GrammarProcessor

    return GrammarProcessor(ctx.tokenizer)


def _stopper(name: str) -> Any:
    def factory(ctx: BuildContext) -> Any:
        from stages.stop import make_stopper

        return make_stopper(name)

    return factory


def _hf_renderer(ctx: BuildContext) -> Any:
    from stages.render import HFChatTemplateRenderer

    return HFChatTemplateRenderer.from_dir(_model_dir(ctx, "chat-template renderer"))


def _plain_renderer(ctx: BuildContext) -> Any:
    from stages.render import PlainRenderer

    return PlainRenderer()


def _hf_tokenizer(ctx: BuildContext) -> Any:
    from stages.tokenize import HFTokenizer

    return HFTokenizer.from_dir(_model_dir(ctx, "tokenizer"))


def _gguf_tokenizer(ctx: BuildContext) -> Any:
    from pipeline.gguf_file import opened
    from stages.gguf import gguf_tokenizer

    f = opened(ctx)
    return gguf_tokenizer(f.metadata, str(f.path))


def _gguf_renderer(ctx: BuildContext) -> Any:
    """The file's chat template (``tokenizer.chat_template``); a file without one (a base
    model, as llama.cpp's converter writes it from a folder with no template) gets the plain
    renderer, as a Hugging Face folder without a template does."""
    from pipeline.gguf_file import opened
    from stages.gguf import CHAT_TEMPLATE, gguf_renderer
    from stages.render import PlainRenderer

    f = opened(ctx)
    if CHAT_TEMPLATE not in f.metadata:
        return PlainRenderer()
    return gguf_renderer(f.metadata, str(f.path))


def _detokenizer(ctx: BuildContext) -> Any:
    from stages.detokenize import IncrementalDetokenizer

    if ctx.tokenizer is None:
        raise ArtifactError("the incremental detokenizer needs a tokenizer")
    return IncrementalDetokenizer(ctx.tokenizer)


def _selector(name: str) -> Any:
    def factory(ctx: BuildContext) -> Any:
        from stages.select import SELECTORS

        return SELECTORS[name]()

    return factory


def _autoregressive(ctx: BuildContext) -> Any:
    from stages.strategies import AutoregressiveStrategy

    if ctx.strategy_options:
        raise InvalidValueError("strategy_options", dict(ctx.strategy_options),
                                "the autoregressive strategy takes no options (did you mean "
                                "strategy='speculative'?)")
    return AutoregressiveStrategy


def _iterative(name: str) -> Any:
    """The factory of a masked-diffusion or a continuous strategy."""
    def factory(ctx: BuildContext) -> Any:
        if name in CONTINUOUS_SUMMARIES:
            from stages.strategies.continuous.options import continuous_maker as maker
        else:
            from stages.strategies.diffusion.options import diffusion_maker as maker
        return maker(name)(ctx)

    return factory


def _speculative(ctx: BuildContext) -> Any:
    from stages.strategies.spec_options import speculative_maker

    return speculative_maker(ctx)


def _made(cls: Any) -> Any:
    return lambda ctx: cls()


CONTINUOUS_SUMMARIES = {
    "ddpm": "continuous diffusion over embeddings, DDPM ancestral sampling, in blocks",
    "ddim": "continuous diffusion over embeddings, DDIM sampling (eta), in blocks",
    "flow": "rectified flow over embeddings, Euler or Heun, in blocks",
}


@hookimpl
def pipeline_components() -> list[Component]:
    """Renderers and tokenizers (a folder's, a GGUF file's), processors, selectors,
    detokenizer, stoppers, strategies, tool parsers."""
    comps = [
        Component("renderer", "hf_chat_template", _hf_renderer,
                  "Hugging Face chat template (jinja2, sandboxed)"),
        Component("renderer", "plain", _plain_renderer, "role-labelled plain text"),
        Component("tokenizer", "hf", _hf_tokenizer, "tokenizers (tokenizer.json)"),
        Component("tokenizer", "gguf", _gguf_tokenizer,
                  "a GGUF file's tokenizer (tokenizer.ggml.*) as a tokenizers BPE"),
        Component("renderer", "gguf", _gguf_renderer,
                  "a GGUF file's chat template (tokenizer.chat_template)"),
        Component("detokenizer", "incremental", _detokenizer,
                  "incremental, never a broken UTF-8 tail"),
        Component("selector", "greedy", _selector("greedy"), "argmax (ties to the lowest id)"),
        Component("selector", "sample", _selector("sample"),
                  "inverse-CDF sampling, uniform = f(seed, stream, step); greedy at T=0"),
        Component("strategy", "autoregressive", _autoregressive, "one token per step"),
        Component("strategy", "speculative", _speculative,
                  "k drafts (n-gram lookup or a draft model) verified in one forward"),
        Component("strategy", "llada", _iterative("llada"),
                  "masked diffusion: semi-autoregressive blocks, low-confidence or random "
                  "remasking"),
        Component("strategy", "fast_dllm", _iterative("fast_dllm"),
                  "masked diffusion: commit every position above a confidence threshold"),
        Component("strategy", "dfm", _iterative("dfm"),
                  "discrete flow matching on tokens: mixture path, discrete Euler solver"),
    ]
    comps.append(Component("processor", "grammar", _grammar,
                           "remove tokens the request's grammar (JSON schema) forbids next"))
    comps += [Component("processor", n, _processor(n), s) for n, s in PROCESSOR_SUMMARIES.items()]
    comps += [Component("stopper", n, _stopper(n), s) for n, s in STOPPER_SUMMARIES.items()]
    comps += [Component("tool_parser", n, _made(cls), cls.summary) for n, cls in PARSERS.items()]
    comps += [Component("strategy", n, _iterative(n), s)
              for n, s in CONTINUOUS_SUMMARIES.items()]
    return comps
