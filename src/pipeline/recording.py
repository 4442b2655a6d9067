"""What a trace records about tensors and trace context (docs/design.md §7, issue "Recording").

Owns the per-step records of the logits products: the sha256 digest of a row of raw logits
(``z_t``) or of the processed distribution, always; and at ``Recording.FULL`` their top-k
(token id, value, and for processed scores the probability) and, for raw logits, the row's
``logsumexp``, so that any recorded logit ``z`` reads as the model's own probability
``exp(z - logsumexp)`` (before temperature and the other processors). It also owns the W3C
``traceparent`` parsing that carries a caller's distributed-trace context into the trace.

Digests are over the float32 bits of the dense ``[V]`` row, so two runs that produced
bit-identical float32 logits have equal digests whatever dtype the backend computed in;
``-inf`` marks removed candidates in processed rows. Where the rows live decides how
(docs/design.md §6: no full ``[B, V]`` host copy per step):

- on the CPU, ``sha256:`` of the row's bytes, hashed in place (no copy);
- on an accelerator, ``fp128:``, a fingerprint reduced on the device: two sums over the row
  of its float32 bit patterns times fixed odd 64-bit multipliers, one per position, modulo
  2**64. Changing any one logit (any bit) changes each sum, a reordering changes it, and only
  the two 64-bit sums cross to the host. It is a fingerprint, not a cryptographic hash: two
  different rows collide only by accident (about 2**-128 for unrelated rows).

A trace compares digests of the same kind; a CPU run and an accelerator run of one request
differ at their first logits anyway (their float32 bits are not equal).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from pipeline.events import digest_bytes

TOP_K = 8
"""How many of the best tokens a ``full`` trace keeps per logits product."""

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def host_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` as contiguous float32 on the CPU (one copy for the whole batch)."""
    return logits.detach().to(device="cpu", dtype=torch.float32).contiguous()


def record_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` as contiguous float32 where they are (no host copy)."""
    return logits.detach().to(dtype=torch.float32).contiguous()


_MULTIPLIERS: dict[tuple[int, str], torch.Tensor] = {}


def _multipliers(width: int, device: torch.device) -> torch.Tensor:
    """Fixed odd int64 multipliers ``[2, width]`` (the same in every process)."""
    key = (width, str(device))
    if key not in _MULTIPLIERS:
        gen = torch.Generator().manual_seed(0x5EED_F1A9)
        values = torch.randint(-(1 << 62), 1 << 62, (2, width), generator=gen,
                               dtype=torch.int64) * 2 + 1
        _MULTIPLIERS[key] = values.to(device)
    return _MULTIPLIERS[key]


def fingerprints(rows: torch.Tensor) -> list[str]:
    """``fp128:`` fingerprints of each row of a float32 ``[B, V]`` tensor, reduced on the
    tensor's own device (see the module docstring); one ``[B, 2]`` transfer."""
    bits = rows.view(torch.int32).to(torch.int64)                            # [B, V]
    mult = _multipliers(rows.shape[1], rows.device)                          # [2, V]
    sums = torch.stack([(bits * mult[0]).sum(1), (bits * mult[1]).sum(1)], 1)  # [B, 2]
    return [f"fp128:{a & 0xFFFF_FFFF_FFFF_FFFF:016x}{b & 0xFFFF_FFFF_FFFF_FFFF:016x}"
            for a, b in sums.tolist()]


def row_digests(rows: torch.Tensor) -> list[str]:
    """Digests of each row of a float32 ``[B, V]`` tensor: ``sha256:`` on the CPU (hashed
    in place through the buffer protocol), ``fp128:`` on an accelerator."""
    if rows.device.type != "cpu":
        return fingerprints(rows)
    return ["sha256:" + hashlib.sha256(row).hexdigest() for row in rows.numpy()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float32 rows on one device are equal bit for bit (on the CPU a bytes
    comparison: several times cheaper than ``torch.equal`` there)."""
    if a.device.type == "cpu" and b.device.type == "cpu":
        return bool(a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes())
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


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
    """One payload fragment per row of raw logits ``rows [B, V]`` (float32, on any device);
    rows whose ``full`` flag is set also get their top-k and their ``logsumexp``."""
    width = int(rows.shape[1])
    records: list[dict[str, Any]] = [{"digest": d, "shape": [width]} for d in row_digests(rows)]
    for i, keep in enumerate(full):  # index only the rows asked for: a tensor view costs µs
        if keep:
            records[i]["top"] = raw_top(rows[i])
            records[i]["logsumexp"] = float(torch.logsumexp(rows[i], dim=0))
    return records


def tap_record(name: str, row: torch.Tensor, keep: bool) -> dict[str, Any]:
    """A layer tap's record in a ``taps`` trace: the hidden state ``row [H]`` (any dtype, any
    device) at the position whose logits the step produced, as the digest of its float32
    bytes, its largest magnitude and its root mean square; with ``keep`` its values too."""
    row32 = row.detach().float().cpu()
    record: dict[str, Any] = {"name": name,
                              "digest": digest_bytes(row32.numpy().tobytes()),
                              "max_abs": float(row32.abs().max()),
                              "rms": float(row32.pow(2).mean().sqrt())}
    if keep:
        record["values"] = row32.tolist()
    return record


def processed_record(rows: torch.Tensor, full: Sequence[bool],
                     known: Sequence[str | None] | None = None) -> list[dict[str, Any]]:
    """One payload fragment per row of processed scores ``rows [B, V]`` (float32, on any
    device): digest and number of surviving candidates; top-k where ``full``.

    ``known[i]``, when given, is row i's digest already (its raw logits' digest, when the
    caller saw that processing left the row bit-identical); hashing is skipped for it.
    """
    known = list(known or [None] * rows.shape[0])
    if rows.device.type == "cpu":
        data = rows.numpy()
        candidates = numpy.isfinite(data).sum(axis=1).tolist()  # numpy: ~10x less overhead
        digests = [k if k is not None else "sha256:" + hashlib.sha256(row).hexdigest()
                   for k, row in zip(known, data)]
    else:
        candidates = torch.isfinite(rows).sum(1).tolist()
        todo = [i for i, k in enumerate(known) if k is None]
        fresh = iter(fingerprints(rows[todo]) if todo else [])
        digests = [k if k is not None else next(fresh) for k in known]
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
