"""Linear layers for the torch backend: plain ``F.linear``, or oneDNN-packed float32 weights.

A decode step is a chain of matrix-vector products with a handful of rows, so it runs at the
speed the CPU streams weights. MKL's ``sgemm`` (what ``F.linear`` calls for float32) reads
them at about two thirds of the machine's copy bandwidth for one row and at a third for two
to eight rows; oneDNN with weights reordered once into its blocked layout (the path
``torch.compile``'s CPU backend uses) reads them at close to the copy bandwidth
(``benchmarks/torch_backend.py``, ``docs/performance.md``).

:class:`Linears` holds those packed copies, keyed by the plain tensor they were made from,
so the model keeps passing its ordinary weights around and asks ``linears(x, w, b)``; a weight
with no packed copy (another dtype, another device, a build without oneDNN) goes to
``F.linear``. Packing is float32-on-CPU only: oneDNN's bfloat16 path needs AVX-512 or
AVX-NE-CONVERT. The packed copies take as much memory again as the weights they copy.

With ``invariant`` set (a batch-invariant model), every product runs on tiles of a fixed
number of rows (:mod:`backends.torch.invariant`), so a row's result does not depend on how
many rows came with it. Without it, every product still runs on one of a few row counts
(:func:`bounded_rows`): oneDNN compiles a kernel for each shape it meets and keeps it in a
cache (about 0.5-0.8 MB each, bfloat16 and packed float32 alike), and a serving engine's row
counts (decode batches, prompt chunks, each expert's share of them) take hundreds of values,
so without the bound the caches fill with one-off shapes and their churn grows the heap
(``docs/performance.md``, resident memory).

Example::

    linears = Linears.pack(model_weights)          # Linears.plain() packs nothing
    y = linears(x, weights.q, weights.q_bias)      # [T, out]
    y_e = linears.expert(x_rows, moe.gate_up, e)   # rows of expert e: [n, 2I]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from backends.torch.invariant import NARROW_TILE, WIDE_TILE, RowTiles, tiled_rows
from backends.torch.weights import MlpWeights, ModelWeights, MoeWeights

ROW_TILE = 256
"""Rows per product at most without batch invariance: more are cut into tiles of this many
(a tile this tall already keeps the matrix units busy), the rest padded to :func:`row_bucket`."""

LinearFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``fn(x [T, in], bias) -> [T, out]``: a weight's own matrix product (e.g. one that keeps
the weight quantized and dequantizes it chunk by chunk)."""
DenseFn = Callable[[], torch.Tensor]
"""``fn() -> [out, in]``: a kept-quantized weight decoded whole, in the dtype its dense
products run in, for the rows of prompt chunks (:class:`PromptRows`)."""
ExpertFetch = Callable[[int], "tuple[torch.Tensor, bool]"]
"""``fetch(e) -> (matrix, packed)``: expert ``e``'s matrix of a tiered stack, and whether it
is a oneDNN-packed copy (:class:`~backends.torch.experts.ExpertCache`)."""


