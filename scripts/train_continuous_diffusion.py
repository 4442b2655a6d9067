"""Train ``tiny-continuous``: Gaussian diffusion over token embeddings (``src/pipeline/diffusion_models/continuous``).

A clean block x0 (the tokens' unit-RMS embeddings) is noised to x_t = √ᾱ_t x0 + √(1-ᾱ_t) ε
at a timestep t drawn uniformly from the schedule's T = 1000 per block (cosine schedule,
diffusers' ``squaredcos_cap_v2``); the model is told t/T and predicts x0 as logits over the
vocabulary. Sampling is DDPM or DDIM (``strategy="ddpm"`` / ``"ddim"``). Everything else is
shared with the flow model (``scripts/continuous_training.py``).

Usage::

    python scripts/train_continuous_diffusion.py --minutes 15
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import continuous_training as ct  # noqa: E402

from stages.strategies.continuous.schedules import NoiseSchedule  # noqa: E402

SCHEDULE = {"beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 1000}
GENERATION = {"family": "continuous_diffusion", "strategy": "ddim", "block_length": 16,
              "steps": 20, "noise_schedule": SCHEDULE}


def corrupt_for(cfg: ct.TrainConfig) -> ct.Corrupt:
    """Per block: t ~ U{0..T-1}, x_t = add_noise(x0, ε, t), time t/T."""
    schedule = NoiseSchedule.make(SCHEDULE["beta_schedule"], SCHEDULE["num_train_timesteps"])
    steps = schedule.num_train_timesteps

    def corrupt(x0: torch.Tensor, blocks: torch.Tensor, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = blocks.shape
        per_block = torch.randint(0, steps, (b, int(blocks.max()) + 1), generator=gen)
        t = per_block.gather(1, blocks)                                       # [B, N]
        noise = torch.randn(x0.shape, generator=gen)
        return schedule.add_noise(x0, noise, t), t.float() / steps

    return corrupt


if __name__ == "__main__":
    ct.run(None, "continuous_diffusion", corrupt_for, GENERATION,
           ct.ROOT / "src" / "pipeline" / "diffusion_models" / "continuous",
           __doc__.split("\n\n")[0])
