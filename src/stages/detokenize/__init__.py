"""Incremental detokenizers: token ids in, text that is safe to emit out.

- :class:`IncrementalDetokenizer` — works over any tokenizer's ``decode`` with offset windows
  (the default, registered as ``"incremental"``);
- :class:`ByteLevelDetokenizer` — byte-level BPE only, from a per-id byte table, no decode call
  per token.

Both satisfy :class:`pipeline.contracts.text.Detokenizer`: pieces never end in a broken UTF-8 tail,
and they concatenate to ``tokenizer.decode(output_ids)``.
"""

from stages.detokenize.bytelevel import ByteLevelDetokenizer, BytesState, bytes_to_unicode
from stages.detokenize.incremental import IncrementalDetokenizer, TextDecoder, WindowState

__all__ = [
    "ByteLevelDetokenizer",
    "BytesState",
    "IncrementalDetokenizer",
    "TextDecoder",
    "WindowState",
    "bytes_to_unicode",
]
