"""Continuous diffusion and flow matching over token embeddings (docs/design.md §10, issue 14).

Owns the pure math (:mod:`.schedules`: noise schedules and timestep spacings; :mod:`.updates`:
the DDPM, DDIM, Euler and Heun update rules; :mod:`.noise`: counter-based Gaussian draws), how
a block's trajectory moves under each rule (:mod:`.integrators`), and the strategies built on
them (:mod:`.strategy`: ``ddpm``, ``ddim`` and ``flow``, generating semi-autoregressively in
blocks; :mod:`.options`: their options and registered factories). See ``docs/continuous.md``.
"""
