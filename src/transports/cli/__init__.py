"""The command line (``pipeline run | chat | count | demo | plugins | trace | serve``): a face of
the library, above the core and the transports (docs/design.md §14).

Only this package of ``pipeline`` imports the transports (``serve`` starts the HTTP server of
:mod:`transports.http`; tests/test_layers.py holds the rule); it also bounds a torch backend's
native memory for ``run``, ``chat`` and ``serve``.

==============  ============================================================================
``commands``    :func:`main` and the argument parser of every command; ``serve``, ``count``,
                ``plugins``, ``trace``, ``demo``
``run``         ``pipeline run``: one prompt, streamed, with ``--verbose`` timings
``chat``        ``pipeline chat``: a conversation in the terminal, with its ``/`` commands
``start``       the loading and ready lines a start prints (before torch is imported, on a
                terminal)
``strategy``    the strategy flags that ``run``, ``chat`` and ``serve`` share
==============  ============================================================================
"""

from __future__ import annotations

from transports.cli.commands import main

__all__ = ["main"]
