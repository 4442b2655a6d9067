"""What a trace records about tensors and trace context (DESIGN §7, issue "Recording").

Owns the per-step records of the logits products: the sha256 digest of a row of raw logits
(``z_t``) or of the processed distribution, always; and at ``Recording.FULL`` their top-k
(token id, value, and for processed scores the probability). It also owns the W3C
``traceparent`` parsing that carries a caller's distributed-trace context into the trace.

Digests are over the float32 little-endian bytes of the dense ``[V]`` row, so two runs that
produced bit-identical logits have equal digests whatever dtype or device the backend used
internally; ``-inf`` marks removed candidates in processed rows.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy
import torch

TOP_K = 8
"""How many of the best tokens a ``full`` trace keeps per logits product."""

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def host_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` as contiguous float32 on the CPU (one copy for the whole batch)."""
    return logits.detach().to(device="cpu", dtype=torch.float32).contiguous()


def row_digests(rows: torch.Tensor) -> list[str]:
    """``sha256:`` digests of each row of a CPU float32 ``[B, V]`` tensor."""
    # numpy rows hash through the buffer protocol: no copy, no per-row torch view
    return ["sha256:" + hashlib.sha256(row).hexdigest() for row in rows.numpy()]


def same_bits(host_row: torch.Tensor, row: torch.Tensor) -> bool:
    """Whether ``row`` (any dtype or device) as float32 equals the CPU float32 ``host_row``
    bit for bit (a bytes comparison: several times cheaper than ``torch.equal`` here)."""
    other = row.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return bool(host_row.numpy().tobytes() == other.numpy().tobytes())


def raw_top(row: torch.Tensor, k: int = TOP_K) -> list[list[float]]:
    """The ``k`` largest raw logits of ``row [V]`` as ``[token_id, logit]`` pairs."""
    values, ids = torch.topk(row, min(k, row.shape[0]))
    return [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]


def processed_top(row: torch.Tensor, k: int = TOP_K) -> list[list[float]]:
    """The ``k`` most likely candidates of a processed row ``[V]``: ``[id, score, prob]``.

    Removed candidates (``-inf``) are left out, so fewer than ``k`` may come back.
    """
    probs = torch.softmax(row, dim=0)
    values, ids = torch.topk(row, min(k, row.shape[0]))
    return [[int(i), float(v), float(probs[i])]
            for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]


def logits_record(rows: torch.Tensor, full: Sequence[bool]) -> list[dict[str, Any]]:
    """One payload fragment per row of raw logits ``rows [B, V]`` (CPU float32); rows whose
    ``full`` flag is set also get their top-k."""
    width = int(rows.shape[1])
    records: list[dict[str, Any]] = [{"digest": d, "shape": [width]} for d in row_digests(rows)]
    for i, keep in enumerate(full):  # index only the rows asked for: a tensor view costs µs
        if keep:
            records[i]["top"] = raw_top(rows[i])
    return records


def processed_record(rows: torch.Tensor, full: Sequence[bool],
                     known: Sequence[str | None] | None = None) -> list[dict[str, Any]]:
    """One payload fragment per row of processed scores ``rows [B, V]`` (CPU float32):
    digest and number of surviving candidates; top-k where ``full``.

    ``known[i]``, when given, is row i's digest already (its raw logits' digest, when the
    caller saw that processing left the row bit-identical); hashing is skipped for it.
    """
    data = rows.numpy()
    candidates = numpy.isfinite(data).sum(axis=1).tolist()  # numpy: ~10x less overhead
    digests = [k if k is not None else "sha256:" + hashlib.sha256(row).hexdigest()
               for k, row in zip(known or [None] * len(data), data)]
    records: list[dict[str, Any]] = [
        {"digest": d, "candidates": int(n)} for d, n in zip(digests, candidates)]
    for i, keep in enumerate(full):
        if keep:
            records[i]["top"] = processed_top(rows[i])
    return records


def parse_traceparent(value: object) -> tuple[dict[str, str] | None, str | None]:
    """A W3C ``traceparent`` header value as ``{version, trace_id, parent_id, flags}``.

    Returns ``(context, None)`` when valid and ``(None, why)`` otherwise; as the W3C Trace
    Context spec asks, an invalid header is ignored (the trace records why), never an error.
    """
    if not isinstance(value, str):
        return None, "traceparent must be a string"
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None, "traceparent must look like 00-<32 hex>-<16 hex>-<2 hex> (lowercase)"
    version, trace_id, parent_id, flags = match.groups()
    if version == "ff":
        return None, "traceparent version ff is forbidden"
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None, "traceparent trace-id and parent-id must not be all zeros"
    return {"version": version, "trace_id": trace_id, "parent_id": parent_id,
            "flags": flags}, None
