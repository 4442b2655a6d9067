"""Train ``tiny-flow``: rectified flow over token embeddings (``src/pipeline/diffusion_models/flow``).

The path is flow_matching's ``CondOTScheduler``: x_t = (1 - t) ε + t x1 with t ~ U(0, 1)
per block (t = 0 is noise, t = 1 the data x1, the tokens' unit-RMS embeddings). The model is
told t and predicts x1 as logits over the vocabulary; the velocity it implies is
v = (x̂1 - x_t) / (1 - t), integrated with Euler or Heun (``strategy="flow"``). Everything
else is shared with the diffusion model (``scripts/continuous_training.py``).

Usage::

    python scripts/train_flow.py --minutes 15
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import continuous_training as ct  # noqa: E402

GENERATION = {"family": "flow", "strategy": "flow", "block_length": 16, "steps": 16,
              "solver": "euler"}


def corrupt_for(cfg: ct.TrainConfig) -> ct.Corrupt:
    """Per block: t ~ U(0, 1), x_t = (1 - t) ε + t x1, time t."""
    def corrupt(x1: torch.Tensor, blocks: torch.Tensor, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = blocks.shape
        per_block = torch.rand((b, int(blocks.max()) + 1), generator=gen)
        t = per_block.gather(1, blocks)                                       # [B, N]
        noise = torch.randn(x1.shape, generator=gen)
        return (1 - t[..., None]) * noise + t[..., None] * x1, t

    return corrupt


if __name__ == "__main__":
    ct.run(None, "flow", corrupt_for, GENERATION,
           ct.ROOT / "src" / "pipeline" / "diffusion_models" / "flow",
           __doc__.split("\n\n")[0])
