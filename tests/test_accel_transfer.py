"""Transfer engines and device memory: what each backend accepts, and the Ascend set-up order.

Two kinds of checks, kept apart (docs/accelerators.md):
* against the real, installed Mooncake wheel (``mooncake-transfer-engine-non-cuda``): device
  memory is refused with a message naming the missing build, and an ascend config is refused
  before any environment variable is written or torch_npu imported;
* against TEST DOUBLES (tests/doubles): the exact calls our backend makes on CUDA and Ascend
  builds we do not have. Those show what our code sends, never that Mooncake accepts it.
"""

from __future__ import annotations

import os
import sys

import pytest
from doubles import fake_mooncake, fake_torch_npu

from kthena_comm.errors import (
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnregisteredRangeError,
)
from kthena_comm.transfer import (
    HOST,
    AscendDirectConfig,
    DeviceBuffer,
    MemoryHandle,
    MemoryLocation,
    MooncakeConfig,
    MooncakeEngine,
    ShmConfig,
    TransferOp,
    create_engine,
)
from kthena_comm.transfer._ascend import apply_environment, ascend_environment
from kthena_comm.transfer._status import HixlStatus, hixl_error, mooncake_error

CUDA0 = MemoryLocation("cuda", 0)
NPU3 = MemoryLocation("npu", 3)


class FakeCudaTensor:
    """Just enough of a torch tensor on cuda:1 for registration (no GPU here)."""

    def __init__(self, addr: int = 0x7F00_0000_0000, numel: int = 4096) -> None:
        import torch

        self.device = torch.device("cuda", 1)
        self._addr, self._numel = addr, numel

    def data_ptr(self) -> int:
        return self._addr

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 2


@pytest.fixture
def clean_env(monkeypatch):
    """The variables the ascend set-up writes: absent now, and restored after the test."""
    for key in fake_mooncake.ENV_KEYS:
        monkeypatch.setenv(key, "placeholder")
        monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def npu_adapter_reset():
    yield
    from mooncake_ops.backends import torch_npu_api

    torch_npu_api.load.cache_clear()


# ---- memory locations -----------------------------------------------------------------------------
def test_locations_parse_print_and_validate():
    assert [str(MemoryLocation.parse(t)) for t in ("host", "cuda:0", "npu:7")] == \
        ["host", "cuda:0", "npu:7"]
    for bad in ("gpu:0", "cuda", "npu:-1", "host:0"):
        with pytest.raises(ValueError, match="memory location"):
            MemoryLocation.parse(bad)
    with pytest.raises(ValueError, match="device id"):
        MemoryLocation("npu")
    assert MemoryHandle.from_json(MemoryHandle("mooncake", "h:1", 64, 8, location="npu:2")
                                  .to_json()).location == "npu:2"


@pytest.mark.parametrize("backend", ["local", "shm"])
def test_host_backends_refuse_device_memory_and_say_where_to_go(backend, shm_prefix):
    config = ShmConfig(prefix=shm_prefix) if backend == "shm" else None
    with create_engine(backend, config) as engine:
        for memory in (DeviceBuffer(1 << 20, 4096, CUDA0), DeviceBuffer(1 << 20, 4096, NPU3),
                       FakeCudaTensor()):
            with pytest.raises(TransportUnavailableError,
                               match=f"{backend}: cannot use (cuda|npu):\\d memory: the "
                                     f"{backend} backend moves host memory only.*mooncake"):
                engine.register(memory)
        assert engine.register(bytearray(64)).location == "host"


def test_a_stated_location_must_match_the_memory():
    with create_engine("local") as engine, pytest.raises(ValueError, match="is in host"):
        engine.register(bytearray(64), location=CUDA0)


