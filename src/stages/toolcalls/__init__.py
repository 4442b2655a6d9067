"""Tool-call parsing: one parser per model family's format (docs/design.md §11).

Owns the parsers (:mod:`stages.toolcalls.formats`: Hermes/Qwen ``<tool_call>``, Llama 3.x JSON
and ``<|python_tag|>``, Mistral ``[TOOL_CALLS]``), the reader they share
(:mod:`stages.toolcalls.reader`) and the incremental call scanner (:mod:`stages.toolcalls.scan`).
A parser implements :class:`~pipeline.contracts.text.ToolCallParser`; its readers are fed
committed text and give answer text, tool-call deltas (the name first, then argument
fragments as they are generated) and finished calls. The engine runs one per request that
offers tools, so the in-process API and the HTTP dialects read calls the same way.
"""

from stages.toolcalls.formats import HermesParser, Llama3Parser, MistralParser
from stages.toolcalls.reader import CallReader, call_id
from stages.toolcalls.scan import CallScanner, judge

PARSERS = {"hermes": HermesParser, "llama3_json": Llama3Parser, "mistral": MistralParser}
"""The built-in parsers by registered name."""

__all__ = ["PARSERS", "CallReader", "CallScanner", "HermesParser", "Llama3Parser",
           "MistralParser", "call_id", "judge"]
