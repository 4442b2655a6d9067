"""GGML tensor data in torch: dequantization, and linears over weights kept quantized.

A GGUF tensor is a row-major array of rows; each row is a whole number of *blocks*, and a
block packs ``block_size`` elements into ``type_size`` bytes. GGUF lists a tensor's dims
innermost first (``ReaderTensor.shape`` is ``[cols, rows]`` for a matrix);
:func:`logical_shape` turns that into torch order ``(rows, cols)``, the ``shape`` every
function here takes. The block layouts (llama.cpp ``ggml-common.h``; ``d``, ``dmin``, ``m``
are little-endian float16; ``q`` is the stored integer of element ``x``)::

    type  elems bytes  layout                                         element
    F32       1     4  float32                                        x
    F16       1     2  float16                                        x
    BF16      1     2  bfloat16                                       x
    Q8_0     32    34  d, q int8[32]                                  d*q
    Q4_0     32    18  d, qs u8[16]: x0..15 low nibbles, x16..31 high d*(q-8)
    Q4_1     32    20  d, m, qs u8[16] as Q4_0                        d*q + m
    Q4_K    256   144  d, dmin, scales u8[12], qs u8[128]             d*sc*q - dmin*mn
    Q5_K    256   176  d, dmin, scales u8[12], qh u8[32], qs u8[128]  d*sc*q - dmin*mn
    Q6_K    256   210  ql u8[128], qh u8[64], scales int8[16], d      d*sc*(q-32)

K-quants split a 256-element super-block into sub-blocks: eight of 32 with a 6-bit scale
``sc`` and min ``mn`` each (Q4_K, Q5_K: :func:`k_scales`), or sixteen of 16 with an int8
scale (Q6_K). Q4_K/Q5_K store 4-bit parts 32 bytes (64 elements) at a time, low nibbles
first; Q5_K's fifth bit of element ``32*j + i`` is bit ``j`` of ``qh[i]``. Q6_K works in
halves of 128 elements: 64 bytes of ``ql`` hold elements 0-63 (low nibbles) and 64-127
(high), and bits 0-1, 2-3, 4-5, 6-7 of byte ``i`` of the half's 32 ``qh`` bytes are the top
2 bits of elements ``i``, ``i+32``, ``i+64``, ``i+96``.

Every decoder maps ``uint8 [N, type_size]`` to ``[N, block_size]`` with whole-tensor ops
(no Python loop over blocks), computing in float32 in the order llama.cpp does, so results
equal ``gguf.quants.dequantize`` (the numpy reference); every quantized type has a numpy twin
for loading and for prompt rows' whole-matrix decode, off torch's thread pool, with the same
values bit for bit. Data must be
little-endian, as GGUF
files almost always are, on a little-endian machine; a numpy array in non-native byte order
is refused.

Example::

    reader = gguf.GGUFReader(path)
    t = reader.tensors[0]
    w = dequantize(t.data, t.tensor_type, logical_shape(t.shape))       # [rows, cols]
    q = QuantizedWeight.from_raw(t.data, t.tensor_type, logical_shape(t.shape))
    y = quantized_linear(x, q)                                           # [T, rows]
    e = q.rows(token_ids)                                                # [T, cols]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType as QT

from pipeline.errors import ArtifactError, InvalidValueError

Raw = torch.Tensor | npt.NDArray[Any]
Decoder = Callable[[torch.Tensor], torch.Tensor]

QK_K = 256
# The float32 rows quantized_linear dequantizes at a time. From benchmarks/gguf_quants.py on a
# 2-core Xeon (2 MiB L2 a core), T=1 and T=8: with 1-4 MiB chunks a 49152x576 Q8_0/Q4_0
# product takes 0.22-0.39x the time of dequantizing the whole matrix first (the chunk stays in
# cache; 16 MiB chunks: 0.32-0.48x), holding 1-6 MiB of temporaries instead of 113-135 MiB;
# under 1 MiB the per-chunk op overhead shows (256 KiB: 2x slower on 1536x576). 4 MiB does
# the smaller matrices (1536x576, 576x1536) in one chunk, at 1.0-1.3x dequantize + F.linear.
CHUNK_BYTES = 4 << 20


def logical_shape(ggml_dims: Sequence[int]) -> tuple[int, ...]:
    """Torch-order shape from GGUF's innermost-first dims (``[cols, rows]`` -> ``(rows, cols)``)."""
    return tuple(int(n) for n in reversed(ggml_dims))


