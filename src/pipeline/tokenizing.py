"""A model's text stages without its weights, and a prompt rendered and counted with them.

Owns which tokenizer and chat renderer a model gets (:func:`tokenizer_stage`,
:func:`renderer_stage`: a GGUF file's own, a folder's ``tokenizer.json`` and chat template,
or the plain renderer), :func:`load_tokenizer` (both, for a model named as ``build`` names
it, with no backend built and no weight read), :func:`render_request` (a request's prompt as
text: a raw prompt as it is, token ids decoded for the trace, messages through the chat
template) and :func:`count_tokens`. :func:`~pipeline.build` and
:class:`~pipeline.pipe.Pipeline` use these; ``pipeline count`` uses them alone, so counting
never loads torch (about 1.7 s of a command's start on a small machine).

Example::

    tokenizer, renderer = load_tokenizer("smollm2")
    n = count_tokens(tokenizer, renderer, "hello world")      # as Pipeline.count_tokens
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import attrs

from pipeline.contracts.request import Request
from pipeline.contracts.text import Rendered, Renderer, Tokenizer
from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.events import digest_text
from pipeline.model_paths import DEFAULT_MODEL, is_gguf_file, resolve_model
from pipeline.options import BackendOptions
from pipeline.registry import BuildContext, Registry

TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
"""A folder's files that may hold its chat template."""
RAW_PROMPT_DIGEST = digest_text("raw-prompt:v1")
RAW_IDS_DIGEST = digest_text("raw-prompt-ids:v1")


def tokenizer_stage(registry: Registry, context: BuildContext,
                    value: str | Tokenizer | None) -> Tokenizer | None:
    """The tokenizer ``value`` names (a registered name, or one given), else the model's
    own: a GGUF file's, or a folder's ``tokenizer.json`` (None: the folder has none)."""
    if value is None:
        if context.model_file is not None:
            value = "gguf"
        elif context.model_dir is None or not (context.model_dir / "tokenizer.json").exists():
            return None
        else:
            value = "hf"
    return cast(Tokenizer, resolve(registry, "tokenizer", value, context))


def renderer_stage(registry: Registry, context: BuildContext,
                   value: str | Renderer | None) -> Renderer | None:
    """The renderer ``value`` names, else the model's own chat template (a GGUF file's, a
    folder's), else the plain renderer; None without a model."""
    if value is None:
        if context.model_file is not None:
            value = "gguf"
        elif context.model_dir is None:
            return None
        else:
            has_template = any((context.model_dir / f).exists() for f in TEMPLATE_FILES)
            value = "hf_chat_template" if has_template else "plain"
    return cast(Renderer, resolve(registry, "renderer", value, context))


def resolve(registry: Registry, kind: str, value: Any, context: BuildContext) -> Any:
    """A stage given by name made by the registry's factory; an instance as it is."""
    return registry.create(kind, value, context) if isinstance(value, str) else value


def load_tokenizer(model: str | Path | None = None, *, plugins: tuple[object, ...] = ()
                   ) -> tuple[Tokenizer, Renderer | None]:
    """The tokenizer and chat renderer :func:`~pipeline.build` gives ``model`` (resolved as
    there; None is the default model), made by the same factories, without the weights: no
    backend is built and no weight is read (``pipeline count``). ``build(tokenizer=...,
    renderer=...)`` over them counts and renders as ``build(model)`` does. Raises
    :class:`~pipeline.errors.ArtifactError` when ``model`` has no tokenizer."""
    registry = Registry(plugins)
    found = resolve_model(DEFAULT_MODEL if model is None else model)
    if found.file is not None and not is_gguf_file(found.file):
        raise InvalidValueError("model", str(model), "a model file must be a GGUF file")
    context = BuildContext(model_dir=found.directory, options=BackendOptions(),
                           model_file=found.file)
    tok = tokenizer_stage(registry, context, None)
    if tok is None:
        raise ArtifactError(f"{model or DEFAULT_MODEL}: no tokenizer (a model folder needs "
                            "tokenizer.json)")
    return tok, renderer_stage(registry, attrs.evolve(context, tokenizer=tok), None)


def render_request(request: Request, renderer: Renderer | None, tokenizer: Tokenizer,
                   add_generation_prompt: bool = True) -> Rendered:
    """``request``'s prompt as text: a raw prompt as it is, token ids decoded (for the
    trace; never encoded again), messages through ``renderer`` with the request's tools and
    template kwargs. ArtifactError for messages without a renderer."""
    if request.prompt is not None:
        return Rendered.plain(request.prompt, RAW_PROMPT_DIGEST, "raw")
    if request.prompt_ids is not None:
        text = tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        return Rendered.plain(text, RAW_IDS_DIGEST, "raw")
    if renderer is None:
        raise ArtifactError("this pipeline has no renderer for chat messages: build it from "
                            "a model folder with a chat template, pass renderer=, or give a "
                            "raw prompt as Request(prompt=...)")
    kwargs = dict(request.template_kwargs)
    kwargs.setdefault("add_generation_prompt", add_generation_prompt)
    return renderer.render(request.messages, tools=request.tools_shown, **kwargs)


def count_tokens(tokenizer: Tokenizer, renderer: Renderer | None, text: str) -> int:
    """The tokens of ``text`` as one user turn through the chat template, with the generation
    prompt: :meth:`Pipeline.count_tokens <pipeline.pipe.Pipeline.count_tokens>` of a string."""
    request = Request.coerce(text)
    return len(tokenizer.encode(render_request(request, renderer, tokenizer)))
