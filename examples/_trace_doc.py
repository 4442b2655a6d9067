"""Shared by the worked-trace scripts: run the default model, write Markdown about its trace.

Each script in ``examples/trace_*.py`` regenerates one page of ``docs/worked_traces/`` from a
real run, so the shapes, cache lengths, events and diffs in the docs stay true.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline import Pipeline
from pipeline.events import Event
from pipeline.trace import Trace, check, load

DOCS = Path(__file__).resolve().parent.parent / "docs" / "worked_traces"
FIELDS = ("step", "seq", "slot", "start", "tokens", "cache_len", "token_id", "bytes", "final",
          "processors", "seed", "reason", "detail", "state")


def decode_fn(pipe: Pipeline) -> Any:
    """``tokenizer.decode`` for invariant 5."""
    tokenizer = pipe.stages.tokenizer
    assert tokenizer is not None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _cell(event: Event) -> str:
    p = event.payload
    parts = [f"{k}={json.dumps(p[k], ensure_ascii=False)}" for k in FIELDS
             if k in p and p[k] is not None]
    if event.event_type == "stream.delta" and "text" in p:
        parts.append(f"text={json.dumps(p['text'], ensure_ascii=False)}")
    if isinstance(p.get("logits"), dict):
        top = p["logits"].get("top", [])[:2]
        parts.append(f"z {p['logits']['digest'][:15]}… top {top}")
    if isinstance(p.get("processed"), dict):
        parts.append(f"candidates={p['processed']['candidates']}")
        if p["processed"].get("top"):
            best = p["processed"]["top"][0]
            parts.append(f"p(top)={best[2]:.3f} for {best[0]}")
    if p.get("draw") is not None:
        parts.append(f"u={p['draw']:.4f}")
    return " ".join(parts).replace("|", "\\|")


def event_table(events: Sequence[Event], keep: Any = None) -> str:
    """Markdown table of events (id, parent, component, type, key fields)."""
    rows = ["| id | parent | component | event | payload (key fields) |", "|---|---|---|---|---|"]
    for e in events:
        if keep is None or keep(e):
            rows.append(f"| e{e.event_id} | {'e' + str(e.parent_event_id) if e.parent_event_id else ''}"
                        f" | {e.component} | `{e.event_type}` | {_cell(e)} |")
    return "\n".join(rows)


def check_block(trace: Trace, pipe: Pipeline) -> str:
    """The ``trace check`` report as a code block."""
    return "```text\n" + check(trace, detokenize=decode_fn(pipe)).render() + "\n```"


def write(name: str, text: str) -> Path:
    """Write ``docs/worked_traces/<name>`` and say so."""
    DOCS.mkdir(parents=True, exist_ok=True)
    path = DOCS / name
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return path


def trace_of(completion: Any) -> Trace:
    """The trace of a completion."""
    return load(completion)
