"""GGML dequantization in torch against ``gguf.quants.dequantize`` (llama.cpp's numpy
reference), a GGUF file written by ``gguf.GGUFWriter`` and read back by ``gguf.GGUFReader``,
and the quantized linear against dequantize + ``F.linear``.

Blocks are random bytes whose float16 scale fields are overwritten with small finite values,
so every bit pattern of the quantized fields occurs; where ``gguf.quants.quantize`` supports a
type, blocks quantized from random floats are checked too.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from backends.gguf.quants import (NUMPY_DECODED, SUPPORTED_TYPES, QuantizedWeight, dequantize,
                                  dequantize_into, logical_shape, quantized_linear, row_bytes)
from pipeline.errors import ArtifactError, InvalidValueError

pytestmark = pytest.mark.usefixtures("one_thread")

FLOATS = (QT.F32, QT.F16, QT.BF16)
QUANTIZABLE = (QT.Q8_0, QT.Q4_0, QT.Q4_1)      # gguf.quants.quantize supports these
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# Byte offsets of the float16 fields (d, dmin, m) inside one block.
HALF_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q4_K: (0, 2),
               QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
SHAPES = {1: [(1, 1), (3, 7), (4, 96)], 32: [(1, 32), (5, 64), (3, 96)],
          256: [(1, 256), (4, 512), (2, 768)]}


def random_floats(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal values whose magnitude spans 1e-3..1e3 row by row."""
    scale = 10.0 ** rng.uniform(-3, 3, size=(*shape[:-1], 1))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def random_blocks(rng: np.random.Generator, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """Random bytes for ``shape`` of ``qtype`` (uint8 [rows, row_bytes]) with each float16
    scale field set to a finite value of magnitude 1e-4..1, either sign."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in HALF_FIELDS[qtype]:
        half = rng.uniform(-1, 1, (len(blocks), 1)) * 10.0 ** rng.uniform(-4, 0, (len(blocks), 1))
        blocks[:, at:at + 2] = half.astype(np.float16).view(np.uint8)
    return raw


def encoded(rng: np.random.Generator, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """Test data for ``qtype``: quantized random floats where gguf can quantize the type
    (typed float16/float32 arrays for F16/F32, as GGUFReader gives them), else random blocks."""
    if qtype in FLOATS or qtype in QUANTIZABLE:
        return gguf.quants.quantize(random_floats(rng, shape), qtype)
    return random_blocks(rng, qtype, shape)


def reference(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """``gguf.quants.dequantize`` of ``raw`` as float32 ``[*shape]``."""
    values = gguf.quants.dequantize(np.ascontiguousarray(raw), qtype)
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape).copy())


def assert_matches(got: torch.Tensor, want: torch.Tensor, qtype: QT) -> None:
    """Exact for plain floats; within float32 rounding of the block's scale otherwise."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    if qtype in FLOATS:
        assert torch.equal(got, want)
    else:
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(got, want, rtol=4 * eps, atol=4 * eps * want.abs().max().item())


def cases() -> list[tuple[QT, tuple[int, int]]]:
    return [(t, s) for t in SUPPORTED_TYPES for s in SHAPES[GGML_QUANT_SIZES[t][0]]]


def case_id(value: object) -> str:
    """``Q4_K`` and ``4x512`` rather than ``12`` and ``(4, 512)``."""
    if isinstance(value, QT):
        return value.name
    assert isinstance(value, tuple)
    return "x".join(str(n) for n in value)


def test_supported_types_and_sizes_match_ggml() -> None:
    assert set(SUPPORTED_TYPES) == set(FLOATS + QUANTIZABLE + K_QUANTS)
    for qtype in SUPPORTED_TYPES:
        block, size = GGML_QUANT_SIZES[qtype]
        assert row_bytes(qtype, 3 * block) == 3 * size


@pytest.mark.parametrize(("qtype", "shape"), cases(), ids=case_id)
def test_dequantize_matches_reference(qtype: QT, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng([int(qtype), *shape])
    raw = encoded(rng, qtype, shape)
    assert_matches(dequantize(raw, qtype, shape), reference(raw, qtype, shape), qtype)


@pytest.mark.parametrize(("qtype", "shape"),
                         [c for c in cases() if c[0] in QUANTIZABLE], ids=case_id)
def test_random_blocks_match_reference(qtype: QT, shape: tuple[int, int]) -> None:
    """Every bit pattern, not only what the quantizer emits (Q8_0's -128, say)."""
    rng = np.random.default_rng([int(qtype), *shape, 1])
    raw = random_blocks(rng, qtype, shape)
    assert_matches(dequantize(raw, qtype, shape), reference(raw, qtype, shape), qtype)


def test_inputs_torch_and_numpy_any_dtype_and_leading_dims() -> None:
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, QT.Q6_K, (6, 512))
    want = reference(raw, QT.Q6_K, (2, 3, 512))
    from_torch = dequantize(torch.from_numpy(raw).view(torch.int16), QT.Q6_K, (2, 3, 512))
    assert_matches(from_torch, want, QT.Q6_K)
    halves = dequantize(torch.from_numpy(raw), QT.Q6_K, (2, 3, 512), torch.float16)
    assert halves.dtype == torch.float16
    assert torch.equal(halves, want.half())


def test_output_dtype_of_plain_floats() -> None:
    values = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    bf16 = gguf.quants.quantize(values, QT.BF16)
    got = dequantize(bf16, QT.BF16, (4, 6), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), reference(bf16, QT.BF16, (4, 6)))