# --- block decoders: uint8 [N, type_size] -> [N, block_size] -------------------------------

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32: ``[N, 1]``."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2, n]``: the low nibbles, then the high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _shifts(bits: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Shift amounts ``[len(bits), 1]``: against ``[..., 1, n]`` bytes they give
    ``[..., len(bits), n]``."""
    return torch.tensor(bits, dtype=torch.uint8, device=like.device).view(-1, 1)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> eight 6-bit scales and eight 6-bit mins, float32 [N, 8].

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the
    low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are
    the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). (llama.cpp ``get_scale_min_k4``.)
    """
    s = scales.reshape(-1, 3, 4)                                   # [N, 3, 4]
    lo_sc, lo_mn, hi = s[:, 0], s[:, 1], s[:, 2]                   # [N, 4] each
    sc = torch.cat((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)), dim=1)
    mn = torch.cat((lo_mn & 0x3F, (hi >> 4) | ((lo_mn >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()                                  # [N, 8]


def _float_decoder(dtype: torch.dtype) -> Decoder:
    """Plain floats: the bytes reinterpreted, ``[N, itemsize]`` -> ``[N, 1]`` of ``dtype``."""
    return lambda blocks: blocks.view(dtype)


# Each decoder makes one float32 buffer and works on it in place, so a chunk of output rows
# costs about its own size in temporaries (plus a quarter for the uint8 bit-fields).

def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].view(torch.int8).float()                     # [N, 32]
    return q.mul_(_f16(blocks, 0))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).reshape(-1, 32).float()            # [N, 32]
    return q.sub_(8).mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).reshape(-1, 32).float()            # [N, 32]
    return q.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: ``d*sc*q - dmin*mn`` per sub-block, in place on ``q`` float32 [N, 8, 32];
    returns [N, 256]."""
    sc, mn = k_scales(blocks[:, 4:16])                            # [N, 8] each
    scale = (_f16(blocks, 0) * sc).unsqueeze(-1)                   # [N, 8, 1]
    offset = (_f16(blocks, 2) * mn).unsqueeze(-1)                  # [N, 8, 1]
    return q.mul_(scale).sub_(offset).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))                # [N, 4, 2, 32]
    return _k_affine(blocks, q.reshape(-1, 8, 32).float())


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = blocks[:, 16:48].unsqueeze(1)                             # [N, 1, 32]
    high = (qh >> _shifts(range(8), qh)) & 1                       # [N, 8, 32]
    return _k_affine(blocks, low.bitwise_or_(high << 4).float())


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64))             # [N, 2, 2, 64]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)                  # [N, 2, 1, 32]
    high = (qh >> _shifts((0, 2, 4, 6), qh)) & 3                   # [N, 2, 4, 32]
    q = low.reshape(-1, 8, 32).bitwise_or_(high.reshape(-1, 8, 32) << 4).float().sub_(32)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()   # [N, 16]
    return q.view(-1, 16, 16).mul_(scale.unsqueeze(-1)).view(-1, QK_K)


# --- load-time decoders in numpy: float32 [N, block_size] from uint8 [N, type_size] ----------
# Loading dequantizes each tensor of the file once (:func:`dequantize` on the reader's numpy
# view). For the simple block types these decoders do the torch decoders' arithmetic above in
# the same order, one correctly rounded float32 operation per step, so the values are the
# same bit for bit; but numpy runs on the calling thread alone. Torch splits every op across
# its thread pool, and where another process keeps a core busy each of loading's ~1,200 ops
# waits for a descheduled pool thread: SmolLM2's Q4_1 matrices took 0.25 s alone and 6.4 s
# beside one busy process on 2 cores in torch, 0.25 s both ways here (benchmarks/startup.py).

NumpyDecoder = Callable[[npt.NDArray[np.uint8], npt.NDArray[np.float32]], None]
"""Writes the values of uint8 blocks ``[N, type_size]`` into float32 ``out [N, block_size]``
(torch's memory: numpy's own large buffers ask the kernel for huge pages, whose first touch
cost more than the decoding here)."""


def _np_f16(blocks: npt.NDArray[np.uint8], at: int) -> npt.NDArray[np.float32]:
    """The float16 at byte ``at`` of each block, as float32: ``[N, 1]``."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _np_nibbles(qs: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    """``[N, n]`` bytes -> ``out [N, 2n]``: the low nibbles, then the high nibbles."""
    halves = out.reshape(qs.shape[0], 2, qs.shape[1])             # a view of out
    np.bitwise_and(qs, 0x0F, out=halves[:, 0], casting="unsafe")
    np.right_shift(qs, 4, out=halves[:, 1], casting="unsafe")


def _np_q8_0(blocks: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    out[...] = blocks[:, 2:].view(np.int8)                         # [N, 32]
    out *= _np_f16(blocks, 0)


def _np_q4_0(blocks: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    _np_nibbles(blocks[:, 2:], out)                                # [N, 32]
    out -= 8
    out *= _np_f16(blocks, 0)


def _np_q4_1(blocks: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    _np_nibbles(blocks[:, 4:], out)                                # [N, 32]
    out *= _np_f16(blocks, 0)
    out += _np_f16(blocks, 2)


def _np_k_scales(scales: npt.NDArray[np.uint8]) -> tuple[npt.NDArray[np.float32],
                                                          npt.NDArray[np.float32]]:
    """:func:`k_scales` in numpy: eight 6-bit scales and mins, float32 ``[N, 8]``."""
    s = scales.reshape(-1, 3, 4)
    lo_sc, lo_mn, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)), axis=1)
    mn = np.concatenate((lo_mn & 0x3F, (hi >> 4) | ((lo_mn >> 2) & 0x30)), axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _np_k_affine(blocks: npt.NDArray[np.uint8], q: npt.NDArray[Any],
                 out: npt.NDArray[np.float32]) -> None:
    """Q4_K/Q5_K: ``out = d*sc*q - dmin*mn`` per sub-block, as :func:`_k_affine` computes it."""
    sc, mn = _np_k_scales(blocks[:, 4:16])                           # [N, 8]
    view = out.reshape(-1, 8, 32)
    view[...] = q
    view *= (_np_f16(blocks, 0) * sc)[:, :, None]
    view -= (_np_f16(blocks, 2) * mn)[:, :, None]


def _np_k_nibbles(qs: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """K-quant 4-bit parts ``[N, 128]`` -> codes ``[N, 8, 32]``: each 32 bytes' low nibbles
    (one sub-block), then their high nibbles (the next)."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate((chunks & 0x0F, chunks >> 4), axis=2).reshape(-1, 8, 32)


def _np_q4_k(blocks: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    _np_k_affine(blocks, _np_k_nibbles(blocks[:, 16:]), out)


def _np_q5_k(blocks: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    qh = blocks[:, 16:48][:, None, :]                                 # [N, 1, 32]
    high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1           # [N, 8, 32]
    _np_k_affine(blocks, _np_k_nibbles(blocks[:, 48:]) | (high << 4), out)


def _np_q6_k(blocks: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
    halves = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = np.concatenate((halves & 0x0F, halves >> 4), axis=2)        # [N, 2, 2, 64]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [N, 2, 4, 32]
    view = out.reshape(-1, 16, 16)
    view[...] = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).reshape(-1, 16, 16)
    view -= 32
    view *= (_np_f16(blocks, 208) * blocks[:, 192:208].view(np.int8))[:, :, None]


@attrs.frozen
class _Format:
    """How one GGML type is stored: ``block_size`` elements in ``type_size`` bytes."""

    block_size: int
    type_size: int
    decode: Decoder


_FORMATS: dict[QT, _Format] = {
    QT.F32: _Format(1, 4, _float_decoder(torch.float32)),
    QT.F16: _Format(1, 2, _float_decoder(torch.float16)),
    QT.BF16: _Format(1, 2, _float_decoder(torch.bfloat16)),
    QT.Q8_0: _Format(32, 34, _q8_0),
    QT.Q4_0: _Format(32, 18, _q4_0),
    QT.Q4_1: _Format(32, 20, _q4_1),
    QT.Q4_K: _Format(QK_K, 144, _q4_k),
    QT.Q5_K: _Format(QK_K, 176, _q5_k),
    QT.Q6_K: _Format(QK_K, 210, _q6_k),
}

SUPPORTED_TYPES: tuple[QT, ...] = tuple(_FORMATS)
_NUMPY_DECODERS: dict[QT, NumpyDecoder] = {QT.Q8_0: _np_q8_0, QT.Q4_0: _np_q4_0,
                                           QT.Q4_1: _np_q4_1, QT.Q4_K: _np_q4_k,
                                           QT.Q5_K: _np_q5_k, QT.Q6_K: _np_q6_k}
"""The types :func:`dequantize` decodes in numpy when given a numpy array (load time)."""
NUMPY_DECODED: frozenset[QT] = frozenset(_NUMPY_DECODERS)
"""Those types, for callers that pick the fast path."""


# --- checks and byte handling ----------------------------------------------------------------

def _format(qtype: QT) -> _Format:
    """The format of ``qtype``; ArtifactError naming it and the supported types if none."""
    fmt = _FORMATS.get(qtype)
    if fmt is None:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ArtifactError(f"GGML tensor type {_type_name(qtype)} is not supported; "
                            f"supported: {supported}")
    return fmt


def _type_name(qtype: int) -> str:
    try:
        return QT(qtype).name
    except ValueError:
        return f"{qtype!r} (not a GGML type)"


def row_bytes(qtype: QT, cols: int) -> int:
    """Bytes one row of ``cols`` elements of ``qtype`` takes; ArtifactError for an unsupported
    type or a row that is not whole blocks."""
    fmt = _format(qtype)
    if cols % fmt.block_size:
        raise ArtifactError(f"{QT(qtype).name} packs {fmt.block_size} elements per block; a row "
                            f"of {cols} elements is not a whole number of blocks")
    return cols // fmt.block_size * fmt.type_size


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(int(n) for n in shape)
    if not dims or min(dims) < 0:
        raise ArtifactError(f"tensor shape {dims} must have at least one dimension, none negative")
    return dims


def _as_bytes(raw: Raw) -> torch.Tensor:
    """The bytes of ``raw`` as a 1-D uint8 tensor, sharing memory where possible.

    A read-only numpy array (a memory-mapped GGUF file) is copied, so no tensor ever aliases
    memory that cannot be written.
    """
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().reshape(-1).view(torch.uint8)
    array = np.ascontiguousarray(raw)
    if not array.dtype.isnative:
        raise ArtifactError(f"tensor data of dtype {array.dtype.str} is not in native byte order")
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


def _rows_of_bytes(raw: Raw, qtype: QT, shape: Sequence[int]) -> torch.Tensor:
    """``raw`` as uint8 ``[rows, row_bytes]`` for ``shape`` (rows = all leading dims);
    ArtifactError naming expected and actual sizes if the byte count does not match."""
    dims = _check_shape(shape)
    rows, per_row = _byte_shape(qtype, dims)
    data = _as_bytes(raw)
    _check_size(data.numel(), qtype, dims)
    return data.view(rows, per_row)


def _byte_shape(qtype: QT, dims: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, row_bytes)`` of a tensor of ``dims``: rows are all leading dims."""
    return math.prod(dims[:-1]), row_bytes(qtype, dims[-1])


def _check_size(nbytes: int, qtype: QT, dims: tuple[int, ...]) -> None:
    rows, per_row = _byte_shape(qtype, dims)
    if nbytes != rows * per_row:
        raise ArtifactError(f"{QT(qtype).name} tensor of shape {dims} takes {rows * per_row} "
                            f"bytes; the data has {nbytes}")


def dequantize_into(raw: npt.NDArray[Any], qtype: QT, out: torch.Tensor) -> torch.Tensor:
    """Decode a numpy array of ``qtype`` (one of :data:`NUMPY_DECODED`) into ``out``, a
    contiguous float32 CPU tensor of its logical shape (a buffer reused call after call:
    no fresh pages to fault in); returns ``out``. ArtifactError as :func:`dequantize`."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
        raise InvalidValueError("out", f"{out.dtype} on {out.device}",
                                "must be a contiguous float32 CPU tensor")
    return _np_dequantize(raw, QT(qtype), tuple(out.shape), out)


def _np_dequantize(raw: npt.NDArray[Any], qtype: QT, dims: tuple[int, ...],
                   result: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[*dims]`` from a numpy array of ``qtype`` (one of :data:`_NUMPY_DECODERS`),
    read where it lies: the file's read-only pages are never written nor aliased."""
    fmt = _format(qtype)
    array = np.ascontiguousarray(raw)
    if not array.dtype.isnative:
        raise ArtifactError(f"tensor data of dtype {array.dtype.str} is not in native byte order")
    data = array.reshape(-1).view(np.uint8)
    _check_size(data.size, qtype, dims)
    if result is None:
        result = torch.empty(dims, dtype=torch.float32)
    if data.size:
        out = result.numpy().reshape(-1, fmt.block_size)           # [blocks, block_size]
        with np.errstate(all="ignore"):  # a non-finite scale gives inf/nan, as in torch
            _NUMPY_DECODERS[qtype](data.reshape(-1, fmt.type_size), out)
    return result


def _decode(data: torch.Tensor, qtype: QT, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[R, row_bytes]`` (already checked) -> ``[R, cols]`` of ``dtype``."""
    if data.numel() == 0:
        return torch.empty(data.shape[0], cols, dtype=dtype, device=data.device)
    fmt = _FORMATS[qtype]
    blocks = data.reshape(-1, fmt.type_size)                       # [R*cols/block, type_size]
    return fmt.decode(blocks).reshape(data.shape[0], cols).to(dtype)


def _check_dtype(dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise InvalidValueError("dtype", dtype, "dequantized values need a floating-point dtype")


# --- public API ------------------------------------------------------------------------------

def dequantize(raw: Raw, qtype: QT, shape: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of logical ``shape`` (torch order) stored as ``qtype`` in ``raw``.

    ``raw``: the tensor's data as GGUF stores it, a torch tensor or numpy array of any dtype
    whose bytes are read (``ReaderTensor.data`` as it comes: uint8 blocks, or float16/float32
    for F16/F32). Rows are the last dim; each row is whole blocks. Returns ``[*shape]`` of
    ``dtype``, on ``raw``'s device; it may share memory with ``raw`` when the stored type
    already is ``dtype`` (F32 read as float32, say). Quantized types are computed in float32,
    then converted; a quantized type given as a numpy array (a file's tensor, at load) is
    decoded in numpy, to the same values bit for bit (see :data:`_NUMPY_DECODERS`).

    Raises ArtifactError for a type not in :data:`SUPPORTED_TYPES` (the message lists them),
    a last dim that is not whole blocks, or a byte count that does not fit ``shape``.
    """
    _check_dtype(dtype)
    dims = _check_shape(shape)
    if isinstance(raw, np.ndarray) and qtype in _NUMPY_DECODERS:
        return _np_dequantize(raw, QT(qtype), dims).to(dtype)
    data = _rows_of_bytes(raw, qtype, dims)                        # [rows, row_bytes]
    return _decode(data, QT(qtype), dims[-1], dtype).reshape(dims)


@attrs.frozen(eq=False)
class QuantizedWeight:
    """A matrix kept in its GGML encoding: ``data`` uint8 ``[rows, row_bytes]``, ``qtype``,
    and the logical ``shape`` ``(rows, cols)`` (an ``F.linear`` weight is ``(out, in)``).

    Build with :meth:`from_raw`; the constructor checks that ``data`` fits ``shape`` and
    raises ArtifactError if not. Frozen; ``data`` is never written by this module. Results
    are on ``data``'s device; :func:`quantized_linear` is the matrix product.

    Example::

        w = QuantizedWeight.from_raw(t.data, t.tensor_type, logical_shape(t.shape))
        emb = w.rows(ids)                 # ids [B, S] -> [B, S, cols]
        y = quantized_linear(x, w)        # x [T, cols] -> [T, rows]
    """

    data: torch.Tensor
    qtype: QT
    shape: tuple[int, int]

    def __attrs_post_init__(self) -> None:
        rows, cols = self.shape
        expected = (rows, row_bytes(self.qtype, cols))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ArtifactError(f"{self.qtype.name} weight of shape {self.shape} needs uint8 "
                                f"data of shape {expected}; got {self.data.dtype} "
                                f"{tuple(self.data.shape)}")

    @classmethod
    def from_raw(cls, raw: Raw, qtype: QT, shape: Sequence[int]) -> QuantizedWeight:
        """From GGUF data (as :func:`dequantize` takes it) and a 2-D logical ``shape``; shares
        memory with ``raw`` where it can. ArtifactError as :func:`dequantize` raises, or for a
        shape that is not 2-D."""
        dims = _check_shape(shape)
        if len(dims) != 2:
            raise ArtifactError(f"a quantized weight is a matrix (rows, cols); got shape {dims}")
        return cls(_rows_of_bytes(raw, qtype, dims), QT(qtype), (dims[0], dims[1]))

    @property
    def nbytes(self) -> int:
        """Bytes the encoded data takes."""
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole matrix, ``[rows, cols]`` of ``dtype`` (may share memory with ``data``
        for F32/F16/BF16 read as their own dtype)."""
        _check_dtype(dtype)
        return _decode(self.data, self.qtype, self.shape[1], dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Only the rows ``index`` (integer, any shape ``[*I]``; an embedding lookup):
        ``[*I, cols]`` of ``dtype``. IndexError for an index out of range."""
        _check_dtype(dtype)
        picked = self.data[index.reshape(-1)]                      # [n, row_bytes]
        return _decode(picked, self.qtype, self.shape[1], dtype).reshape(*index.shape,
                                                                         self.shape[1])


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                     *, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``F.linear(x, w.dequantize(x.dtype), bias)`` without the whole dequantized matrix.

    ``x [*, in]`` with ``in == w.shape[1]``; ``bias [out]`` or None; returns a contiguous
    ``[*, out]`` of ``x.dtype``. Output rows are dequantized a chunk at a time, each chunk's
    float32 values taking at most about ``chunk_bytes`` (at least one row; the decoder's
    temporaries add about a quarter), and multiplied into a preallocated output, so the
    extra memory is about ``chunk_bytes`` plus the output, whatever the matrix's size.
    InvalidValueError if ``x``'s last dim is not ``in``.
    """
    rows, cols = w.shape
    if x.dim() == 0 or x.shape[-1] != cols:
        raise InvalidValueError("x", tuple(x.shape), f"last dimension must be {cols}")
    flat = x.reshape(-1, cols)                                     # [T, in]
    out = torch.empty(flat.shape[0], rows, dtype=x.dtype, device=x.device)   # [T, out]
    step = max(1, chunk_bytes // max(1, cols * 4))                 # rows per chunk
    for start in range(0, rows, step):
        _linear_rows(flat, w, start, start + step, out)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], rows)                        # [*, out]


def _linear_rows(flat: torch.Tensor, w: QuantizedWeight, start: int, stop: int,
                 out: torch.Tensor) -> None:
    """``out[:, start:stop] = flat @ w[start:stop].T``, the rows dequantized here; a function
    of its own so each chunk's temporary is freed before the next is made."""
    chunk = _decode(w.data[start:stop], w.qtype, w.shape[1], flat.dtype)   # [c, in]
    torch.mm(flat, chunk.T, out=out[:, start:stop])                # [T, c]
