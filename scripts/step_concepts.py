"""The concepts of one engine step and the lines that hold them (docs/engine_step.md).

Run from the repository root: ``PYTHONPATH=src python scripts/step_concepts.py``. It checks
that every name of the concept table below exists where the table says, and prints the table,
the lines of each module of ``src/pipeline/engine/`` and ``src/pipeline/runtime/`` (what
``wc -l`` counts), and the lines of the ``Engine`` class.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

CONCEPTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("engine", "pipeline.engine.loop", ("Engine", "EngineConfig")),
    ("request record", "pipeline.engine.job", ("Job",)),
    ("request spec", "pipeline.engine.job_spec", ("JobSpec",)),
    ("output", "pipeline.engine.text_state", ("TextState",)),
    ("handle", "pipeline.engine.handle", ("RequestHandle", "RequestState")),
    ("trace", "pipeline.engine.recorder", ("Recorder",)),
    ("KV", "pipeline.engine.paging", ("KVMemory", "Paging", "SlotMemory")),
    ("KV blocks", "pipeline.engine.blocks", ("BlockManager",)),
    ("pacer", "pipeline.engine.pacing", ("Pacer",)),
    ("strategy", "pipeline.contracts.strategy", ("Strategy",)),
    ("plan", "pipeline.contracts.strategy", ("Plan",)),
    ("model call", "pipeline.contracts.model", ("ModelCall", "PrefillChunk")),
    ("backend", "pipeline.contracts.model", ("Backend",)),
    ("rows", "pipeline.contracts.decode", ("Row",)),
    ("update", "pipeline.engine.commit", ("Committer",)),
    ("update", "pipeline.contracts.strategy", ("Update", "Taken")),
    ("forcing", "pipeline.contracts.forcing", ("Forcing",)),
    ("delta", "pipeline.contracts.output", ("Delta",)),
)
"""(concept, module, names): the processor chain and the selector are the strategy's, inside
its ``update`` (docs/design.md §3)."""


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def class_lines(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def main() -> None:
    print("| concept | names | module |\n|---|---|---|")
    for concept, module, names in CONCEPTS:
        found = importlib.import_module(module)
        missing = [n for n in names if not hasattr(found, n)]
        assert not missing, f"{module} lacks {missing}"
        print(f"| {concept} | {', '.join(f'`{n}`' for n in names)} | `{module}` |")
    for package in ("engine", "runtime"):
        folder = SRC / "pipeline" / package
        counts = {p.name: lines(p) for p in sorted(folder.glob("*.py"))}
        print(f"\npipeline/{package}/: {sum(counts.values())} lines")
        print("  " + ", ".join(f"{name} {n}" for name, n in counts.items()))
    print(f"\nEngine class: {class_lines(SRC / 'pipeline/engine/loop.py', 'Engine')} lines")


if __name__ == "__main__":
    main()
