"""The Triton MoE inside the torch backend's model, selected by name, on the CPU.

Kernels run through the Triton interpreter. Oracles: transformers' own forward of tiny
Qwen2-MoE (routed experts plus the sigmoid-gated shared expert, no renormalization) and
Mixtral (renormalized) checkpoints, the torch backend's reference MoE, and the default
model's greedy tokens with the reference MoE.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from backends.torch.backend import TorchBackend  # noqa: E402
from backends.triton_moe import TritonMoe  # noqa: E402
from pipeline import build  # noqa: E402
from pipeline.errors import BackendError, InvalidValueError  # noqa: E402
from pipeline.contracts.model import PrefillChunk  # noqa: E402

COMMON: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=48,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64)
CONFIGS = {
    "qwen2-moe-shared-expert": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=False),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                  num_experts_per_tok=2),
}
PROMPT = (5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    gen = torch.Generator().manual_seed(7)
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make()).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, model)
    return out


def _prefill(backend: TorchBackend) -> torch.Tensor:
    return backend.prefill([PrefillChunk(backend.allocate(), PROMPT, 0, True)])[0]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_prefill_logits_match_transformers_in_float32(arch: str,
                                                      checkpoints: dict[str, Any]) -> None:
    folder, ref = checkpoints[arch]
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=32, moe=TritonMoe())
    with torch.no_grad():
        expected = ref(torch.tensor([list(PROMPT)])).logits[0, -1].float()
    assert (_prefill(backend) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_float16_logits_match_the_reference_moe(arch: str, checkpoints: dict[str, Any]) -> None:
    folder, _ = checkpoints[arch]
    ours = TorchBackend.from_dir(folder, num_slots=1, max_context=32, dtype="float16",
                                 moe=TritonMoe())
    reference = TorchBackend.from_dir(folder, num_slots=1, max_context=32, dtype="float16")
    z, z_ref = _prefill(ours), _prefill(reference)
    assert (z - z_ref).abs().max().item() <= 2e-2 * z_ref.abs().max().item()


def test_default_model_greedy_tokens_equal_with_triton_moe() -> None:
    prompt = "How do I open a file in Python?"
    runs = []
    for moe in ("torch", "triton"):
        with build("tiny", options={"dtype": "float32", "moe": moe, "num_slots": 1,
                            "max_context": 256}) as pipe:
            assert pipe.engine is not None
            model_moe = pipe.engine.backend.model.moe  # type: ignore[attr-defined]
            assert isinstance(model_moe, TritonMoe) == (moe == "triton")
            runs.append(pipe.generate(prompt, max_tokens=4, temperature=0))
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[1].token_ids) >= 1


def test_a_callable_moe_option_is_used_by_the_model() -> None:
    from backends.torch.moe import moe_forward
    seen: list[tuple[int, ...]] = []

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(tuple(hidden.shape))
        return moe_forward(hidden, *args, **kwargs)

    with build("tiny", options={"moe": spy, "num_slots": 1, "max_context": 128}) as pipe:
        pipe.generate("Hi", max_tokens=2, temperature=0)
    assert seen and all(len(s) == 2 for s in seen)


def test_triton_moe_where_it_cannot_run_is_refused_at_build_time() -> None:
    with pytest.raises(BackendError, match="bfloat16"):
        build("tiny", options={"moe": "triton"})   # the tiny model's bfloat16 weights
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ("from pipeline import build\n"
              "try:\n build('tiny', options={'moe': 'triton', 'dtype': 'float32'})\n"
              "except Exception as exc:\n print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "BackendError" in done.stdout and "TRITON_INTERPRET=1" in done.stdout, done.stderr


def test_unknown_moe_name_is_named() -> None:
    with pytest.raises(InvalidValueError, match="moe"):
        build("tiny", options={"moe": "cuda-graphs"})