# ---- the real, installed Mooncake wheel (no CUDA, no ascend_direct) ---------------------------------
@pytest.mark.mooncake
def test_installed_non_cuda_wheel_refuses_device_memory_naming_the_build():
    engine = create_engine("mooncake", MooncakeConfig())
    try:
        assert (engine.build.cuda, engine.build.ascend_direct) == (False, False)
        assert engine.build.package.startswith("mooncake-transfer-engine-non-cuda ")
        with pytest.raises(TransportUnavailableError) as cuda:
            engine.register(DeviceBuffer(1 << 20, 4096, CUDA0))
        assert "mooncake: cannot use cuda:0 memory" in str(cuda.value)
        assert "mooncake-transfer-engine-non-cuda" in str(cuda.value)
        assert "SUPPORT_CUDA is False" in str(cuda.value) and "-DUSE_CUDA=ON" in str(cuda.value)
        with pytest.raises(TransportUnavailableError) as npu:
            engine.register(DeviceBuffer(1 << 20, 4096, NPU3))
        assert "no ascend_direct transport" in str(npu.value)
        assert "-DUSE_ASCEND_DIRECT=ON" in str(npu.value)
        assert engine.register(bytearray(4096)).location == "host"  # host memory still works
    finally:
        engine.close()


@pytest.mark.mooncake
def test_installed_wheel_refuses_an_ascend_config_before_any_side_effect(clean_env):
    imported_before = "torch_npu" in sys.modules
    config = MooncakeConfig(protocol="ascend", ascend=AscendDirectConfig(device_id=0))
    with pytest.raises(TransportUnavailableError, match="protocol 'ascend'.*-DUSE_ASCEND_DIRECT"):
        MooncakeEngine(config)
    assert not any(k in os.environ for k in fake_mooncake.ENV_KEYS)
    assert ("torch_npu" in sys.modules) == imported_before  # no device selection attempted


# ---- CUDA builds, through the Mooncake test double --------------------------------------------------
def test_cuda_memory_is_registered_with_its_device_location(monkeypatch, tmp_path):
    log = fake_mooncake.install(monkeypatch, tmp_path, cuda=True)
    engine = MooncakeEngine(MooncakeConfig(protocol="rdma", device_name="mlx5_0"))
    try:
        handle = engine.register(FakeCudaTensor(addr=0x7F00_0000_0000, numel=4096))
        buffer = engine.register(DeviceBuffer(0x7E00_0000_0000, 1 << 20, CUDA0))
    finally:
        engine.close()
    assert log.of("initialize") == [(("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0"), {})]
    registered = [args for args, _ in log.of("register_memory")]
    assert registered[1:] == [(0x7F00_0000_0000, 8192, "cuda:1"),
                              (0x7E00_0000_0000, 1 << 20, "cuda:0")]
    assert registered[0][2] == "*"  # the notify scratch buffer: host memory, auto location
    assert (handle.location, buffer.location) == ("cuda:1", "cuda:0")


@pytest.mark.parametrize("protocol, flag", [("nvlink", "-DUSE_MNNVL=ON"),
                                            ("nvlink_intra", "-DUSE_INTRA_NVLINK=ON")])
def test_nvlink_protocols_need_their_own_build_flag(monkeypatch, tmp_path, protocol, flag):
    fake_mooncake.install(monkeypatch, tmp_path, cuda=True)
    with MooncakeEngine(MooncakeConfig(protocol=protocol)) as engine, \
            pytest.raises(TransportUnavailableError, match=flag):
        engine.register(DeviceBuffer(1 << 30, 4096, CUDA0))


# ---- Ascend (ascend_direct) builds, through the doubles ----------------------------------------------
def _ascend_engine(monkeypatch, tmp_path, **ascend):
    log = fake_mooncake.install(monkeypatch, tmp_path, ascend_direct=True)
    npu = fake_torch_npu.install(monkeypatch, "2.5.1")
    npu.calls = log.calls  # one log, so the order across both doubles shows
    config = MooncakeConfig(host="10.0.0.5", protocol="ascend",
                            ascend=AscendDirectConfig(device_id=3, **ascend))
    return MooncakeEngine(config), log


