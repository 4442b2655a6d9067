"""Layer taps on a transformers model: forward hooks on its embeddings and decoder layers.

Owns :class:`Hooks`, which finds a model's decoder layers (the ``ModuleList`` of
``num_hidden_layers`` modules under the base model) and in each its attention block
(``self_attn``, ``attention``, ``attn``, ``self_attention``) and its MLP (``mlp``,
``feed_forward``, ``block_sparse_moe``), and, while a receiver is set, hands each one's output
to it under the names :func:`~pipeline.contracts.model.tap_names` gives. With no receiver no
hook is installed: the model runs as transformers wrote it.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.contracts.model import Tap
from pipeline.errors import ArtifactError

ATTENTION = ("self_attn", "attention", "attn", "self_attention")
MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn")


def _first(module: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, torch.nn.Module):
            return found
    return None


def _hidden(output: Any) -> torch.Tensor:
    """A module's output hidden states: the tensor itself or a tuple's first element."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise TypeError(f"no hidden states in a {type(output).__name__}")


class Hooks:
    """The taps of one model, found when it is loaded (:attr:`points`; empty, with
    :attr:`problem` saying why, for a model whose layers are not laid out as expected);
    :attr:`rows` are the indices of the calls being run, one per row of the model's batch
    (empty: a forward of the backend's own, whose states no receiver asked for)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: list[int] = [0]
        self.problem = ""
        try:
            self.points = _points(model)
        except ArtifactError as exc:
            self.points, self.problem = [], str(exc)
        self._handles: list[Any] = []

    def names(self) -> tuple[str, ...]:
        """The taps' names in forward order (none when the model's layers were not found)."""
        return tuple(name for name, _ in self.points)

    def set(self, tap: Tap | None) -> None:
        """Install hooks that send every tapped output to ``tap`` (None: remove them)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if tap is None:
            return
        if not self.points:
            raise ArtifactError(self.problem)
        for name, module in self.points:
            self._handles.append(module.register_forward_hook(self._hook(name, tap)))

    def _hook(self, name: str, tap: Tap) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if not self.rows:
                return
            hidden = _hidden(output)
            per_row = hidden.reshape(len(self.rows), -1, hidden.shape[-1])       # [B, n, H]
            for row, call in enumerate(self.rows):
                tap(call, name, per_row[row])
        return hook


def _points(model: Any) -> list[tuple[str, Any]]:
    """Every tapped module of ``model`` with its tap's name, in forward order."""
    count = getattr(model.config, "num_hidden_layers", None)
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                   and len(m) == count), None)
    if layers is None:
        raise ArtifactError(f"{type(model).__name__}: no list of num_hidden_layers decoder "
                            "layers found to tap")
    out: list[tuple[str, Any]] = [("embed", model.get_input_embeddings())]
    for i, layer in enumerate(layers):
        attention, mlp = _first(layer, ATTENTION), _first(layer, MLP)
        if attention is None or mlp is None:
            raise ArtifactError(f"{type(layer).__name__}: no attention block "
                                f"({'/'.join(ATTENTION)}) or MLP ({'/'.join(MLP)}) to tap")
        out += [(f"layers.{i}.attention", attention), (f"layers.{i}.mlp", mlp),
                (f"layers.{i}", layer)]
    return out
