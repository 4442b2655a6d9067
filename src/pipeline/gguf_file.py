"""Opening a GGUF file (llama.cpp's model format): its metadata and its tensor index.

Owns :class:`GGUFFile` (a memory-mapped file: key-value metadata as Python values, tensors by
name as :class:`GGUFTensor` views of the mapped bytes, a content ``snapshot``), the header
reader behind it (:func:`read_gguf`), and :func:`opened`, a build's one opening of its model
file. The format is read here, below the stages and the backends, as
:mod:`pipeline.model_paths` finds the artifacts: the tokenizer and the chat template
(:mod:`stages.gguf`) read the metadata, the weights (:mod:`backends.gguf`) the tensors and the
model's shape (:func:`backends.gguf.backend.hf_config`), all from the one opening.

The header is read here rather than by ``gguf.GGUFReader``, which makes numpy views of every
element of the vocabulary arrays (seconds for a 49,152-token vocabulary); here a numeric array
is one ``np.frombuffer`` and a string array one loop over its length-prefixed UTF-8 bytes. The
values are the reader's: what ``{k: f.contents() for k, f in reader.fields.items()}`` gives
(its ``GGUF.version``, ``GGUF.tensor_count`` and ``GGUF.kv_count`` entries included, nested
arrays flattened), and each tensor's ``data`` is what its ``ReaderTensor.data`` is (element
dtype for F16/F32/F64/I8-I64, else uint8 ``[..., row_bytes]``), read-only. The layout (GGUF
versions 2 and 3, little-endian)::

    magic b"GGUF" | version u32 | tensor count u64 | key/value count u64
    key/value:   key (string) | value type u32 | value
    string:      byte length u64 | UTF-8 bytes
    array:       element type u32 | count u64 | elements
    tensor info: name (string) | n_dims u32 | dims u64[n_dims] (innermost first) | type u32
                 | offset u64 (from the data section's start)
    padding to general.alignment (default 32) | tensor data

Every problem is an :class:`~pipeline.errors.ArtifactError` naming the file and the field:
not a GGUF file, truncated, a missing key.

Example::

    f = GGUFFile.open(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    f.metadata["tokenizer.ggml.pre"]                      # 'smollm'
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from pipeline.errors import ArtifactError
from pipeline.events import digest_json
from pipeline.model_paths import is_gguf_file
from pipeline.registry import BuildContext

OPENED = "gguf_file"
"""The key of ``BuildContext.shared`` under which :func:`opened` keeps the build's
:class:`GGUFFile`, for the build's other readers of its metadata (the sampling
recommendation, :mod:`pipeline.sampling_defaults`)."""

_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")
VERSIONS = (2, 3)
"""GGUF versions the reader reads (as ``gguf.GGUFReader``)."""
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {code: struct.Struct(fmt) for code, fmt in (
    (0, "<B"), (1, "<b"), (2, "<H"), (3, "<h"), (4, "<I"), (5, "<i"), (6, "<f"), (7, "<?"),
    (10, "<Q"), (11, "<q"), (12, "<d"))}
"""GGUF value types with a fixed size, by type code."""
_U32, _U64 = _SCALARS[4], _SCALARS[10]
_PLAIN = {QT.F16: "<f2", QT.F32: "<f4", QT.F64: "<f8", QT.I8: "<i1", QT.I16: "<i2",
          QT.I32: "<i4", QT.I64: "<i8"}
"""Tensor types whose data is an array of elements (the rest: uint8 rows of blocks)."""


@attrs.frozen(eq=False)
class GGUFTensor:
    """One tensor of the index: ``shape`` innermost first (as GGUF lists it: ``[cols, rows]``
    for a matrix), ``data`` a read-only view of the mapped file (the element dtype for plain
    types, uint8 ``[..., row_bytes]`` for block types), ``n_bytes`` its size, ``data_offset``
    where it starts in the file."""

    name: str
    tensor_type: QT
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: npt.NDArray[Any]


@attrs.frozen(eq=False)
class GGUFFile:
    """A GGUF file's metadata (``metadata``: key → Python value) and tensors (``tensors``:
    name → :class:`GGUFTensor`, whose ``data`` is a view of the memory-mapped file)."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensor]
    snapshot: str

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        """Read ``path``'s header and index (the tensor data stays mapped, unread)."""
        if not path.is_file():
            raise ArtifactError(f"{path}: no such GGUF file")
        if not is_gguf_file(path):
            raise ArtifactError(f"{path}: not a GGUF file (it does not start with b'GGUF')")
        metadata, tensors = read_gguf(path)
        return cls(path, metadata, tensors, _snapshot(metadata, tensors))

    def drop_resident_pages(self) -> None:
        """Tell the system the mapped tensor bytes read so far are not needed now.

        A load reads every tensor once and keeps its own copy (dequantized or repacked), but
        the pages it read stay in the process's resident memory as long as the file is
        mapped: another copy of the file's size. Dropped, a later read of a tensor (a float
        norm that is a view of the file) maps its page again from the system's file cache."""
        for tensor in self.tensors.values():
            base: Any = tensor.data
            while base is not None and not isinstance(base, mmap.mmap):
                base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
            if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
                base.madvise(mmap.MADV_DONTNEED)
            return  # every tensor views the same mapping

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the file lacks ``key``."""
        return self.metadata.get(key, default)

    def need(self, key: str) -> Any:
        """A metadata value the file must have."""
        if key not in self.metadata:
            raise ArtifactError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]


def opened(ctx: BuildContext) -> GGUFFile:
    """The build's GGUF file, opened on first use and shared by the factories that read it
    (the ``gguf`` tokenizer, chat template and weights)."""
    if ctx.model_file is None:
        raise ArtifactError("the gguf components need a model file (a .gguf path)")
    if OPENED not in ctx.shared:
        ctx.shared[OPENED] = GGUFFile.open(ctx.model_file)
    f: GGUFFile = ctx.shared[OPENED]
    return f


# --- the reader -----------------------------------------------------------------------------

def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """``path``'s metadata (key → value, in file order) and tensors (name → view), read from
    a read-only memory map of the file. ArtifactError naming the file and the field for a
    truncated file, an unsupported version or byte order, an unknown value or tensor type, a
    repeated key or tensor name, or text that is not UTF-8."""
    with path.open("rb") as handle:
        try:
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{path}: cannot map the GGUF file ({exc})") from exc
    r = _Reader(path, buf)
    r.span(4, "the magic bytes")
    version = r.scalar(_U32, "the version")
    if version & 0xFFFF == 0:
        raise ArtifactError(f"{path}: a big-endian GGUF file; only little-endian files are read")
    if version not in VERSIONS:
        raise ArtifactError(f"{path}: GGUF version {version} is not supported "
                            f"(versions {', '.join(map(str, VERSIONS))})")
    tensor_count, kv_count = r.scalar(_U64, "the tensor count"), r.scalar(_U64, "the key count")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                "GGUF.kv_count": kv_count}
    alignment = DEFAULT_ALIGNMENT
    for n in range(kv_count):
        key = r.string(f"metadata key {n}")
        if key in metadata:
            raise ArtifactError(f"{path}: metadata key {key!r} appears twice")
        vtype = r.scalar(_U32, f"metadata key {key!r}")
        metadata[key] = r.value(vtype, key)
        if key == "general.alignment":
            alignment = _alignment(path, vtype, metadata[key])
    infos = [r.tensor_info(n) for n in range(tensor_count)]
    start = -(-r.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise ArtifactError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = _tensor(path, buf, name, dims, raw_type, start + offset)
    return metadata, tensors


class _Reader:
    """A cursor over the mapped bytes; every read checks that it stays inside the file."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.at, self.size = path, buf, 0, len(buf)

    def span(self, n: int, what: str) -> int:
        """Step over ``n`` bytes of ``what``; their start."""
        start = self.at
        if start + n > self.size:
            raise _truncated(self.path, what, start, n, self.size)
        self.at = start + n
        return start

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack_from(self.buf, self.span(fmt.size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(_U64, what)
        start = self.span(n, what)
        try:
            return str(self.buf[start:self.at], "utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactError(f"{self.path}: {what} is not UTF-8 text ({exc})") from exc

    def value(self, vtype: int, key: str) -> Any:
        """A value of type code ``vtype`` (for metadata key ``key``)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"metadata key {key!r}")
        if vtype == _STRING:
            return self.string(f"metadata key {key!r}")
        if vtype == _ARRAY:
            itype = self.scalar(_U32, f"metadata key {key!r}")
            return self.array(itype, self.scalar(_U64, f"metadata key {key!r}"), key)
        raise ArtifactError(f"{self.path}: metadata key {key!r} has value type {vtype}, which "
                            "is not a GGUF value type")

    def array(self, itype: int, count: int, key: str) -> list[Any]:
        """``count`` elements of type code ``itype``; nested arrays flattened."""
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype].format)
            start = self.span(count * dtype.itemsize, f"metadata key {key!r}")
            return np.frombuffer(self.buf, dtype, count, start).tolist() if count else []
        if itype == _STRING:
            return self.strings(count, key)
        if itype == _ARRAY:
            return [v for _ in range(count) for v in self.value(_ARRAY, key)]
        raise ArtifactError(f"{self.path}: metadata key {key!r} is an array of value type "
                            f"{itype}, which is not a GGUF value type")

    def strings(self, count: int, key: str) -> list[str]:
        """``count`` length-prefixed strings (the vocabulary: one tight loop)."""
        buf, at, size = self.buf, self.at, self.size
        out: list[str] = []
        unpack = _U64.unpack_from
        for _ in range(count):
            if at + 8 > size:
                raise _truncated(self.path, f"metadata key {key!r}[{len(out)}]", at, 8, size)
            (n,) = unpack(buf, at)
            if at + 8 + n > size:
                raise _truncated(self.path, f"metadata key {key!r}[{len(out)}]", at, 8 + n,
                                 size)
            try:
                out.append(str(buf[at + 8:at + 8 + n], "utf-8"))
            except UnicodeDecodeError as exc:
                raise ArtifactError(f"{self.path}: metadata key {key!r}[{len(out)}] is not "
                                    f"UTF-8 text ({exc})") from exc
            at += 8 + n
        self.at = at
        return out

    def tensor_info(self, n: int) -> tuple[str, tuple[int, ...], int, int]:
        """Tensor ``n``'s name, dims (innermost first), type code and data offset."""
        name = self.string(f"the name of tensor {n}")
        what = f"the index entry of tensor {name!r}"
        n_dims = self.scalar(_U32, what)
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.span(8 * n_dims, what))
        return name, dims, self.scalar(_U32, what), self.scalar(_U64, what)


def _truncated(path: Path, what: str, at: int, n: int, size: int) -> ArtifactError:
    return ArtifactError(f"{path}: the file ends inside {what} (byte {at} + {n} of a "
                         f"{size}-byte file); is it truncated?")


def _alignment(path: Path, vtype: int, value: Any) -> int:
    if vtype != 4:
        raise ArtifactError(f"{path}: metadata key 'general.alignment' must be a uint32")
    if value == 0 or value & (value - 1):
        raise ArtifactError(f"{path}: general.alignment={value} is not a power of two")
    return int(value)


def _tensor(path: Path, buf: mmap.mmap, name: str, dims: tuple[int, ...], raw_type: int,
            at: int) -> GGUFTensor:
    """Tensor ``name``'s view at byte ``at`` of the file."""
    try:
        qtype = QT(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ArtifactError(f"{path}: tensor {name!r} has type {raw_type}, which is not a "
                            "GGML tensor type") from None
    n_elements = math.prod(dims)
    n_bytes = n_elements * type_size // block
    if at + n_bytes > len(buf):
        raise _truncated(path, f"the data of tensor {name!r}", at, n_bytes, len(buf))
    shape = tuple(reversed(dims))
    if qtype in _PLAIN:
        dtype, count = np.dtype(_PLAIN[qtype]), n_elements
    else:
        if not shape or shape[-1] % block:
            raise ArtifactError(f"{path}: tensor {name!r} of type {qtype.name} has rows of "
                                f"{shape[-1] if shape else 0} elements, not whole blocks of "
                                f"{block}")
        dtype, count = np.dtype(np.uint8), n_bytes
        shape = (*shape[:-1], shape[-1] // block * type_size)
    data = np.frombuffer(buf, dtype, count, at) if count else np.empty(0, dtype)
    return GGUFTensor(name, qtype, dims, n_elements, n_bytes, at, data.reshape(shape))


def _snapshot(metadata: Mapping[str, Any], tensors: Mapping[str, GGUFTensor]) -> str:
    """A content digest of the metadata and the tensor index (names, types, shapes, sizes)."""
    meta = {k: v for k, v in metadata.items() if k not in _BIG_ARRAYS}
    meta.update({k: digest_json(metadata[k]) for k in _BIG_ARRAYS if k in metadata})
    index = [[t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.n_bytes)]
             for t in tensors.values()]
    return digest_json({"format": "gguf", "metadata": meta, "tensors": index})
