"""Transfer value types, registry, shm specifics (mode 0600, zero copy) and bucket planning."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from kthena_comm.bucketing import plan_buckets
from kthena_comm.errors import UnknownBackendError, UnregisteredRangeError
from kthena_comm.transfer import (
    MemoryHandle,
    ShmConfig,
    TransferEngine,
    TransferOp,
    available_backends,
    create_engine,
)


def test_handle_round_trips_through_json():
    handle = MemoryHandle("shm", "shm:42", 4096, 1 << 20, "kthena-42-0-ab", layout_id="kv0")
    assert MemoryHandle.from_json(handle.to_json()) == handle


@pytest.mark.parametrize("field, value", [("length", 0), ("base_addr", -1)])
def test_handle_rejects_bad_sizes(field, value):
    kwargs = {"backend": "local", "peer": "p", "base_addr": 0, "length": 1, field: value}
    with pytest.raises(ValueError, match=field):
        MemoryHandle(**kwargs)


def test_registry_lists_backends_and_rejects_unknown():
    assert {"local", "shm", "torch"} <= set(available_backends())
    with pytest.raises(UnknownBackendError, match="unknown transfer backend 'hixl'"):
        create_engine("hixl")


def test_engines_satisfy_the_protocol():
    with create_engine("local") as engine:
        assert isinstance(engine, TransferEngine)


def test_tensors_register_and_device_or_strided_ones_are_refused():
    with create_engine("local") as engine:
        src = torch.arange(64, dtype=torch.float32)
        dst = torch.zeros(64)
        hs, hd = engine.register(src), engine.register(dst)
        engine.batch_put([TransferOp(hs, 16, hd, 32, 64)])  # loopback: elements 4..19 -> 8..23
        assert torch.equal(dst[8:24], src[4:20])
        with pytest.raises(ValueError, match="non-contiguous"):
            engine.register(torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="read-only"):
            engine.register(b"immutable")


def test_shm_segments_are_owner_only_and_removed_on_close(shm_prefix):
    engine = create_engine("shm", ShmConfig(prefix=shm_prefix))
    handle = engine.allocate(1 << 16)
    path = f"/dev/shm/{handle.segment}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    engine.close()
    assert not os.path.exists(path)


def test_shm_inbox_is_owner_only_and_removed_on_close(shm_prefix):
    engine = create_engine("shm", ShmConfig(prefix=shm_prefix))
    path = f"/dev/shm/{engine.address.split(':')[2]}"
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    engine.close()
    assert not os.path.exists(path)


def test_shm_peer_sees_a_mapped_write_without_a_put(shm_prefix):
    owner = create_engine("shm", ShmConfig(prefix=shm_prefix))
    producer = create_engine("shm", ShmConfig(prefix=shm_prefix))
    handle = owner.allocate(4096)
    view = torch.frombuffer(producer.buffer(handle), dtype=torch.uint8)
    view[:10] = torch.arange(10, dtype=torch.uint8)  # "compute" straight into the peer's pool
    assert bytes(owner.buffer(handle)[:10]) == bytes(range(10))
    del view
    producer.close()
    owner.close()


def test_shm_private_memory_is_not_a_valid_remote(shm_prefix):
    with create_engine("shm", ShmConfig(prefix=shm_prefix)) as engine:
        private = engine.register(bytearray(64))
        with pytest.raises(UnregisteredRangeError, match="private memory"):
            engine.batch_put([TransferOp(private, 0, private, 0, 8)])


def test_shm_peer_being_reaped_counts_as_gone(monkeypatch):
    """A peer that exits mid-transfer can be in the kernel's reaping window, where its
    /proc/<pid>/stat opens and the read fails with ESRCH: that is a gone peer
    (PeerUnreachableError), not a ProcessLookupError escaping the transfer. The open() double
    stands in for that window, which a test cannot hit on purpose."""
    import builtins

    from kthena_comm.errors import PeerUnreachableError
    from kthena_comm.transfer import shm

    assert shm._pid_alive(os.getpid())
    real_open = builtins.open

    def reaping_open(path, *args, **kwargs):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            raise ProcessLookupError(3, "No such process")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", reaping_open)
    assert not shm._pid_alive(os.getpid())
    handle = MemoryHandle("shm", f"shm:{os.getpid()}:inbox", 0, 4096, "kthena-x")
    assert isinstance(shm._gone_error("shm", "read", handle), PeerUnreachableError)


def test_buckets_respect_dtype_and_limit():
    tensors = [torch.zeros(2), torch.zeros(2), torch.zeros(1, dtype=torch.int64),
               torch.zeros(10), torch.zeros(1)]
    assert plan_buckets(tensors, bucket_bytes=16) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(tensors, bucket_bytes=1 << 20) == [[0, 1, 3, 4], [2]]
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_buckets(tensors, 0)
