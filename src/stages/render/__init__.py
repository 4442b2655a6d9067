"""Renderers: structured messages to prompt text with control/content spans.

:class:`HFChatTemplateRenderer` runs a Hugging Face chat template in a jinja2 sandbox;
:class:`PlainRenderer` labels roles in plain text for models without a template.
"""

from stages.render.hf_template import HFChatTemplateRenderer
from stages.render.plain import PlainRenderer

__all__ = ["HFChatTemplateRenderer", "PlainRenderer"]
