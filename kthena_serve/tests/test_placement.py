"""A tp x pp engine on its device (`kthena_serve.engine.placement`, issue 38 item 1).

On CPU: each rank of a TP=2 and of a PP=2 engine reports every parameter, buffer and KV pool
tensor on the device it bound, over the gloo group; the backend chosen per device type is the
documented one; ``KTHENA_DIST_BACKEND`` is honoured when it names that backend and refused
otherwise; a device this host lacks is refused by ``EngineConfig`` and by ``kthena serve``.
Where two GPUs exist, ``test_tp2_on_cuda_matches_tp1_on_cuda`` (picked by ``pytest -k cuda``,
which scripts/gpu_check.py runs) checks the same placement over nccl and greedy parity.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from _tiny import tiny_checkpoint

from kthena_comm import device as device_module
from kthena_comm.device import DeviceBackend
from kthena_core.ports import free_port
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import ConfigError, EngineConfig
from kthena_serve.engine.placement import DIST_BACKEND_ENV, DistBackendError, dist_backend
from kthena_serve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.mark.parametrize(("device", "backend"), [
    ("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl"), ("npu", "hccl"), ("npu:0", "hccl"),
])
def test_each_device_type_takes_its_documented_backend(device, backend):
    assert dist_backend(device, {}) == backend
    assert dist_backend(device, {DIST_BACKEND_ENV: backend}) == backend  # kthena-run's export
    assert dist_backend(device, {DIST_BACKEND_ENV: ""}) == backend


@pytest.mark.parametrize(("device", "value", "message"), [
    ("cpu", "mpi", "KTHENA_DIST_BACKEND='mpi' is not a collective backend: one of 'gloo', "
     "'hccl', 'nccl', or unset"),
    ("cpu", "nccl", "KTHENA_DIST_BACKEND='nccl', but device 'cpu' takes 'gloo'"),
    ("cuda", "gloo", "KTHENA_DIST_BACKEND='gloo', but device 'cuda' takes 'nccl'"),
    ("npu", "NCCL", "KTHENA_DIST_BACKEND='NCCL' is not a collective backend"),
], ids=["unknown", "nccl-on-cpu", "gloo-on-cuda", "case-matters"])
def test_a_backend_variable_the_device_cannot_take_is_refused(device, value, message):
    with pytest.raises(DistBackendError, match=message):
        dist_backend(device, {DIST_BACKEND_ENV: value})


def _fake_devices(monkeypatch, kind: str, count: int) -> None:
    entry = DeviceBackend(kind, device_module.backend_for_device(kind), lambda rank: None,
                          lambda: count, "fake devices")
    monkeypatch.setitem(device_module._REGISTRY, kind, entry)


@pytest.mark.parametrize(("count", "fields", "message"), [
    (1, {"tp": 2}, "tp 2 x pp 1 spawns one rank per cuda device of this host and needs 2, but "
     "this host has 1"),
    (3, {"tp": 2, "pp": 2}, "needs 4, but this host has 3"),
    (0, {"tp": 2, "ranks_from": "env"}, "each rank binds cuda:LOCAL_RANK, but this host has 0"),
    (1, {"device": "cuda:1"}, "'cuda:1' needs 2 cuda device"),
    (8, {"device": "cuda:0", "tp": 2}, "EngineConfig.device must be 'cuda' without an index "
     "when tp x pp > 1 or ranks_from='env' (got 'cuda:0'); each rank binds cuda:LOCAL_RANK"),
], ids=["tp2-one-device", "tp2xpp2-three", "env-none", "index-past-the-count", "index-with-tp"])
def test_config_refuses_devices_this_host_lacks(monkeypatch, count, fields, message):
    _fake_devices(monkeypatch, "cuda", count)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**{"device": "cuda", **fields})


@pytest.mark.parametrize(("count", "fields"), [
    (2, {"tp": 2}), (4, {"tp": 2, "pp": 2}), (1, {"tp": 8, "ranks_from": "env"}),
    (2, {"device": "cuda:1"}), (1, {}),
], ids=["tp2", "tp2xpp2", "env-tp8-one-per-host", "second-device", "one"])
def test_config_takes_devices_this_host_has(monkeypatch, count, fields):
    _fake_devices(monkeypatch, "cuda", count)
    EngineConfig(**{"device": "cuda", **fields})


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has 2 CUDA devices")
def test_cuda_tp2_without_two_gpus_is_refused_naming_what_this_host_has():
    have = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"EngineConfig.device must be a device this host has "
                       f"\\(got 'cuda'\\); tp 2 x pp 1 spawns one rank per cuda device of this "
                       f"host and needs 2, but this host has {have} \\(cuda needs a CUDA build "
                       "of torch and a visible GPU"):
        EngineConfig(device="cuda", tp=2)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_refused():
    with pytest.raises(ConfigError, match="this host has 0 \\(npu needs torch_npu with CANN"):
        EngineConfig(device="npu", tp=8)
    assert "torch_npu" not in sys.modules  # looked for, never imported


def _kthena_serve(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has 2 CUDA devices")
def test_kthena_serve_refuses_cuda_tp2_without_two_gpus_in_one_line():
    done = _kthena_serve("--device", "cuda", "--tp", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("kthena serve: --device: EngineConfig.device must be a "
                                  "device this host has (got 'cuda'); tp 2 x pp 1 spawns")
    assert done.stderr.count("\n") == 1, done.stderr  # no traceback


def test_kthena_serve_refuses_a_backend_variable_the_device_cannot_take():
    done = _kthena_serve("--tp", "2", **{DIST_BACKEND_ENV: "hccl"})
    assert done.returncode == 2
    assert done.stderr == ("kthena serve: KTHENA_DIST_BACKEND='hccl', but device 'cpu' takes "
                           "'gloo' (cpu gloo, cuda nccl, npu hccl): unset it, set it to 'gloo' "
                           "(kthena-run --backend gloo), or change --device\n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _engine(checkpoint, **fields) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(checkpoint), dtype="float32",
                                              kernels="torch", num_kv_blocks=64, block_size=4,
                                              max_num_batched_tokens=64, **fields))


def _greedy(engine: LLMEngine) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [list(done[f"r{i}"]) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def tp1_cpu(checkpoint):
    engine = _engine(checkpoint)
    try:
        return _greedy(engine)
    finally:
        engine.close()


def _check_placement(engine: LLMEngine, world_size: int, backend: str, device_of) -> None:
    placements = engine.runner.placements()
    assert [p.rank for p in placements] == list(range(world_size))
    for p in placements:
        assert (p.device, p.backend) == (device_of(p.rank), backend)
        assert p.parameters == p.buffers == p.pool == {p.device}, p
        assert p.is_all_on_device
        assert p.num_parameters > 0 and p.num_buffers > 0 and p.num_pool_tensors > 1
    assert engine.runner.device == torch.device(device_of(0))


@pytest.mark.parametrize(("layout", "environ"), [
    ({"tp": 2}, {}),
    ({"pp": 2}, {DIST_BACKEND_ENV: "gloo"}),  # as kthena-run exports it on a CPU host
], ids=["tp2", "pp2-with-KTHENA_DIST_BACKEND"])
def test_every_rank_holds_its_shard_and_pool_on_its_device(monkeypatch, checkpoint, tp1_cpu,
                                                           layout, environ):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)  # spawned ranks inherit it; rank 0 reads it
    engine = _engine(checkpoint, **layout)
    try:
        _check_placement(engine, 2, "gloo", lambda rank: "cpu")
        assert _greedy(engine) == tp1_cpu  # the step protocol works around the question
        _check_placement(engine, 2, "gloo", lambda rank: "cpu")
    finally:
        engine.close()


def test_a_refused_backend_variable_stops_the_engine_before_any_rank_starts(monkeypatch,
                                                                            checkpoint):
    monkeypatch.setenv(DIST_BACKEND_ENV, "nccl")
    with pytest.raises(DistBackendError, match="device 'cpu' takes 'gloo'"):
        _engine(checkpoint, tp=2)


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 1, reason="no CUDA device here"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_a_launcher_rank_binds_local_rank_0_over_its_devices_backend(monkeypatch, checkpoint,
                                                                    device):
    """One launcher-started rank (WORLD_SIZE=1, as kthena-run --nproc_per_node 1 starts it):
    the whole parallel runner path, on one device; on a one-GPU machine, over nccl."""
    single = _engine(checkpoint, device=device)
    try:
        expected = _greedy(single)
    finally:
        single.close()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    engine = _engine(checkpoint, device=device, ranks_from="env")
    try:
        backend = {"cpu": "gloo", "cuda": "nccl"}[device]
        _check_placement(engine, 1, backend, lambda rank: "cpu" if device == "cpu" else "cuda:0")
        assert _greedy(engine) == expected
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_cuda_matches_tp1_on_cuda(checkpoint):
    single = _engine(checkpoint, device="cuda")
    try:
        assert single.runner.device.type == "cuda"
        expected = _greedy(single)
    finally:
        single.close()
    engine = _engine(checkpoint, device="cuda", tp=2)
    try:
        _check_placement(engine, 2, "nccl", lambda rank: f"cuda:{rank}")
        assert _greedy(engine) == expected
    finally:
        engine.close()
