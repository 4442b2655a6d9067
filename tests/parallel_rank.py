"""One rank of a tensor/expert-parallel group, for tests/test_parallel.py (run by torchrun, or
by the test with torchrun's variables set).

``python tests/parallel_rank.py FOLDER OUT MODE``. Every rank joins the group and loads its
part of FOLDER; ranks > 0 serve rank 0 until it closes the group. Rank 0:

- ``greedy``: a batched prefill of two prompts, then 8 batched greedy decode steps, a
  hidden-states call; saves every logit row, the tokens and the hidden states to OUT;
- ``kill``: writes ``OUT.ready`` after its prefill, then decodes until a call fails; writes the
  error's type and message to OUT as JSON;
- ``idle``: with a 3 s step timeout, waits 6 s after its prefill, then decodes one step (the
  other ranks' wait for a call is not bounded by the step timeout).
Each rank writes its process id to ``OUT.pid<rank>`` first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from backends.torch.parallel import join_group, parallel_backend
from pipeline.contracts.model import PrefillChunk

PROMPTS = [[1, 5, 9, 17, 33, 64, 2, 7, 11, 3], [44, 45, 46]]


def prefilled(backend: Any) -> tuple[list[int], torch.Tensor]:
    """Two slots with :data:`PROMPTS` prefilled in one batch: the slots and the logits."""
    slots = [backend.allocate() for _ in PROMPTS]
    z = backend.prefill([PrefillChunk(s, tuple(p), 0, True) for s, p in zip(slots, PROMPTS)])
    return slots, z


def greedy(backend: Any) -> dict[str, Any]:
    """The ``greedy`` mode's calls on any backend (split on rank 0, or whole in one process
    as the test's oracle): every logit row of the prefill and 8 batched greedy steps, the
    tokens, and the hidden states of the first prompt."""
    slots, z = prefilled(backend)
    rows, tokens = [z], []
    for _ in range(8):
        picked = [int(i) for i in z.argmax(-1)]
        tokens.append(picked)
        z = backend.decode(slots, picked)
        rows.append(z)
    return {"logits": torch.cat(rows), "tokens": tokens,
            "hidden": backend.hidden_states(PROMPTS[0])}


def main() -> None:
    folder, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    shard = join_group(timeout_s=3 if mode == "idle" else 30)
    Path(f"{out}.pid{shard.rank}").write_text(str(os.getpid()))
    backend = parallel_backend(folder, shard, num_slots=2, max_context=64, dtype="float32")
    if mode == "greedy":
        torch.save(greedy(backend), out)
        backend.close()
        return
    slots, z = prefilled(backend)
    if mode == "idle":  # idle longer than the step timeout, then one more step
        time.sleep(6)
        z = backend.decode(slots, [int(i) for i in z.argmax(-1)])
        torch.save({"logits": z}, out)
    else:
        Path(f"{out}.ready").write_text("1")
        started, steps = time.monotonic(), 0
        try:
            while time.monotonic() - started < 120:
                z = backend.decode(slots, [int(i) for i in z.argmax(-1)])
                steps += 1
                if backend.cache_length(slots[0]) >= 60:  # stay in the window: start over
                    for s in slots:
                        backend.truncate(s, len(PROMPTS[0]) if s == slots[0] else len(PROMPTS[1]))
            outcome = {"error": None, "steps": steps}
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc), "steps": steps}
        out.write_text(json.dumps(outcome))
        os._exit(0)  # the group is broken: leave without waiting on it
    backend.close()


if __name__ == "__main__":
    main()
