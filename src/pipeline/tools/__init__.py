"""Tools across the reality boundary (docs/design.md §11): everything after a call is parsed.

The parsers that read calls out of the model's text are a stage family (``stages/toolcalls``);
this package owns what the core does with a parsed call:

- :mod:`pipeline.tools.parsing` — which parser a model gets (from its chat template);
- :mod:`pipeline.tools.schema` — typed Python functions as tools (JSON schemas from hints
  and docstrings);
- :mod:`pipeline.tools.executor` — the executor and policy plugins (:class:`ToolExecutor`
  with its optional capabilities :class:`KeyedExecutor` and :class:`OutcomeLookup`,
  :class:`ToolPolicy`, :class:`FunctionTool`, :class:`AllowAll`, :class:`Rules`);
- :mod:`pipeline.tools.ledger` — the durable write-ahead record of commits, locked across
  threads and processes (exactly one attempt per key executes), and :class:`Resolution` for
  calls in doubt;
- :mod:`pipeline.tools.boundary` — validate → authorize → commit → execute, each a
  ``tool.*`` event; resolving and recovering after a crash;
- :mod:`pipeline.tools.loop` — the in-process loop behind :meth:`pipeline.Pipeline.run`.
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