def row_bucket(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: the next power of two up to 32
    (decode batches: a few rows more cost nothing beside streaming the weight), then the next
    multiple of 32 (at most 31 padding rows); thirteen sizes up to :data:`ROW_TILE`."""
    if rows <= 32:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 32) * 32


def bounded_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
    """``product(x)`` for ``x [T, in]``, computed on row counts of a fixed, small set: tiles of
    :data:`ROW_TILE` rows and one last part padded with zero rows to :func:`row_bucket` (its
    padding's results dropped). Returns ``[T, out]``. The set is what bounds oneDNN's kernel
    caches (module doc); unlike :func:`~backends.torch.invariant.tiled_rows` a row's bits may
    still depend on the rows that came with it. Off the CPU it is ``product(x)``."""
    rows = x.shape[0]
    if rows == 0 or x.device.type != "cpu":  # oneDNN is the CPU's library
        return product(x)
    whole = rows - rows % ROW_TILE
    parts = [product(tile) for tile in torch.split(x[:whole], ROW_TILE)] if whole else []
    if whole < rows:
        rest = x[whole:]
        pad = row_bucket(rows - whole) - rest.shape[0]
        if pad:
            rest = torch.cat([rest, rest.new_zeros((pad, *rest.shape[1:]))])
        parts.append(product(rest)[:rows - whole])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class PromptRows:
    """Which of a forward's token rows belong to prompt chunks (``prompt[r]``).

    A weight kept quantized multiplies one row at a time at the speed it streams the weight
    (a decode step), but many rows at that same per-row cost: a 512-token prompt chunk takes
    seven times as long on torch's int4 kernel as decoding the weight once and running one
    dense product (``docs/performance.md``). A product registered with a ``dense`` weight
    therefore runs prompt rows densely and the other rows on its own product; a row's kind
    comes from its own call, never from the batch, so batch invariance holds."""

    def __init__(self, prompt: Sequence[bool], device: torch.device,
                 plan: RowTiles | None = None) -> None:
        self.rows = len(prompt)
        self.any = any(prompt)
        self.all = self.any and all(prompt)
        self.other_tiles: RowTiles | None = None
        """The other rows' tiles, each row keeping its class in ``plan`` (the forward's token
        rows' plan of a batch-invariant model)."""
        if self.any and not self.all:  # index tensors only for a mixed forward
            picked = torch.tensor(list(prompt), dtype=torch.bool, device=device)
            self.prompt_index = picked.nonzero().squeeze(1)
            self.other_index = (~picked).nonzero().squeeze(1)
            if plan is not None and plan.rows == self.rows:
                self.other_tiles = RowTiles(
                    [wide for wide, p in zip(plan.wide, prompt) if not p], device)


def packing_available(weight: torch.Tensor) -> bool:
    """Whether this torch can pack ``weight`` for oneDNN (float32, CPU, oneDNN built in)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linears:
    """``F.linear`` with packed weights where a packed copy exists (see the module docstring).

    Keys are ``id()`` of the plain weight tensors (and the expert index for stacked experts),
    so the weights must outlive this object, as a model's do. Not thread-safe to build; read
    only afterwards.
    """

    def __init__(self) -> None:
        self._packed: dict[tuple[int, int], torch.Tensor] = {}
        self._own: dict[int, LinearFn] = {}
        self._row_wise: set[int] = set()
        self._dense: dict[int, DenseFn] = {}
        self._tiers: dict[int, ExpertFetch] = {}
        self.prompt_rows: PromptRows | None = None
        """The kinds of the token rows of the forward being run (set by the model)."""
        self.own_bytes = 0
        """Memory the registered products hold (their encoded weights)."""
        self.invariant = False
        """Batch-invariant products (:mod:`backends.torch.invariant`): rows on fixed tiles,
        as :attr:`plan` says, or :data:`~backends.torch.invariant.NARROW_TILE` rows."""
        self.plan: RowTiles | None = None
        """The row plan of the products being run (the model sets its forward's token rows'
        plan, then its output rows' plan for the output head); a product of another number of
        rows (routed experts' rows) runs on narrow tiles."""

    def register(self, weight: torch.Tensor, multiply: LinearFn, nbytes: int = 0, *,
                 row_wise: bool = False, dense: DenseFn | None = None) -> None:
        """Multiply by ``weight`` (typically a ``meta`` placeholder of the right shape that
        stands in the model's weights) with ``multiply`` instead of ``F.linear``; ``nbytes``
        is the memory ``multiply`` holds for it. ``row_wise``: ``multiply`` computes each row
        of its input on its own (its result for a row never depends on the other rows, as a
        test of that product shows), so a batch-invariant model runs it untiled. ``dense``:
        the weight decoded whole, for the rows of prompt chunks (:class:`PromptRows`); called
        once per forward that has such rows, its result dropped after the product."""
        self._own[id(weight)] = multiply
        self.own_bytes += nbytes
        if row_wise:
            self._row_wise.add(id(weight))
        if dense is not None:
            self._dense[id(weight)] = dense

    def register_experts(self, stack: torch.Tensor, fetch: ExpertFetch) -> None:
        """Take the matrices of the expert stack ``stack`` (a ``meta`` placeholder) from
        ``fetch(e)`` (an expert cache, :mod:`backends.torch.experts`)."""
        self._tiers[id(stack)] = fetch

    @property
    def tiered(self) -> bool:
        """Whether some expert stack is fetched from an expert cache."""
        return bool(self._tiers)

    @classmethod
    def plain(cls) -> Linears:
        """No packed copies: every call is ``F.linear``."""
        return cls()

    @classmethod
    def pack(cls, weights: ModelWeights, *, experts: bool = True) -> Linears:
        """Packed copies of every matrix of ``weights`` that :func:`packing_available` allows;
        the routed experts' stacks too when ``experts``."""
        out = cls()
        for key, matrix in _matrices(weights, experts):
            if packing_available(matrix):
                out._packed[key] = torch.ops.mkldnn._reorder_linear_weight(matrix, 1)
        return out

    def __len__(self) -> int:
        return len(self._packed)

    @property
    def packed_bytes(self) -> int:
        """Memory the packed copies take."""
        return sum(t.numel() * t.element_size() for t in self._packed.values())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in] @ weight.T (+ bias)``: ``[T, out]``."""
        dense = self._dense.get(id(weight))
        kinds = self.prompt_rows
        if dense is not None and kinds is not None and kinds.any and kinds.rows == x.shape[0]:
            return self._by_kind(x, weight, bias, dense, kinds)
        return self._call(x, weight, bias)

    def _by_kind(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 dense: DenseFn, kinds: PromptRows) -> torch.Tensor:
        """Prompt rows on the decoded weight, the others on the weight's own product."""
        w = dense()
        if kinds.all:
            return self._dense_product(x, w, bias)
        prompt = self._dense_product(x.index_select(0, kinds.prompt_index), w, bias)
        rest = x.index_select(0, kinds.other_index)
        tiles = kinds.other_tiles
        if self.invariant and id(weight) not in self._row_wise and tiles is not None:
            other = tiles.apply(rest, lambda rows: self._product(rows, weight, bias))
        else:
            other = self._call(rest, weight, bias)
        out = prompt.new_empty((kinds.rows, prompt.shape[1]))
        out[kinds.prompt_index] = prompt
        out[kinds.other_index] = other
        return out

    def _dense_product(self, x: torch.Tensor, w: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` in ``w``'s dtype (on wide tiles for a batch-invariant model),
        returned in ``x``'s."""
        xs = x.to(w.dtype)
        out = (tiled_rows(xs, lambda rows: F.linear(rows, w), WIDE_TILE) if self.invariant
               else bounded_rows(xs, lambda rows: F.linear(rows, w))).to(x.dtype)
        return out + bias if bias is not None else out

    def _call(self, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        def product(rows: torch.Tensor) -> torch.Tensor:
            return self._product(rows, weight, bias)
        if id(weight) in self._row_wise:  # each row on its own: nothing to tile; the row
            return bounded_rows(x, product)  # counts still bounded, for oneDNN's caches
        if not self.invariant:
            return bounded_rows(x, product)
        plan = self.plan
        if plan is not None and plan.rows == x.shape[0]:
            return plan.apply(x, product)
        return tiled_rows(x, product, NARROW_TILE)

    def _product(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        own = self._own.get(id(weight))
        if own is not None:
            return own(x, bias)
        packed = self._packed.get((id(weight), -1))
        if packed is None and weight.dtype != x.dtype:  # stored narrower: computed in its dtype
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
        if packed is None:
            return F.linear(x, weight, bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out

    def expert(self, x: torch.Tensor, stack: torch.Tensor, e: int) -> torch.Tensor:
        """``x [n, in] @ stack[e].T`` for a stack of expert matrices ``[E, out, in]``."""
        fetch = self._tiers.get(id(stack))
        if fetch is not None:  # once per product: one routing, however many tiles
            matrix, is_packed = fetch(e)
            if self.invariant:
                return tiled_rows(x, lambda rows: _tiered(rows, matrix, is_packed), NARROW_TILE)
            return bounded_rows(x, lambda rows: _tiered(rows, matrix, is_packed))
        if self.invariant:
            return tiled_rows(x, lambda rows: self._expert(rows, stack, e), NARROW_TILE)
        return bounded_rows(x, lambda rows: self._expert(rows, stack, e))

    def _expert(self, x: torch.Tensor, stack: torch.Tensor, e: int) -> torch.Tensor:
        packed = self._packed.get((id(stack), e))
        if packed is None:
            return F.linear(x, stack[e])
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out


def _tiered(x: torch.Tensor, matrix: torch.Tensor, packed: bool) -> torch.Tensor:
    """``x @ matrix.T`` for an expert cache's matrix (oneDNN-packed or plain)."""
    if not packed:
        return F.linear(x, matrix)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, matrix, None, "none", [], "")
    return out


def _matrices(weights: ModelWeights, experts: bool) -> Iterator[tuple[tuple[int, int], torch.Tensor]]:
    """Every weight matrix a forward multiplies by, with its key."""
    def mlp(w: MlpWeights) -> list[torch.Tensor]:
        return [w.gate_up, w.down]

    plain = [weights.lm_head]
    for layer in weights.layers:
        a = layer.attention
        plain += [a.q, a.k, a.v, a.o]
        if isinstance(layer.mlp, MoeWeights):
            plain.append(layer.mlp.router)
            if layer.mlp.shared is not None:
                plain += mlp(layer.mlp.shared)
            if layer.mlp.shared_gate is not None:
                plain.append(layer.mlp.shared_gate)
            if experts:
                for stack in (layer.mlp.gate_up, layer.mlp.down):
                    for e in range(stack.shape[0]):
                        yield (id(stack), e), stack[e]
        else:
            plain += mlp(layer.mlp)
    for matrix in plain:
        yield (id(matrix), -1), matrix
