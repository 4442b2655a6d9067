"""Shared test helper: the tiny model's tokenizer made to add a BOS, as Llama's does.

:func:`bos_tokenizer_file` writes a copy of the tiny model's ``tokenizer.json`` whose
post-processor puts ``<|im_start|>`` (id :data:`BOS`) before every single sequence, so tests
can check that a raw prompt is tokenized as transformers' ``tokenizer(text)`` does (BOS
added by the post-processor, nothing at the end).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.model_paths import TINY_MODEL_DIR

BOS = 1
"""The id of ``<|im_start|>`` in the tiny vocabulary: the BOS the post-processor adds."""


def bos_tokenizer_file(folder: Path) -> Path:
    """The tiny model's tokenizer.json with a TemplateProcessing that puts the BOS first."""
    data = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS],
                                            "tokens": ["<|im_start|>"]}}}
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(data))
    return path
