"""Hook specifications: how plugins, built-in or third-party, add components to the registry.

A plugin is any module or object with functions marked ``@pipeline.hookimpl`` named after the
specs below. Built-ins (``stages``, ``backends``, ``transports``) register through these very
hooks, found through the ``pipeline`` entry-point group declared in ``pyproject.toml``; a
third party adds its own entry point to that group, or passes the object to
``build(plugins=[...])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pipeline.registry import Component

PROJECT = "pipeline"
"""The pluggy project name: hooks here are ``pipeline_*``, the entry-point group ``pipeline``."""

hookspec = pluggy.HookspecMarker(PROJECT)
"""Marks the hook specifications below (for this module only)."""

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a plugin's implementation of a hook: ``@hookimpl`` over a function named after the
spec (``def pipeline_components(): ...``), in a module or on an object's method."""


@hookspec
def pipeline_components() -> Sequence[Component]:  # type: ignore[empty-body]
    """Return the components this plugin provides.

    Each :class:`~pipeline.registry.Component` names its kind (``renderer``, ``tokenizer``,
    ``backend``, ``processor``, ``selector``, ``detokenizer``, ``stopper``, ``transport``,
    ``strategy``, ``tool_parser``; ``tool`` for a tool executor and ``tool_policy`` for an
    authorization policy, see :mod:`pipeline.tools`), a
    name unique within that kind, a factory taking a
    :class:`~pipeline.registry.BuildContext`, and a one-line summary for ``pipeline plugins``.
    Called once per registry load; it must not import heavy modules eagerly if avoidable
    (factories may import lazily).

    Example::

        @hookimpl
        def pipeline_components():
            return [Component("processor", "ban13", lambda ctx: Ban13(), "bans token 13")]
    """
