"""The transformers backend against transformers' own ``generate`` on the same folder, for
the architectures the torch backend implements and for ones it does not (Gemma 2 and 3,
Phi-3, GPT-NeoX, OLMo 2, Mistral with a sliding window); its layer taps against the torch
backend's; and what it refuses."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_weights import redraw
from pipeline import build
from pipeline.contracts.model import Attention, LayerTaps, ModelCall
from pipeline.errors import ArtifactError, InvalidValueError, SlotError
from pipeline.testing import ByteDetokenizer, ByteTokenizer, ChatMLRenderer

transformers = pytest.importorskip("transformers")
V = ByteTokenizer.VOCAB
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def configs() -> dict[str, Any]:
    """A tiny config of each architecture: the torch backend's six, then six it lacks."""
    t = transformers
    return {
        "llama": t.LlamaConfig(num_key_value_heads=2, **COMMON),
        "qwen2": t.Qwen2Config(num_key_value_heads=2, **COMMON),
        "qwen3": t.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON),
        "qwen2_moe": t.Qwen2MoeConfig(num_key_value_heads=2,
                                      shared_expert_intermediate_size=64, **MOE, **COMMON),
        "qwen3_moe": t.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, **MOE, **COMMON),
        "mixtral": t.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2, **COMMON),
        "gemma2": t.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=8,
                                 **COMMON),
        "gemma3_text": t.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=8,
                                          **COMMON),
        "phi3": t.Phi3Config(num_key_value_heads=2, **COMMON),
        "gpt_neox": t.GPTNeoXConfig(**COMMON),
        "olmo2": t.Olmo2Config(num_key_value_heads=2, **COMMON),
        "mistral": t.MistralConfig(num_key_value_heads=2, sliding_window=8, **COMMON),
    }


TORCH_BACKEND_ARCHS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
STAGES = dict(tokenizer=ByteTokenizer(), renderer=ChatMLRenderer(),
              detokenizer=ByteDetokenizer())
PROMPT = "Why is the sky blue? Because of Rayleigh scattering."


def checkpoint(arch: str, folder: Path) -> Any:
    """A tiny random checkpoint of ``arch`` saved in ``folder``; returns the model."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs()[arch]).eval()
    redraw(model)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for arch in configs():
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, checkpoint(arch, folder))
    return out


@pytest.mark.parametrize("arch", list(configs()))
def test_greedy_tokens_and_logits_equal_transformers_generate(folders, arch: str) -> None:
    """Through the whole pipeline, greedy tokens equal ``generate``'s; through the backend,
    each step's logits equal ``generate``'s scores."""
    folder, model = folders[arch]
    with build(folder, backend="transformers", **STAGES,
               options={"num_slots": 2, "max_context": 128}) as pipe:
        prompt = list(pipe.tokenize(PROMPT).input_ids)
        done = pipe.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True,
                             dry_multiplier=0)
        backend = pipe.engine.backend
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompt):].tolist()
        assert list(done.token_ids) == tokens
        ours = pipe.engine.call(lambda: _step_logits(backend, prompt, tokens)).result()
    theirs = torch.cat(ref.logits)                                             # [20, V]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert pipe.model_info() is not None


def _step_logits(backend: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The prompt's last logits, then each token's: ``[len(tokens), V]``."""
    slot = backend.allocate()
    try:
        rows = [backend.forward([ModelCall(slot, tuple(prompt), 0, (len(prompt) - 1,))])]
        for t, token in enumerate(tokens[:-1]):
            rows.append(backend.forward([ModelCall(slot, (token,), len(prompt) + t, (0,))]))
        return torch.cat(rows)
    finally:
        backend.release(slot)


