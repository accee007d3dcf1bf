"""``torch`` backend specifics: bounded init, a stopped (not dead) peer, clean close, loopback."""

from __future__ import annotations

import mmap
import signal
import threading
import time

import pytest
from _support import eventually, free_port

from kthena_comm.errors import InitError, PeerUnreachableError, TransferTimeoutError
from kthena_comm.transfer import TorchConfig, TransferOp, create_engine


def _service_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kthena-torch-svc")]


def test_missing_peer_is_an_init_error_not_a_hang():
    start = time.monotonic()
    config = TorchConfig(rank=0, world_size=2, master_port=free_port(), connect_timeout_s=1.5)
    with pytest.raises(InitError, match="MASTER_ADDR/MASTER_PORT/WORLD_SIZE"):
        create_engine("torch", config)
    assert time.monotonic() - start < 15


def test_single_rank_world_copies_locally_and_checks_ranges():
    config = TorchConfig(rank=0, world_size=1, master_port=free_port(), connect_timeout_s=10)
    with create_engine("torch", config) as engine:
        src, dst = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)
        src[:] = bytes(range(256)) * 16
        hs, hd = engine.register(src), engine.register(dst)
        engine.batch_put([TransferOp(hs, 1, hd, 3, 1000)])
        assert dst[3:1003] == src[1:1001]
        engine.unregister(hd)
        with pytest.raises(ValueError, match="no registered memory"):
            engine.batch_put([TransferOp(hs, 0, hd, 0, 8)])


def test_stopped_peer_times_out_then_engine_refuses_quickly(peer_factory):
    port = free_port()
    peer = peer_factory("torch", 1 << 20, 3, str(port))
    config = TorchConfig(rank=0, world_size=2, master_port=port, timeout_s=2.0)
    engine = create_engine("torch", config)
    handle = peer.handle
    memory = mmap.mmap(-1, 1 << 20)
    local = engine.register(memory)
    engine.batch_put([TransferOp(local, 0, handle, 0, 4096)])
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        # delivery can lag on a loaded machine
        assert eventually(lambda: _is_stopped(peer.proc.pid), 10, interval_s=0.02), \
            "SIGSTOP did not take effect"
        start = time.monotonic()
        with pytest.raises(TransferTimeoutError, match=handle.peer):
            engine.batch_put([TransferOp(local, 0, handle, 0, 1 << 20)])
        assert time.monotonic() - start < 6
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError, match="create a new engine"):
            engine.batch_get([TransferOp(local, 0, handle, 0, 64)])
        assert time.monotonic() - start < 1
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        engine.close()
    assert not _service_threads()


def _is_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] in ("T", "t")


def test_close_stops_service_threads_and_peer_sees_us_gone(peer_factory):
    port = free_port()
    peer = peer_factory("torch", 1 << 16, 4, str(port))
    engine = create_engine("torch", TorchConfig(rank=0, world_size=2, master_port=port))
    address = engine.address
    assert peer.handle.peer != address and _service_threads()
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 6 and not _service_threads()
    assert "PeerUnreachableError" in _peer_notify_until_error(peer, address)


def _peer_notify_until_error(peer, address: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the peer learns of our close when its pair closes
        reply = peer.call(cmd="notify", peer=address, data="")
        if "error" in reply:
            return reply["error"]
        time.sleep(0.1)
    return "no error within 10 s"
