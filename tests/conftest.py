"""Fixtures and hooks shared by test modules.

``make test`` runs the suite on two pytest-xdist workers, a test file per worker at a time
(``-n 2 --dist loadfile``, so a module's fixtures are built once). Each worker then runs torch
on one thread (the two of them fill a two-core machine; child processes the tests start
inherit it), and the slowest files are handed out first, so no long file starts last.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch is imported: OpenMP reads it once
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SLOWEST_FIRST = (
    "test_batch_invariance.py", "test_gguf_converter.py", "test_structured_budget.py",
    "test_gguf_model.py", "test_docs.py", "test_schema_collection.py",
    "test_http_schemathesis.py", "test_tool_choice.py", "test_structured_default_model.py",
    "test_speculative.py", "test_cli_chat.py", "test_speculative_sampling.py",
    "test_cli_strategy.py", "test_http_hostile.py", "test_http_slow_clients.py",
)
"""Test files by their time on an idle two-core machine, slowest first (measured with
``pytest --durations``); the rest follow in their usual order. Only the order changes."""


FAST = (
    # pipeline: the types, the registry, the engine over scripted backends, events, records
    "test_types.py", "test_events.py", "test_registry.py", "test_layers.py", "test_engine.py",
    "test_pacing.py", "test_prepared.py", "test_recording.py", "test_job_records.py",
    # stages: processors, selectors, detokenizing, rendering, tool-call parsing
    "test_processors.py", "test_selectors.py", "test_dry_penalty.py", "test_detokenize.py",
    "test_render.py", "test_tool_parsers.py",
    # backends: GGUF dequantization, the int8 KV cache
    "test_gguf_quants.py", "test_kv_int8.py",
    # transports: server-sent events, the Responses store, typed output parts
    "test_sse.py", "test_responses_store.py", "test_output_parts.py",
)
"""The developer's inner loop (``make test-fast``, or ``pytest -m fast``): files that run in
well under a minute together on two cores and touch every package. ``make test`` still runs
everything; a file here is marked ``fast``, nothing else changes."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps the rest
    for item in items:
        if item.path.name in FAST:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and lose a lot on a busy machine.

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