@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_two_requests_at_once_equal_each_alone(folders, arch: str) -> None:
    """Through the engine: gemma2's sliding-window caches run one call after another,
    llama's decode tokens as one batch; the greedy answers are those of each alone."""
    folder, _ = folders[arch]
    prompts = ["Why is the sky blue?", "Name three colours of the rainbow, please."]
    with build(folder, backend="transformers", **STAGES,
               options={"num_slots": 2, "max_context": 128}) as pipe:
        alone = [pipe.generate(p, max_tokens=16, temperature=0, ignore_eos=True).token_ids
                 for p in prompts]
        handles = [pipe.submit(pipe.request(p, max_tokens=16, temperature=0, ignore_eos=True))
                   for p in prompts]
        together = [h.result(timeout=60).token_ids for h in handles]
    assert together == alone


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_moe", "phi3", "gpt_neox", "olmo2"])
def test_decode_tokens_of_several_slots_run_as_one_batch(folders, arch: str,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Slots of different lengths decode as one padded batch: each row's logits and layer
    taps equal the same slot decoding alone (within float32 rounding), and each slot's
    cache goes on as if it had run alone."""
    from backends.transformers.backend import TransformersBackend

    folder, _ = folders[arch]
    prompts = [tuple(range(5, 12)), tuple(range(20, 32)), (40, 41, 42)]
    feeds = [(50, 51, 52), (60, 61, 62), (70, 71, 72)]

    def run(together: bool) -> tuple[list[torch.Tensor], dict[tuple[int, int, str], Any]]:
        backend = TransformersBackend.from_dir(folder, num_slots=3, max_context=64)
        batches: list[int] = []
        batched = backend._batched
        monkeypatch.setattr(backend, "_batched", lambda calls, rows: (
            batches.append(len(calls)), batched(calls, rows))[1])
        slots = [backend.allocate() for _ in prompts]
        for slot, ids in zip(slots, prompts):
            backend.forward([ModelCall(slot, ids, 0, (len(ids) - 1,))])
        taps: dict[tuple[int, int, str], Any] = {}
        rows = []
        for step in range(3):
            calls = [ModelCall(s, (f[step],), len(p) + step, (0,))
                     for s, p, f in zip(slots, prompts, feeds)]
            if together:
                backend.set_tap(lambda c, n, h: taps.__setitem__((step, c, n),
                                                                 h.float().clone()))
                rows.append(backend.forward(calls))
            else:
                out = []
                for i, call in enumerate(calls):
                    backend.set_tap(lambda c, n, h, i=i: taps.__setitem__((step, i, n),
                                                                          h.float().clone()))
                    out.append(backend.forward([call]))
                rows.append(torch.cat(out))
            backend.set_tap(None)
        assert batches == ([3, 3, 3] if together else [])
        return rows, taps

    alone_rows, alone_taps = run(False)
    together_rows, together_taps = run(True)
    for a, b in zip(alone_rows, together_rows):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert together_taps.keys() == alone_taps.keys()
    assert {c for _, c, _ in together_taps} == {0, 1, 2}
    for key, tensor in together_taps.items():
        assert tensor.shape == (1, 64)
        torch.testing.assert_close(tensor, alone_taps[key], atol=1e-4, rtol=1e-4)


def test_truncate_and_read_only_calls_rebuild_the_cache_exactly(folders) -> None:
    """A sliding-window cache cannot be cut back; truncation rebuilds it from the kept
    tokens, and a call that does not write leaves the slot as it was."""
    from backends.transformers.backend import TransformersBackend

    folder, _ = folders["gemma3_text"]
    backend = TransformersBackend.from_dir(folder, num_slots=2, max_context=128)
    ids = tuple(range(10, 40))
    a, b = backend.allocate(), backend.allocate()
    backend.forward([ModelCall(a, ids, 0, ())])
    backend.truncate(a, 20)
    assert backend.cache_length(a) == 20
    after = backend.forward([ModelCall(a, ids[20:25], 20, (4,))])
    fresh = backend.forward([ModelCall(b, ids[:25], 0, (24,))])
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=1e-5)
    peek = backend.forward([ModelCall(a, (7, 8), 25, (1,), write=False)])
    assert backend.cache_length(a) == 25
    again = backend.forward([ModelCall(a, (7, 8), 25, (1,))])
    torch.testing.assert_close(peek, again, atol=1e-5, rtol=1e-5)
    with pytest.raises(SlotError, match="cannot truncate"):
        backend.truncate(a, 99)


def test_bad_calls_are_refused_before_any_runs(folders) -> None:
    from backends.transformers.backend import TransformersBackend

    folder, _ = folders["phi3"]
    backend = TransformersBackend.from_dir(folder, num_slots=2, max_context=64)
    a, b = backend.allocate(), backend.allocate()
    good = ModelCall(a, (5, 6, 7), 0, (2,))
    cases = [(ModelCall(b, (5,), 3, (0,)), "starts at 3"),
             (ModelCall(b, (V + 5,), 0, (0,)), "outside the vocabulary"),
             (ModelCall(b, (5, 6), 0, (1,), Attention.BLOCK), "block attention"),
             (ModelCall(b, (5,) * 65, 0, (0,)), "window of 64"),
             (ModelCall(b, (5, 6), 0, (1, 0)), "ascending")]
    for bad, words in cases:
        with pytest.raises(SlotError, match=words) as caught:
            backend.forward([good, bad])
        assert caught.value.slots == (b,)
        assert backend.cache_length(a) == 0  # the good call did not run either
    with pytest.raises(SlotError, match="not allocated"):
        backend.forward([ModelCall(7, (5,), 0, (0,))])


def test_what_it_does_not_honour_is_refused_at_build(folders) -> None:
    folder, _ = folders["llama"]
    with pytest.raises(InvalidValueError, match="batch_invariant.*transformers backend cannot"):
        build(folder, backend="transformers", **STAGES, options={"batch_invariant": True})
    with pytest.raises(InvalidValueError, match="strategy.*cannot verify speculative drafts"):
        build(folder, backend="transformers", strategy="speculative", **STAGES)
    with pytest.raises(InvalidValueError, match="kv_cache_dtype.*torch backend setting"):
        build(folder, backend="transformers", **STAGES, options={"kv_cache_dtype": "int8"})
    with pytest.raises(InvalidValueError, match="extra"):
        build(folder, backend="transformers", **STAGES, options={"extra": {"x": 1}})
    with build(folder, backend="transformers", **STAGES) as pipe:  # off unless asked
        backend = pipe.engine.backend
        assert backend.honours.lacking() == ("batch_invariance", "draft_verification",
                                             "prefix_sharing", "block_attention",
                                             "embedding_inputs")
        assert not hasattr(backend, "block_size")  # not paged: no prefix cache
    from backends.transformers.backend import TransformersBackend

    with pytest.raises(ArtifactError, match="no config.json"):
        TransformersBackend.from_dir(folder / "missing")


def test_a_folder_it_cannot_load_is_an_artifact_error(tmp_path: Path) -> None:
    from backends.transformers.backend import TransformersBackend

    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ArtifactError, match="cannot load it as a causal language model"):
        TransformersBackend.from_dir(tmp_path)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_layer_taps_name_and_match_the_torch_backends(folders, arch: str) -> None:
    """Both backends implement :class:`LayerTaps` with the same names, and in float32 the
    same tensor under each name; with the taps off nothing is called."""
    from backends.torch.backend import TorchBackend
    from backends.transformers.backend import TransformersBackend

    folder, _ = folders[arch]
    ours = TorchBackend.from_dir(folder, num_slots=2, max_context=64)
    theirs = TransformersBackend.from_dir(folder, num_slots=2, max_context=64)
    assert isinstance(ours, LayerTaps) and isinstance(theirs, LayerTaps)
    assert ours.tap_names() == theirs.tap_names()
    assert theirs.tap_names()[:4] == ("embed", "layers.0.attention", "layers.0.mlp",
                                      "layers.0")
    seen: list[dict[tuple[int, str], torch.Tensor]] = []
    for backend in (ours, theirs):
        got: dict[tuple[int, str], torch.Tensor] = {}
        backend.set_tap(lambda c, n, h: got.__setitem__((c, n), h.float().clone()))
        a, b = backend.allocate(), backend.allocate()
        backend.forward([ModelCall(a, tuple(range(5, 25)), 0, (19,)),
                         ModelCall(b, tuple(range(30, 37)), 0, (6,))])
        backend.set_tap(None)
        backend.forward([ModelCall(a, (9,), 20, (0,))])  # off: nothing more arrives
        seen.append(got)
    assert seen[0].keys() == seen[1].keys()
    assert len(seen[0]) == 2 * len(ours.tap_names())
    for key, tensor in seen[0].items():
        assert tensor.shape == ((20 if key[0] == 0 else 7), 64)
        torch.testing.assert_close(tensor, seen[1][key], atol=2e-5, rtol=1e-4)


def test_a_real_chat_template_through_the_backend(tmp_path: Path) -> None:
    """A Qwen3 folder with the real tokenizer files: the renderer from its chat template, the
    tokenizer, the detokenizer and the stoppers all come from the folder."""
    from qwen_files import qwen_dir

    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_dir() / name, tmp_path / name)
    with build(tmp_path, backend="transformers", options={"num_slots": 1}) as pipe:
        done = pipe.generate([{"role": "user", "content": "Hello"}], max_tokens=6,
                             temperature=0, ignore_eos=True)
        assert len(done.token_ids) == 6 and isinstance(done.text, str)
        assert pipe.model_info().architecture == "Qwen3ForCausalLM"


def test_the_server_runs_a_model_on_the_transformers_backend(tmp_path: Path) -> None:
    """``pipeline serve --backend transformers``: the OpenAI dialect over the tiny shipped
    model answers what the library on the torch backend answers (greedy), and a trace kept
    with layer taps holds them."""
    import httpx

    from http_support import config, running
    from pipeline.model_paths import TINY_MODEL_DIR
    from transports.http import Gateway

    question = [{"role": "user", "content": "What is 2+2?"}]
    with build(TINY_MODEL_DIR) as pipe:
        expected = pipe.generate(question, max_tokens=8, temperature=0).text
    gateway = Gateway(config(tmp_path, backend="transformers", num_slots=2))
    with running(gateway) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       headers={"x-pipeline-recording": "taps"},
                       json={"model": "default", "messages": question, "max_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected
        request_id = r.headers["x-request-id"]
        trace = httpx.get(f"{url}/traces/{request_id}", timeout=30)
        assert trace.status_code == 200
        assert '"taps"' in trace.text and "layers.3.mlp" in trace.text


@pytest.mark.parametrize("arch", TORCH_BACKEND_ARCHS)
def test_compare_finds_the_torch_and_transformers_backends_equal_within_float32(
        folders, arch: str) -> None:
    """On every architecture both implement, ``compare`` in float32 reports no step and no
    layer beyond what float32 rounding explains, and the same answers."""
    from pipeline.compare import compare_models

    folder, _ = folders[arch]
    report = compare_models(folder, PROMPT, a={"backend": "torch", **STAGES},
                            b={"backend": "transformers", **STAGES}, max_tokens=12,
                            dry_multiplier=0)
    assert report.answers.first_token is None
    assert report.first_step_beyond is None and report.first_layer is None, report.render()
    assert len(report.layers) == 1 + 3 * 2


def test_taps_see_only_the_calls_not_the_backends_own_rebuilds(folders) -> None:
    """A read-only call is undone by rebuilding the slot's cache; that rebuild's forward
    reaches no receiver."""
    from backends.transformers.backend import TransformersBackend

    folder, _ = folders["llama"]
    backend = TransformersBackend.from_dir(folder, num_slots=1, max_context=64)
    slot = backend.allocate()
    backend.forward([ModelCall(slot, tuple(range(10, 20)), 0, ())])
    seen: list[tuple[int, str, int]] = []
    backend.set_tap(lambda c, n, h: seen.append((c, n, h.shape[0])))
    backend.forward([ModelCall(slot, (7, 8), 10, (1,), write=False)])
    backend.set_tap(None)
    assert seen == [(0, name, 2) for name in backend.tap_names()]
    assert backend.cache_length(slot) == 10
