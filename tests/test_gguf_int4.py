"""The int4 kernel path for Q4_0, Q4_1, Q4_K, Q5_K and Q8_0 matrices, against the dequantizer
(the oracle that is itself checked against the ``gguf`` package's reference dequantization and
transformers' weights in test_gguf_quants.py and test_gguf_model.py).

Random blocks (every code in every position, every 6-bit sub-block scale and min, float16
scales and mins of both signs):
a one-hot input reads one weight back, which must be the dequantized weight up to the bfloat16
rounding of the block's scale and zero; a random input's product agrees with the dequantized
float32 product to bfloat16 precision; each row's result does not depend on how many rows
came with it (what the batch-invariant mode relies on to run these products untiled).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from backends.gguf.int4 import GROUP, Int4Weight, int4_available, int4_linear
from backends.gguf.quants import QuantizedWeight
from pipeline.errors import ArtifactError, InvalidValueError

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch lacks the int4 kernel")


TYPES = [QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q8_0]
K_BYTES = {QT.Q4_K: 144, QT.Q5_K: 176}


def _blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    if qtype in K_BYTES:  # d, dmin float16, then random scale, high-bit and nibble bytes
        n = rows * cols // 256
        d = (rng.standard_normal((n, 2)) * [0.002, 0.004]).astype(np.float16)
        rest = rng.integers(0, 256, (n, K_BYTES[qtype] - 4), dtype=np.uint8)
        raw = np.concatenate([d.view(np.uint8).reshape(n, 4), rest], axis=1)
        return QuantizedWeight.from_raw(raw.reshape(-1), qtype, (rows, cols))
    n = rows * cols // GROUP
    if qtype == QT.Q8_0:
        d = (rng.standard_normal(n) * 0.002).astype(np.float16)
        qs8 = rng.integers(0, 256, (n, GROUP), dtype=np.uint8)
        raw = np.concatenate([d.view(np.uint8).reshape(n, 2), qs8], axis=1)
        return QuantizedWeight.from_raw(raw.reshape(-1), qtype, (rows, cols))
    d = (rng.standard_normal(n) * 0.02).astype(np.float16)
    qs = rng.integers(0, 256, (n, GROUP // 2), dtype=np.uint8)
    parts = [d.view(np.uint8).reshape(n, 2)]
    if qtype == QT.Q4_1:
        m = (rng.standard_normal(n) * 0.05).astype(np.float16)
        parts.append(m.view(np.uint8).reshape(n, 2))
    raw = np.concatenate([*parts, qs], axis=1)
    return QuantizedWeight.from_raw(raw.reshape(-1), qtype, (rows, cols))


@pytest.mark.parametrize("qtype", TYPES)
def test_each_weight_reads_back_as_the_dequantizer_has_it(qtype: QT) -> None:
    w = _blocks(qtype, 64, 256)
    dense = w.dequantize()                                            # [64, 128]
    got = int4_linear(torch.eye(256), Int4Weight.from_quantized(w)).T   # [64, 256]
    # scale and zero are bfloat16 (8 significant bits): each weight is within a few units of
    # the last place of the block's scale and zero, never a wrong code
    d = dense.abs().amax(dim=1, keepdim=True)
    assert torch.all((got - dense).abs() <= d * 2 ** -6 + 1e-6)
    assert (got - dense).abs().max() < (dense.abs().max() * 0.02)


@pytest.mark.parametrize("qtype", TYPES)
def test_products_agree_with_the_dequantized_product(qtype: QT) -> None:
    w = _blocks(qtype, 96, 256, seed=1)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(96, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.functional.linear(x, w.dequantize(), bias)
    got = int4_linear(x, Int4Weight.from_quantized(w), bias)
    assert got.dtype == torch.float32 and got.shape == (7, 96)
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q5_K])
def test_a_rows_result_does_not_depend_on_its_company(threads: int, qtype: QT) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _rows_alone_and_together(qtype)
    finally:
        torch.set_num_threads(before)


def _rows_alone_and_together(qtype: QT) -> None:
    w = Int4Weight.from_quantized(_blocks(qtype, 160, 256, seed=4))
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([int4_linear(x[i:i + 1], w) for i in range(70)])
    for count in (2, 3, 8, 9, 33, 70):
        assert torch.equal(int4_linear(x[:count], w), alone[:count]), count
    assert torch.equal(int4_linear(x[11:40], w), alone[11:40])


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ArtifactError, match="not Q6_K"):
        Int4Weight.from_quantized(QuantizedWeight.from_raw(
            np.zeros(210 * 16, dtype=np.uint8), QT.Q6_K, (16, 256)))
    with pytest.raises(ArtifactError, match="16 at a time"):
        Int4Weight.from_quantized(_blocks(QT.Q4_0, 8, 64))
    w = Int4Weight.from_quantized(_blocks(QT.Q4_0, 16, 64))
    with pytest.raises(InvalidValueError, match="last dimension must be 64"):
        int4_linear(torch.zeros(2, 32), w)


def test_the_row_probe_tells_a_row_wise_product_from_one_that_is_not() -> None:
    from backends.gguf.load import packed_product, rows_alone

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(7))
    # a product whose rows see their company is caught, one that does not is not
    assert rows_alone(lambda x: torch.cat([r[None] @ w.T for r in x]), 64, torch.float32)
    assert not rows_alone(lambda x: x @ w.T + x.sum(dim=0, keepdim=True)[:, :48], 64,
                          torch.float32)
    assert not rows_alone(lambda x: x @ w.T * (1.0 + 1e-3 * (x.shape[0] > 8)), 64,
                          torch.float32)
    made = packed_product(w.to(torch.bfloat16), 1)
    if made is not None:  # what this machine's oneDNN does, and the product's own result
        product, _, row_wise = made
        x = torch.randn(70, 64, generator=torch.Generator().manual_seed(8))
        got = product(x, None)
        assert got.dtype == torch.float32 and got.shape == (70, 48)
        ref = x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T
        assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
        if row_wise:
            alone = torch.cat([product(x[i:i + 1], None) for i in range(70)])
            assert torch.equal(got, alone)


def test_gate_and_up_of_different_types_are_kept_apart_and_joined() -> None:
    # a K-quant mix (Q4_K_M) may store ffn_gate and ffn_up in different types: each part
    # keeps its own kept form (Q4_K on the int4 kernel, Q6_K in bfloat16), the outputs are
    # joined, and prompt rows' whole-matrix decoder joins the parts as the file has them
    from types import SimpleNamespace

    from backends.gguf.load import DENSE_DTYPE, _Loader, bfloat16_fast

    q6 = np.random.default_rng(11).integers(0, 256, (16, 210), dtype=np.uint8)
    q6[:, 208:] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)  # d
    parts = {"blk.0.ffn_gate.weight": _blocks(QT.Q4_K, 32, 256, seed=9),
             "blk.0.ffn_up.weight": QuantizedWeight.from_raw(q6.reshape(-1), QT.Q6_K,
                                                             (16, 256))}
    f = SimpleNamespace(path="mixed.gguf", tensors={
        name: SimpleNamespace(name=name, data=w.data.numpy(), tensor_type=w.qtype,
                              shape=[w.shape[1], w.shape[0]]) for name, w in parts.items()})
    load = _Loader(f, None, torch.float32, "cpu", quantized=True)  # type: ignore[arg-type]
    placeholder = load.matrices(list(parts), [32, 16], 256)
    assert placeholder.is_meta and tuple(placeholder.shape) == (48, 256)
    (_, multiply, nbytes, row_wise, dense), = load.products
    whole = torch.cat([w.dequantize() for w in parts.values()])             # [48, 256]
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(12))
    ref = x @ whole.T
    got = multiply(x, None)
    assert got.shape == (5, 48)
    assert float((got - ref).norm() / ref.norm()) < 1e-2
    assert nbytes > 0
    if dense is not None:
        assert bfloat16_fast("cpu")
        assert torch.equal(dense(), whole.to(DENSE_DTYPE))
