"""Which part of a model one rank of a tensor/expert-parallel group holds: :class:`Shard`.

Owns the sharding rule, kept apart from the code that runs it (:mod:`backends.torch.parallel`)
so the loader can read a shard without importing ``torch.distributed``. Over ``world`` ranks,
rank ``r`` holds (Megatron's layout):

- attention: query heads ``[r·Hq/W, (r+1)·Hq/W)`` and the key/value heads they read
  (``[r·Hkv/W, (r+1)·Hkv/W)``): the rows of ``q``, ``k``, ``v`` (column-parallel) and the
  matching columns of ``o`` (row-parallel); its KV cache holds only those heads;
- dense MLP and a shared expert: rows ``[r·I/W, (r+1)·I/W)`` of gate and of up, the same
  columns of down;
- routed experts: experts ``[r·E/W, (r+1)·E/W)`` whole (expert parallelism); the router is
  every rank's;
- embeddings, norms and the output head: every rank's whole copy.

A row-parallel projection's bias is rank 0's alone (the partial sums are added up once). W
must divide Hkv, I, E and the shared expert's width: :meth:`Shard.check` names what does not.
"""

from __future__ import annotations

import attrs

from backends.torch.config import ModelSpec
from pipeline.errors import ArtifactError


@attrs.frozen
class Shard:
    """Rank ``rank`` of ``world`` (``0 <= rank < world``)."""

    rank: int
    world: int

    def span(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` equal parts' whole (``world`` divides ``n``)."""
        part = n // self.world
        return self.rank * part, (self.rank + 1) * part

    def check(self, spec: ModelSpec) -> None:
        """Raise :class:`~pipeline.errors.ArtifactError` naming each size ``world`` does not
        divide."""
        sizes = {"num_key_value_heads": spec.num_kv_heads}
        if _has_dense_mlp(spec):
            sizes["intermediate_size"] = spec.intermediate_size
        if spec.moe is not None:
            sizes["num_experts"] = spec.moe.num_experts
            if spec.moe.shared_intermediate_size:
                sizes["shared_expert_intermediate_size"] = spec.moe.shared_intermediate_size
        bad = [f"{name}={n}" for name, n in sizes.items() if n % self.world]
        if bad:
            raise ArtifactError(f"this model does not split over {self.world} ranks: "
                                f"{', '.join(bad)} must be multiples of {self.world}")

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec of this rank's part: its heads and its slice of the dense MLP (the routed
        experts' count stays the model's: the router scores them all)."""
        dense = spec.intermediate_size // self.world if _has_dense_mlp(spec) else \
            spec.intermediate_size
        return attrs.evolve(spec, num_heads=spec.num_heads // self.world,
                            num_kv_heads=spec.num_kv_heads // self.world,
                            intermediate_size=dense)


def _has_dense_mlp(spec: ModelSpec) -> bool:
    """Whether some layer has a dense MLP (an all-MoE model's ``intermediate_size`` is
    unused)."""
    return len(spec.moe_layers) < spec.num_layers
