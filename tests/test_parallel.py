"""Tensor and expert parallelism over two gloo ranks (:mod:`backends.torch.parallel`).

The oracle is the same checkpoint in one process: two ranks started by ``torchrun`` must give
the same greedy tokens and logits within 1e-5 of the logits' scale, for a dense model (heads
and MLP split) and an MoE model (experts split, and a shared expert's MLP split), and the same
hidden states. A rank killed mid-decode makes rank 0's next call fail with a
:class:`~pipeline.errors.DeviceFault` naming the group, within the group's timeout, not hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from backends.torch.backend import TorchBackend
from backends.torch.shard import Shard
from pipeline.errors import ArtifactError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.model import PrefillChunk
from tests.http_support import free_port
from tests.parallel_rank import PROMPTS, greedy, prefilled

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "parallel_rank.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
       "OMP_NUM_THREADS": "1"}


def _reference(folder: Path) -> dict[str, Any]:
    """The same calls as parallel_rank.py's greedy mode, in this process, unsplit."""
    return greedy(TorchBackend.from_dir(folder, num_slots=2, max_context=64, dtype="float32"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    from tests.hf_weights import redraw

    common: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256)
    made = {"dense": transformers.Qwen3Config(**common, head_dim=16),
            "shared-expert": transformers.Qwen2MoeConfig(
                **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, qkv_bias=True)}
    out = {"moe": TINY_MODEL_DIR}
    torch.manual_seed(0)
    for name, config in made.items():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        redraw(model)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("name", ["dense", "moe", "shared-expert"])
def test_two_gloo_ranks_compute_what_one_process_does(name: str, checkpoints: dict[str, Path],
                                                      tmp_path: Path) -> None:
    folder, out = checkpoints[name], tmp_path / "rank0.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(SCRIPT), str(folder), str(out), "greedy"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got, want = torch.load(out), _reference(folder)
    assert got["tokens"] == want["tokens"]
    scale = want["logits"].abs().max().item()
    assert (got["logits"] - want["logits"]).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert torch.allclose(got["hidden"], want["hidden"], rtol=0, atol=1e-5)


def test_ranks_idle_longer_than_the_step_timeout_still_answer(tmp_path: Path) -> None:
    out = tmp_path / "idle.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(SCRIPT), str(TINY_MODEL_DIR), str(out),
                           "idle"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    whole = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=2, max_context=64, dtype="float32")
    slots, z = prefilled(whole)  # the same step in one process: the oracle
    want = whole.decode(slots, [int(i) for i in z.argmax(-1)])
    got = torch.load(out)["logits"]
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_a_group_holds_one_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.torch import parallel
    from pipeline.errors import InvalidValueError

    monkeypatch.setattr(parallel, "_SERVED", ["the main model"])
    with pytest.raises(InvalidValueError, match="holds the main model already"):
        parallel.parallel_backend(TINY_MODEL_DIR, Shard(0, 2))


def test_a_rank_killed_mid_decode_fails_rank_zeros_call_within_the_bound(tmp_path: Path
                                                                        ) -> None:
    out, port = tmp_path / "kill.json", free_port()
    ranks = []
    for rank in (0, 1):  # torchrun's agent would stop rank 0 too: started here instead
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(subprocess.Popen([sys.executable, str(SCRIPT), str(TINY_MODEL_DIR),
                                       str(out), "kill"], env=env, cwd=ROOT))
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{out}.ready").exists():
            assert time.monotonic() < deadline and ranks[0].poll() is None, "rank 0 never ran"
            time.sleep(0.05)
        os.kill(int(Path(f"{out}.pid1").read_text()), signal.SIGKILL)
        # the bound: the group's 30 s step timeout and a margin (gloo sees the reset at once)
        assert ranks[0].wait(timeout=45) == 0
        outcome = json.loads(out.read_text())
        assert outcome["error"] == "DeviceFault", outcome
        assert "a rank of the parallel group stopped answering" in outcome["message"]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()  # the processes this test started, by their handles
            p.wait()


def test_a_model_that_does_not_split_is_refused_naming_the_sizes() -> None:
    from backends.torch.config import ModelSpec
    from backends.torch.loader import read_config

    spec = ModelSpec.from_hf_config(read_config(TINY_MODEL_DIR))
    with pytest.raises(ArtifactError, match="num_key_value_heads=2, num_experts=8 must be "
                                            "multiples of 3"):
        Shard(0, 3).check(spec)
    local = Shard(1, 2).local_spec(spec)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 512)
    assert Shard(1, 2).span(8) == (4, 8)


# --- pipeline serve over a group ---------------------------------------------------------------

def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert time.monotonic() < deadline, "the server never became healthy"
        assert all(p.poll() is None for p in procs), "a rank ended while loading"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:  # the processes this test started, by their handles
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


