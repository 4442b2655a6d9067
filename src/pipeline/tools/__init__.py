"""Tool calls, in one place: reading them out of the model's text, then carrying them out.

A tool call has two halves, and the boundary between them is the parsed
:class:`~pipeline.contracts.request.ToolCall` (docs/design.md §11):

**The stage: calls read out of generated text** (in the engine, per request, as text is
released; :mod:`pipeline.output_parts` feeds the reader). Nothing here has an effect.

- :mod:`pipeline.tools.formats` — one parser per model family's format (Hermes/Qwen,
  Llama 3.x JSON, Mistral), registered as the ``tool_parser`` stage family, and
  :func:`~pipeline.tools.formats.choose_parser`, which one a model gets (from its template);
- :mod:`pipeline.tools.reader` — what the formats' readers share (one call's life, ids,
  repeats dropped); :mod:`pipeline.tools.scan` — one call object scanned as it streams, and
  the strict judge of a finished one;
- :mod:`pipeline.tools.grammars` — each format's call grammars (forced and optional calls);
  :mod:`pipeline.tools.choice` — a request's ``tool_choice`` applied through them before it
  is queued;
- :mod:`pipeline.tools.fallback` — what a chat template does with tools (the probes), and
  the Hermes tool block for one that renders none.

**The loop: calls carried across the reality boundary and their results fed back** (on the
caller's thread, after a generation ends; :meth:`pipeline.Pipeline.run`). Each step is a
``tool.*`` event in the generation's trace.

- :mod:`pipeline.tools.schema` — typed Python functions as tools (JSON schemas from hints
  and docstrings);
- :mod:`pipeline.tools.executor` — the executor and policy plugins (:class:`ToolExecutor`
  with its optional capabilities :class:`KeyedExecutor` and :class:`OutcomeLookup`,
  :class:`ToolPolicy`, :class:`FunctionTool`, :class:`AllowAll`, :class:`Rules`);
- :mod:`pipeline.tools.ledger` — the durable write-ahead record of commits, locked across
  threads and processes (exactly one attempt per key executes), and :class:`Resolution` for
  calls in doubt;
- :mod:`pipeline.tools.boundary` — validate → authorize → commit → execute; resolving and
  recovering after a crash;
- :mod:`pipeline.tools.loop` — the in-process loop: generate, take the parsed calls through
  the boundary, append the results as ``tool`` messages, generate again.
"""

from pipeline.tools.boundary import CallOutcome, ToolBoundary
from pipeline.tools.executor import (
    AllowAll, Decision, FunctionTool, KeyedExecutor, OutcomeLookup, Rules, ToolExecutor,
    ToolPolicy, Verdict,
)
from pipeline.tools.ledger import Entry, JsonlLedger, Ledger, MemoryLedger, Resolution
from pipeline.tools.loop import Round, ToolRun, run_tools
from pipeline.tools.schema import tool_spec

__all__ = ["AllowAll", "CallOutcome", "Decision", "Entry", "FunctionTool", "JsonlLedger",
           "KeyedExecutor", "Ledger", "MemoryLedger", "OutcomeLookup", "Resolution", "Round",
           "Rules", "ToolBoundary", "ToolExecutor", "ToolPolicy", "ToolRun", "Verdict",
           "run_tools", "tool_spec"]