def test_ascend_setup_follows_the_documented_order(clean_env, tmp_path, npu_adapter_reset):
    engine, log = _ascend_engine(clean_env, tmp_path, connect_timeout_ms=4000,
                                 transfer_timeout_ms=5000, use_async_transfer=True,
                                 intra_roce=True, cann_version="8.5.0")
    engine.close()
    assert log.names()[:4] == ["npu.set_device", "TransferEngine()", "initialize",
                               "register_memory"]
    assert log.calls[0][1] == (3,)
    assert log.calls[1][2]["env"] == {
        "ASCEND_CONNECT_TIMEOUT": "4000", "ASCEND_TRANSFER_TIMEOUT": "5000",
        "ASCEND_USE_ASYNC_TRANSFER": "1", "HCCL_INTRA_ROCE_ENABLE": "1",
        "MC_TRANSFER_TIMEOUT": "6"}
    # bare host for ascend_direct (vllm-ascend), not the HCCL transport's host:port:npu_N
    assert log.of("initialize") == [(("10.0.0.5", "P2PHANDSHAKE", "ascend", ""), {})]
    assert engine.address == "10.0.0.5:15000"


def test_ascend_registers_npu_memory_and_maps_put_to_write_get_to_read(clean_env, tmp_path,
                                                                      npu_adapter_reset):
    engine, log = _ascend_engine(clean_env, tmp_path)
    try:
        local = engine.register(DeviceBuffer(0x1000_0000, 1 << 21, NPU3))
        with pytest.raises(TransportUnavailableError, match="initialised on npu:3"):
            engine.register(DeviceBuffer(0x3000_0000, 1 << 21, MemoryLocation("npu", 0)))
        with pytest.raises(TransportUnavailableError, match="cuda:0 memory: .*without CUDA"):
            engine.register(DeviceBuffer(0x4000_0000, 1 << 21, CUDA0))
        remote = MemoryHandle("mooncake", "10.0.0.6:15001", 0x2000_0000, 1 << 21,
                              location="npu:0")
        engine.batch_put([TransferOp(local, 0, remote, 4096, 512)])
        engine.batch_get([TransferOp(local, 1024, remote, 0, 256)])
    finally:
        engine.close()
    assert log.of("register_memory")[-1] == ((0x1000_0000, 1 << 21, "npu:3"), {})
    assert local.location == "npu:3"
    # small batches go through Mooncake's own async verbs, then wait on the batch id
    assert log.of("batch_transfer_async_write") == [
        (("10.0.0.6:15001", [0x1000_0000], [0x2000_1000], [512]), {})]
    assert log.of("batch_transfer_async_read") == [
        (("10.0.0.6:15001", [0x1000_0400], [0x2000_0000], [256]), {})]
    assert len(log.of("get_batch_transfer_status")) == 2
    assert not log.of("batch_transfer_sync_write") and not log.of("batch_transfer_sync_read")


def test_ascend_env_already_set_differently_is_refused_before_anything_runs(clean_env, tmp_path,
                                                                            npu_adapter_reset):
    clean_env.setenv("ASCEND_TRANSFER_TIMEOUT", "9999")
    with pytest.raises(ValueError, match="ASCEND_TRANSFER_TIMEOUT='9999' \\(config wants '5000'"):
        _ascend_engine(clean_env, tmp_path)


