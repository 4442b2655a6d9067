"""Registers the built-in model backends through the ``pipeline_components`` hook."""

from __future__ import annotations

from pipeline.hookspecs import hookimpl
from pipeline.registry import Component


@hookimpl
def pipeline_components() -> list[Component]:
    """The model backends shipped with the library (none yet besides the testing fake)."""
    return []