CHAT = {"model": "default_model", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there"}]}
SERVE = ["-m", "pipeline", "serve", "--model", str(TINY_MODEL_DIR), "--dtype", "float32"]


def test_pipeline_serve_under_torchrun_answers_as_one_process_does(tmp_path: Path) -> None:
    from pipeline.builder import build

    port = free_port()
    group = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", *SERVE, "--port", str(port),
                               "--data-dir", str(tmp_path)], env=ENV, cwd=ROOT)]
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, group)
        answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).json()
    finally:
        _stop(group)
    with build(TINY_MODEL_DIR, options={"dtype": "float32"}) as one:
        want = one.generate(CHAT["messages"], max_tokens=12, temperature=0)
    assert answer["choices"][0]["message"]["content"] == want.text
    assert answer["usage"]["completion_tokens"] == len(want.token_ids) == 12


def test_a_lost_rank_fails_the_stream_and_health_says_why(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    ranks = []
    for rank in (0, 1):  # started without torchrun's agent, which would stop rank 0 too
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master),
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(subprocess.Popen([sys.executable, *SERVE, "--port", str(port),
                                       "--data-dir", str(tmp_path / str(rank))], env=env,
                                      cwd=ROOT))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, ranks)
        body = {**CHAT, "max_tokens": 3000, "min_tokens": 3000, "stream": True}
        lines: list[str] = []
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    ranks[1].kill()  # rank 1, mid-stream
        assert lines[-1].startswith('data: {"error"') and "service_unavailable" in lines[-1]
        # what will happen, said truly: no fresh engine can come over a broken group
        assert "a fresh one is starting" not in lines[-1] and "start the server again" in \
            lines[-1] and "lost a rank" in lines[-1]
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503
        assert health.json()["reasons"] == {"model:default_model": "rank_lost"}
        details = httpx.get(f"{url}/health/details", timeout=30)
        assert "stopped answering" in json.dumps(details.json())
        again = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
        assert again.status_code == 503  # at once, not after a wait on the lost rank
        assert "a fresh one is starting" not in again.text
        # no restart is tried over the broken group: the model is down for good, /health
        # 503 (it never flaps back to ok for a server that cannot answer)
        body = httpx.get(f"{url}/health/details", timeout=30).json()
        assert body["models"]["default_model"] == "failed", body
        assert "stopped answering" in json.dumps(body) and "start the server again" in \
            json.dumps(body)
    finally:
        _stop(ranks)


# --- a group the server supervises (pipeline serve --ranks N) --------------------------------

def _followers(gateway: Any) -> list[int]:
    engine = gateway.models["default"].pipeline.engine
    return list(engine._process.followers.pids)


def lost_then_mended(client: httpx.Client, when: str) -> None:
    """``/health`` turns 503 with reason ``rank_lost`` within 10 s of a rank's loss, then
    200 again once a whole fresh group serves (within 180 s)."""
    deadline = time.monotonic() + 10
    while (health := client.get("/health")).status_code == 200:
        assert time.monotonic() < deadline, f"a rank lost {when} never showed in /health"
        time.sleep(0.02)
    assert health.json()["reasons"] == {"engine:default": "rank_lost"}
    deadline = time.monotonic() + 180
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, f"no fresh group after a rank lost {when}"
        time.sleep(0.1)


def test_a_supervised_group_answers_loses_a_rank_and_serves_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.builder import build
    from tests.http_support import config, running
    from transports.http import Gateway

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks inherit it
    gateway = Gateway(config(tmp_path, ranks=2, dtype="float32", restart_delay_s=0.5))
    chat = {**CHAT, "model": "default"}
    with build(TINY_MODEL_DIR, options={"dtype": "float32"}) as one:  # the oracle
        want = one.generate(CHAT["messages"], max_tokens=12, temperature=0).text
    try:
        with running(gateway) as url, httpx.Client(base_url=url, timeout=120) as client:
            answer = client.post("/v1/chat/completions", json=chat).json()
            assert answer["choices"][0]["message"]["content"] == want  # split as one process
            old = _followers(gateway)
            assert len(old) == 1
            # a rank lost mid-stream: the stream ends with a retryable error that says so
            body = {**chat, "max_tokens": 3000, "min_tokens": 3000, "stream": True}
            lines: list[str] = []
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3:
                        os.kill(old[0], signal.SIGKILL)  # a process this test's server started
            assert "service_unavailable" in lines[-1] and "lost a rank" in lines[-1]
            assert "a fresh one is starting" in lines[-1]
            lost_then_mended(client, "mid-stream")
            again = client.post("/v1/chat/completions", json=chat).json()
            assert again["choices"][0]["message"]["content"] == want
            fresh = _followers(gateway)
            assert fresh != old and gateway.models["default"].restarts == 1
            # a rank lost while the group is idle is seen too (no collective would notice)
            os.kill(fresh[0], signal.SIGKILL)
            lost_then_mended(client, "while idle")
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
    finally:
        gateway.close()
    with pytest.raises(ProcessLookupError):  # nothing of the groups is left behind
        os.kill(_followers(gateway)[0], 0)


def test_ranks_need_one_folder_of_safetensors(tmp_path: Path) -> None:
    from pipeline.errors import InvalidValueError
    from tests.http_support import config

    with pytest.raises(InvalidValueError, match="one model"):
        config(tmp_path, ranks=2, models={"a": TINY_MODEL_DIR, "b": TINY_MODEL_DIR})
    with pytest.raises(InvalidValueError, match="GGUF"):
        config(tmp_path, ranks=2, models={"default": None})
