"""The per-step logits records: sha256 in place on the CPU, a device-reduced fingerprint
elsewhere (docs/design.md §6), and their properties checked against independent computations."""

from __future__ import annotations

import hashlib

import numpy
import torch

from pipeline.recording import fingerprints, processed_record, row_digests, same_bits


def _rows(b: int = 3, v: int = 1000) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(4))


def test_cpu_digests_are_sha256_of_the_float32_bytes() -> None:
    rows = _rows()
    want = ["sha256:" + hashlib.sha256(numpy.asarray(r, dtype="<f4").tobytes()).hexdigest()
            for r in rows.numpy()]
    assert row_digests(rows) == want


def test_the_fingerprint_sees_every_bit_and_every_position() -> None:
    rows = _rows(1, 4096)
    base = fingerprints(rows)[0]
    assert base.startswith("fp128:") and len(base) == len("fp128:") + 32
    assert fingerprints(rows.clone()) == [base]                      # deterministic
    bits = rows.view(torch.int32)
    gen = torch.Generator().manual_seed(9)
    for _ in range(200):  # flip one random bit of one random logit
        j = int(torch.randint(0, 4096, (1,), generator=gen))
        b = int(torch.randint(0, 32, (1,), generator=gen))
        flipped = bits.clone()
        flipped[0, j] ^= (1 << b) if b < 31 else -(1 << 31)
        assert fingerprints(flipped.view(torch.float32))[0] != base
    swapped = rows.clone()
    swapped[0, [10, 20]] = swapped[0, [20, 10]]
    assert fingerprints(swapped)[0] != base                          # order matters
    seen = {fingerprints(_rows(1, 4096) + i)[0] for i in range(50)}
    assert len(seen) == 50


def test_the_fingerprint_of_a_row_does_not_depend_on_its_batch() -> None:
    rows = _rows(5, 777)
    alone = [fingerprints(rows[i:i + 1])[0] for i in range(5)]
    assert fingerprints(rows) == alone


def test_processed_records_count_candidates_and_reuse_known_digests() -> None:
    rows = _rows(2, 50)
    rows[0, :10] = float("-inf")
    records = processed_record(rows, [False, True], known=["sha256:known", None])
    assert [r["candidates"] for r in records] == [40, 50]
    assert records[0]["digest"] == "sha256:known"
    assert records[1]["digest"] == row_digests(rows[1:])[0]
    assert "top" in records[1] and "top" not in records[0]
    assert same_bits(rows[1], rows[1].clone()) and not same_bits(rows[1], rows[1] + 1e-6)
