"""BackendOptions: one checked value for device, dtype, slots, window, cache budget, packing,
MoE kernel and GGUF quantization, used by build(), ``pipeline run``, ``pipeline chat`` and
``pipeline serve``.

Oracles: the tiny model's config.json (for the window a cache budget buys), torch's own view
of this machine (which devices exist), and the value handed to the backend."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import BackendOptions, build
from transports import cli
from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.model_paths import TINY_MODEL_DIR

TINY_GGUF = str(Path(__file__).parent / "gguf_fixtures" / "llama-q4_k.gguf")

RUN = [sys.executable, "-m", "pipeline"]


def test_a_misspelt_name_suggests_the_closest_field() -> None:
    with pytest.raises(UnknownFieldError, match="did you mean 'dtype'") as info:
        BackendOptions.from_dict({"dtpye": "float32"})
    assert info.value.suggestion == "dtype"
    with pytest.raises(UnknownFieldError, match="did you mean 'device'"):
        BackendOptions(devcie="cpu")  # type: ignore[call-arg]
    with pytest.raises(UnknownFieldError, match="did you mean 'num_slots'"):
        build("tiny", options={"num_slot": 2})
    with pytest.raises(InvalidValueError, match="options"):
        build("tiny", options=[("device", "cpu")])  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value, says", [
    ("dtype", "bfloat", "did you mean 'bfloat16'"),
    ("dtype", "int8", "float32, bfloat16, float16"),
    ("dtype", 16, "float32, bfloat16, float16"),
    ("device", "gpu", "not a torch device"),
    ("device", "cuda:x", "not a torch device"),
    ("device", "cuda:999", "index is out of range"),
    ("device", "meta", "'meta' is not supported"),
    ("device", 0, "device name"),
    ("num_slots", 0, "1..4096"),
    ("num_slots", 5000, "1..4096"),
    ("num_slots", True, "integer"),
    ("max_context", 0, ">= 1"),
    ("kv_cache_bytes", -5, ">= 1"),
    ("kv_blocks", 0, ">= 1"),
    ("kv_blocks", 2.5, "integer"),
    ("block_size", 0, "1..1024"),
    ("block_size", 4096, "1..1024"),
    ("block_size", "16", "integer"),
    ("pack", "no", "True or False"),
    ("quantized", 1, "True or False"),
    ("moe", "trition", "did you mean 'triton'"),
    ("moe_configs", 3, "list of folders"),
    ("extra", {1: 2}, "mapping of option names"),
    ("batch_invariant", "yes", "must be True or False"),
    ("threads", 0, "1..1024"),
    ("threads", 2.0, "integer"),
    ("threads", True, "integer"),
])
def test_each_value_is_checked(field: str, value: object, says: str) -> None:
    with pytest.raises(InvalidValueError, match=field) as info:
        BackendOptions.from_dict({field: value})
    assert says in str(info.value)


def test_values_are_normalized() -> None:
    opts = BackendOptions(device=torch.device("cpu"), dtype=torch.bfloat16,
                          moe_configs="tables/", extra={"plugin_knob": 3})
    assert (opts.device, opts.dtype, opts.torch_dtype) == ("cpu", "bfloat16", torch.bfloat16)
    assert [p.name for p in opts.moe_configs] == ["tables"]
    assert BackendOptions(device="cuda:1").device == "cuda:1"  # parsing needs no GPU
    assert BackendOptions.coerce(None) == BackendOptions()
    assert BackendOptions.coerce({"num_slots": 2}).num_slots == 2


def _missing_device_reason(device: str) -> str:
    """What torch says about ``device`` on this machine (the oracle for the message)."""
    kind = torch.device(device)
    if kind.type == "mps":
        return "MPS is not available"
    if not torch.backends.cuda.is_built():
        return "CUDA is not available on this machine: this torch"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine: torch finds no CUDA device"
    return f"this machine has {torch.cuda.device_count()} CUDA device"


@pytest.mark.parametrize("device", ["cuda:99", "mps"])
def test_a_device_this_machine_lacks_is_refused_at_build_time(device: str) -> None:
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    reason = _missing_device_reason(device)
    for attempt in (lambda: build("tiny", options={"device": device}),
                    lambda: BackendOptions(device=device).check_device()):
        with pytest.raises(InvalidValueError) as info:
            attempt()
        assert reason in str(info.value) and "use device='cpu'" in str(info.value)
    from backends.torch.backend import TorchBackend

    with pytest.raises(InvalidValueError, match="use device='cpu'"):
        TorchBackend.from_dir(TINY_MODEL_DIR, device=device)


def test_plain_cuda_is_refused_unless_this_machine_has_it() -> None:
    if torch.cuda.is_available():
        BackendOptions(device="cuda").check_device()  # no error where CUDA is there
        return
    with pytest.raises(InvalidValueError, match=_missing_device_reason("cuda")):
        build("tiny", options=BackendOptions(device="cuda"))


def test_the_backend_gets_the_options() -> None:
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    per_position = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                    * config["head_dim"] * 4)  # float32 keys and values
    budget = 2 * 1024 * per_position + 1  # two slots of 1024 positions, not of 1280
    opts = BackendOptions(num_slots=2, dtype="float32", kv_cache_bytes=budget, pack=False)
    with build("tiny", options=opts) as pipe:
        backend = pipe.engine.backend
        assert backend.num_slots == 2 and backend.max_context == 1024
        assert backend.model.dtype == torch.float32
        assert backend.cache.k[0].dtype == torch.float32
    with build("tiny", options={"max_context": 300, "kv_cache_bytes": budget,
                                "dtype": "float32"}) as pipe:
        backend = pipe.engine.backend   # an explicit window wins; the budget sizes the pool
        assert backend.max_context == 300 and backend.num_blocks == 2 * 1024 // 16
    with pytest.raises(InvalidValueError, match="kv_cache_bytes.*must hold one window"):
        build("tiny", options={"max_context": 300, "kv_cache_bytes": 1})


def test_the_pool_options_reach_the_backend() -> None:
    with build("tiny", options={"max_context": 64, "kv_blocks": 40, "block_size": 8}) as pipe:
        backend = pipe.engine.backend
        assert (backend.num_blocks, backend.block_size) == (40, 8)
        assert backend.cache.k[0].shape[:2] == (40, 8)
    with pytest.raises(InvalidValueError, match="kv_blocks.*must hold one window"):
        build("tiny", options={"max_context": 64, "kv_blocks": 7, "block_size": 8})
    with pytest.raises(InvalidValueError, match="once: kv_blocks or kv_cache_bytes"):
        build("tiny", options={"max_context": 64, "kv_blocks": 40, "kv_cache_bytes": 1 << 20})


def test_the_threads_option_sets_the_count_of_every_forward() -> None:
    before = torch.get_num_threads()
    try:
        for gguf in (False, True):  # both built-in backends take it
            with build(TINY_GGUF if gguf else "tiny", options={"threads": 1}) as pipe:
                backend = pipe.engine.backend
                assert backend.threads is None and backend.fixed_threads == 1
                assert backend.thread_policy == "1" and backend.model_info().threads == "1"
                assert pipe.generate("hi", max_tokens=3).usage.completion_tokens >= 1
                assert pipe.engine.call(torch.get_num_threads).result() == 1  # engine thread
    finally:
        torch.set_num_threads(before)
    with build("tiny") as pipe:  # none given: torch's count, decode steps choose by measuring
        backend = pipe.engine.backend
        assert backend.fixed_threads is None and backend.threads is not None
        assert backend.thread_policy == (f"1-{before} by measuring" if before > 1 else "1")


def test_the_built_in_backends_refuse_what_they_cannot_honour() -> None:
    with pytest.raises(InvalidValueError, match="no extra options"):
        build("tiny", options={"extra": {"plugin_knob": 1}})
    with pytest.raises(InvalidValueError, match="GGUF files only"):
        build("tiny", options={"quantized": True})


def test_pipeline_run_takes_device_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--model", "tiny", "hi", "--temperature", "0", "--max-tokens", "4",
                     "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    with build("tiny", options={"dtype": "float32"}) as pipe:
        assert out == pipe.generate("hi", temperature=0, max_tokens=4).text + "\n"


def test_pipeline_chat_takes_device_and_dtype(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))  # piped: one turn, plain output
    assert cli.main(["chat", "--model", "tiny", "--temperature", "0", "--max-tokens", "4",
                     "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    with build("tiny", options={"dtype": "float32"}) as pipe:
        answer = pipe.generate([{"role": "user", "content": "hi"}], temperature=0,
                               max_tokens=4)
    assert out == answer.text + "\n"


@pytest.mark.parametrize("argv, says", [
    (["run", "--model", "tiny", "hi", "--device", "cuda:99"], "use device='cpu'"),
    (["run", "--model", "tiny", "hi", "--dtype", "bfloat"], "did you mean 'bfloat16'"),
    (["chat", "--model", "tiny", "--device", "cuda:99"], "use device='cpu'"),
    (["chat", "--model", "tiny", "--dtype", "bfloat"], "did you mean 'bfloat16'"),
])
def test_pipeline_run_and_chat_refuse_a_bad_device_or_dtype_in_one_line(argv: list[str],
                                                                         says: str) -> None:
    done = subprocess.run(RUN + argv, capture_output=True, text=True, timeout=120,
                          input="hi\n")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, says", [
    (["--device", "cuda:99"], "use device='cpu'"),
    (["--dtype", "f16"], "dtype"),
    (["--device", "tpu"], "not a torch device"),
])
def test_pipeline_serve_refuses_them_before_serving(flags: list[str], says: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--model", "tiny", "--port", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeline serve: ") and says in err


def test_batch_invariance_is_on_for_cpu_unless_said_otherwise() -> None:
    import argparse

    from transports.http.server.config import ServerConfig
    from transports.cli.run import backend_options

    assert BackendOptions().invariant is True
    assert BackendOptions(device="cuda:0").invariant is False  # parsing needs no GPU
    assert BackendOptions(batch_invariant=False).invariant is False
    assert BackendOptions(device="cuda", batch_invariant=True).invariant is True
    flags = {"auto": True, "on": True, "off": False}
    for flag, resolved in flags.items():
        args = argparse.Namespace(device="cpu", dtype=None, batch_invariant=flag,
                                  quantized="auto")
        assert backend_options(args).invariant is resolved
    served = ServerConfig(models={"m": None}, batch_invariant=False).backend_options()
    assert served.invariant is False


def test_gguf_weights_stay_quantized_by_default_on_a_cpu_at_float32() -> None:
    assert BackendOptions().quantized is None and BackendOptions().keeps_quantized
    assert not BackendOptions(dtype="bfloat16").keeps_quantized
    assert not BackendOptions(device="cuda").keeps_quantized
    assert not BackendOptions(quantized=False).keeps_quantized
    assert BackendOptions(quantized=True, dtype="bfloat16").keeps_quantized
    build("tiny").close()  # a Hugging Face folder ignores the automatic choice


@pytest.mark.parametrize(("flag", "want"), [("auto", None), ("on", True), ("off", False)])
def test_the_quantized_flag_reaches_the_options(flag: str, want: bool | None) -> None:
    import argparse

    from transports.cli.run import add_backend, backend_options

    parser = argparse.ArgumentParser()
    add_backend(parser)
    assert backend_options(parser.parse_args(["--quantized", flag])).quantized is want
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantized", "maybe"])