def write_gguf(path: Path, tensors: dict[str, tuple[QT, np.ndarray]]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for name, (qtype, data) in tensors.items():
        raw_dtype = None if data.dtype in (np.float32, np.float16) else qtype
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_round_trip(tmp_path: Path) -> None:
    """Tensors written by GGUFWriter and read by GGUFReader: the reader's dims reversed are
    the torch shape, and its data (a read-only memory map) dequantizes to the reference."""
    rng = np.random.default_rng(7)
    shapes = {t: (3, 2 * GGML_QUANT_SIZES[t][0] if t not in FLOATS else 5)
              for t in SUPPORTED_TYPES}
    written = {t: encoded(rng, t, shapes[t]) for t in SUPPORTED_TYPES}
    path = tmp_path / "tiny.gguf"
    write_gguf(path, {t.name: (t, data) for t, data in written.items()})
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == {t.name for t in SUPPORTED_TYPES}
    for tensor in reader.tensors:
        qtype = QT(tensor.tensor_type)
        shape = logical_shape(tensor.shape)
        assert shape == shapes[qtype], qtype.name
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no torch warning about a non-writable array
            got = dequantize(tensor.data, qtype, shape)
            weight = QuantizedWeight.from_raw(tensor.data, qtype, shape)
        assert_matches(got, reference(written[qtype], qtype, shape), qtype)
        assert weight.nbytes == tensor.n_bytes
        assert_matches(weight.dequantize(), got, qtype)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_rows_gather_dequantized_rows(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = (11, max(GGML_QUANT_SIZES[qtype][0], 8))
    weight = QuantizedWeight.from_raw(encoded(rng, qtype, shape), qtype, shape)
    index = torch.tensor([[3, 0, 10], [3, 7, 1]])
    got = weight.rows(index)
    assert got.shape == (2, 3, shape[1])
    assert_matches(got, weight.dequantize()[index], qtype)
    assert torch.equal(weight.rows(index, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_quantized_linear_matches_dequantize_then_linear(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype) + 100)
    rows, cols = 37, 2 * GGML_QUANT_SIZES[qtype][0] if qtype not in FLOATS else 48
    weight = QuantizedWeight.from_raw(encoded(rng, qtype, (rows, cols)), qtype, (rows, cols))
    dense = weight.dequantize()
    bias = torch.randn(rows)
    chunk = 5 * cols * 4                                  # 5 rows a chunk: 7 full and 2 over
    for x in (torch.randn(1, cols), torch.randn(8, cols), torch.randn(2, 3, cols)):
        want = F.linear(x, dense, bias)
        got = quantized_linear(x, weight, bias, chunk_bytes=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        whole = quantized_linear(x, weight)
        torch.testing.assert_close(whole, F.linear(x, dense), rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())


def test_empty_tensors_and_contiguous_output() -> None:
    assert dequantize(np.zeros(0, np.uint8), QT.Q4_K, (0, 256)).shape == (0, 256)
    weight = QuantizedWeight.from_raw(random_blocks(np.random.default_rng(0), QT.Q8_0, (4, 64)),
                                      QT.Q8_0, (4, 64))
    assert weight.rows(torch.zeros(0, 2, dtype=torch.long)).shape == (0, 2, 64)
    assert quantized_linear(torch.zeros(0, 64), weight).shape == (0, 4)
    assert quantized_linear(torch.randn(3, 64), weight).is_contiguous()


def test_quantized_linear_rejects_wrong_input_width() -> None:
    weight = QuantizedWeight.from_raw(random_blocks(np.random.default_rng(0), QT.Q8_0, (4, 64)),
                                      QT.Q8_0, (4, 64))
    with pytest.raises(InvalidValueError, match="last dimension must be 64"):
        quantized_linear(torch.randn(2, 32), weight)


def test_unsupported_type_is_named_with_the_supported_ones() -> None:
    with pytest.raises(ArtifactError, match="IQ2_XXS is not supported") as caught:
        dequantize(np.zeros(66, np.uint8), QT.IQ2_XXS, (1, 256))
    assert all(t.name in str(caught.value) for t in SUPPORTED_TYPES)
    with pytest.raises(ArtifactError, match="not a GGML type"):
        dequantize(np.zeros(4, np.uint8), 999, (1, 1))  # type: ignore[arg-type]


def test_wrong_byte_count_names_both_sizes() -> None:
    raw = np.zeros(2 * 144 - 1, np.uint8)
    with pytest.raises(ArtifactError, match=r"Q4_K tensor of shape \(1, 512\) takes 288 bytes; "
                                            r"the data has 287"):
        dequantize(raw, QT.Q4_K, (1, 512))


def test_rows_must_be_whole_blocks() -> None:
    with pytest.raises(ArtifactError, match="Q8_0 packs 32 elements per block; a row of 48"):
        dequantize(np.zeros(51, np.uint8), QT.Q8_0, (1, 48))


def test_weight_checks_its_data() -> None:
    with pytest.raises(ArtifactError, match="a quantized weight is a matrix"):
        QuantizedWeight.from_raw(np.zeros(2 * 34, np.uint8), QT.Q8_0, (2, 1, 32))
    with pytest.raises(ArtifactError, match=r"needs uint8 data of shape \(2, 34\)"):
        QuantizedWeight(torch.zeros(2, 36, dtype=torch.uint8), QT.Q8_0, (2, 32))


def test_logical_shape_reverses_ggml_dims() -> None:
    assert logical_shape(np.array([576, 1536], dtype=np.uint64)) == (1536, 576)
    assert logical_shape([64]) == (64,)


@pytest.mark.parametrize("qtype", sorted(NUMPY_DECODED))
def test_decoding_into_a_reused_buffer_gives_the_reference(qtype: QT) -> None:
    rng = np.random.default_rng([int(qtype), 9])
    cols = 512 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 64
    out = torch.full((16, cols), float("nan"))
    for _ in range(2):  # the second decode overwrites the first entirely
        raw = random_blocks(rng, qtype, (16, cols))
        got = dequantize_into(raw, qtype, out)
        assert got is out
        assert_matches(out, reference(raw, qtype, (16, cols)), qtype)
        # and the torch decoder's bits, which the kept forms are checked against
        assert torch.equal(out, dequantize(torch.from_numpy(raw.copy()), qtype, (16, cols)))
    with pytest.raises(InvalidValueError, match="contiguous float32"):
        dequantize_into(raw, qtype, torch.empty((16, cols), dtype=torch.bfloat16))
    with pytest.raises(ArtifactError):
        dequantize_into(raw, qtype, torch.empty((16, cols + 32)))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_split_over_threads_gives_the_same_bits(threads: int) -> None:
    from backends.gguf.load import SPLIT_ROWS, decode_rows

    rng = np.random.default_rng(21)
    rows = 3 * SPLIT_ROWS + 17  # parts of unequal length
    raw = random_blocks(rng, QT.Q4_K, (rows, 256))
    whole = torch.empty(rows, 256)
    dequantize_into(raw, QT.Q4_K, whole)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((rows, 256), float("nan"))
        decode_rows(raw, QT.Q4_K, out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, whole)
