"""Helpers for the trace tests: real runs of the default model, and surgical corruptions."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file, save_file

from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.events import Event, digest_text

QUESTION = "Why is the sky usually blue?"


def edit(events: Sequence[Event], match: Callable[[Event], bool],
         change: Callable[[dict[str, Any]], None]) -> list[Event]:
    """A copy of ``events`` where the first event ``match`` accepts has its payload changed."""
    out, done = [], False
    for event in events:
        if not done and match(event):
            payload = json.loads(json.dumps(dict(event.payload)))
            change(payload)
            event, done = attrs.evolve(event, payload=payload), True
        out.append(event)
    assert done, "nothing matched"
    return out


def is_(event_type: str, step: int | None = None) -> Callable[[Event], bool]:
    """A matcher for ``event_type`` (at payload ``step``)."""
    return lambda e: e.event_type == event_type and (step is None or e.payload.get("step") == step)


def append(events: Sequence[Event], event_type: str, payload: dict[str, Any],
           component: str = "tools") -> list[Event]:
    """``events`` plus one new event at the end of the causal order."""
    last = events[-1]
    return [*events, Event(last.trace_id, last.event_id + 1, last.event_id, component,
                           event_type, last.monotonic_ns + 1000, payload)]


def set_text(payload: dict[str, Any], text: str) -> None:
    """Give a full-level delta new text with a consistent digest and length."""
    payload.update(text=text, digest=digest_text(text), bytes=len(text.encode()))


def copy_model(dst: Path) -> Path:
    """A copy of the embedded default model folder."""
    shutil.copytree(TINY_MODEL_DIR, dst)
    return dst


def perturb_weight(folder: Path, name: str, delta: float = 1e-3) -> tuple[float, float]:
    """Add ``delta`` to element [0, 0] of tensor ``name``; returns (old, new) values."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    tensor = weights[name]
    old = float(tensor[0, 0])
    tensor[0, 0] = torch.tensor(old + delta, dtype=torch.float32).to(tensor.dtype)
    save_file(weights, path, metadata={"format": "pt"})
    return old, float(tensor[0, 0])