def test_ascend_config_rules():
    with pytest.raises(ValueError, match="CANN 8.5 or later; cann_version is '8.3.RC1'"):
        AscendDirectConfig(device_id=0, use_async_transfer=True, cann_version="8.3.RC1")
    with pytest.raises(ValueError, match="CANN 8.5"):
        AscendDirectConfig(device_id=0, use_async_transfer=True)
    with pytest.raises(ValueError, match="go together"):
        MooncakeConfig(protocol="ascend")
    with pytest.raises(ValueError, match="go together"):
        MooncakeConfig(ascend=AscendDirectConfig(device_id=0))
    with pytest.raises(ValueError, match="must exceed MC_TRANSFER_TIMEOUT=11s"):
        MooncakeConfig(protocol="ascend", timeout_s=10.0,
                       ascend=AscendDirectConfig(device_id=0, transfer_timeout_ms=10_000))
    assert ascend_environment(AscendDirectConfig(device_id=0)) == {
        "ASCEND_CONNECT_TIMEOUT": "10000", "ASCEND_TRANSFER_TIMEOUT": "5000",
        "MC_TRANSFER_TIMEOUT": "6"}
    env = {"ASCEND_CONNECT_TIMEOUT": "10000"}
    apply_environment({"ASCEND_CONNECT_TIMEOUT": "10000", "X": "1"}, env)  # same value: fine
    assert env == {"ASCEND_CONNECT_TIMEOUT": "10000", "X": "1"}


def test_chunked_batches_use_the_sync_verbs_put_write_get_read(monkeypatch, tmp_path):
    log = fake_mooncake.install(monkeypatch, tmp_path)
    with MooncakeEngine(MooncakeConfig(max_batch_ops=1)) as engine:
        local = engine.register(bytearray(64))
        remote = MemoryHandle("mooncake", "10.0.0.9:1", 4096, 64)
        ops = [TransferOp(local, 0, remote, 0, 8), TransferOp(local, 32, remote, 16, 8)]
        engine.batch_put(ops)
        engine.batch_get(ops)
    base = local.base_addr
    assert [a for a, _ in log.of("batch_transfer_sync_write")] == [
        ("10.0.0.9:1", [base], [4096], [8]), ("10.0.0.9:1", [base + 32], [4112], [8])]
    assert len(log.of("batch_transfer_sync_read")) == 2


# ---- status codes -> exceptions -------------------------------------------------------------------
def test_hixl_status_families_map_to_our_exceptions():
    cases = {HixlStatus.TIMEOUT: TransferTimeoutError, HixlStatus.NOT_CONNECTED:
             PeerUnreachableError, HixlStatus.PARAM_INVALID: UnregisteredRangeError,
             HixlStatus.FAILED: TransferError, HixlStatus.RESOURCE_EXHAUSTED: TransferError}
    for status, cls in cases.items():
        error = hixl_error(status, "mooncake", "p:1", "put")
        assert type(error) is cls and f"({status.name})" in str(error)
    assert hixl_error(0, "m", "p", "put") is None
    assert hixl_error(HixlStatus.ALREADY_CONNECTED, "m", "p", "put") is None
    assert "103901" in str(hixl_error(103901, "m", "p", "get"))


def test_mooncake_failures_sort_into_the_same_families():
    def error(answers, elapsed, limit):
        return mooncake_error(-1, "mooncake", "p:1", "put", peer_answers=answers,
                              elapsed_s=elapsed, transport_timeout_s=limit)

    assert type(error(False, 0.1, 5.0)) is PeerUnreachableError
    assert type(error(True, 5.2, 5.0)) is TransferTimeoutError
    assert type(error(True, 0.1, 5.0)) is UnregisteredRangeError
    assert type(error(True, 99.0, None)) is UnregisteredRangeError


@pytest.mark.parametrize("probe_rc, cls", [(1, PeerUnreachableError), (0, UnregisteredRangeError)])
def test_failed_mooncake_transfer_raises_by_family(monkeypatch, tmp_path, probe_rc, cls):
    fake_mooncake.install(monkeypatch, tmp_path, transfer_rc=-1, probe_rc=probe_rc)
    with MooncakeEngine(MooncakeConfig()) as engine:
        local = engine.register(bytearray(64))
        remote = MemoryHandle("mooncake", "10.0.0.9:1", 4096, 64)
        with pytest.raises(cls, match="Mooncake returned -1"):
            engine.batch_put([TransferOp(local, 0, remote, 0, 8)])
    assert HOST == MemoryLocation.parse("host")


@pytest.fixture
def shm_prefix():
    import uuid

    return f"kthena-accel-{uuid.uuid4().hex[:8]}"
