"""Conformance suite every available transfer backend must pass.

``local`` runs in-process (two engines on one fabric); ``shm``, ``mooncake`` and ``torch`` (gloo
send/recv, the test process is rank 0) run against a peer in a real second process. Checks: exact
byte round-trips with random data, unaligned offsets and scattered block batches, as op lists and
as columnar ``TransferBatch``; async completion; notify after a put, both ways; clear errors
(never hangs) for out-of-range, forged and unregistered remote memory and for a peer killed with
SIGKILL mid-transfer; double close.
"""

from __future__ import annotations

import glob
import mmap
import random
import time

import attrs
import pytest
from _support import eventually, free_port

from kthena_comm.errors import (
    EngineClosedError,
    PeerUnreachableError,
    TransferError,
    UnregisteredRangeError,
)
from kthena_comm.transfer import (
    LocalConfig,
    LocalFabric,
    Notification,
    TorchConfig,
    TransferBatch,
    TransferOp,
    available_backends,
    create_engine,
)

BACKENDS = ["local", "shm", "mooncake", "torch"]
REMOTE_BYTES = 1 << 22
DEADLINE_S = 15.0


class InProcessRemote:
    """The ``local`` backend's peer: another engine on the same fabric, in this process."""

    def __init__(self, fabric: LocalFabric, nbytes: int, seed: int) -> None:
        self.engine = create_engine("local", LocalConfig(fabric))
        self.memory = bytearray(random.Random(seed).randbytes(nbytes))
        self.handle = self.engine.register(self.memory)

    @property
    def address(self) -> str:
        return self.engine.address

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.memory[offset: offset + length])

    def notifies(self, timeout_s: float) -> list[tuple[str, bytes]]:
        return [(n.sender, n.message) for n in self.engine.poll_notifies(timeout_s)]

    def notify(self, address: str, message: bytes) -> None:
        self.engine.notify(address, message)

    def unregister(self) -> None:
        self.engine.unregister(self.handle)

    def kill(self) -> None:
        self.engine.close()

    def close(self) -> None:
        self.engine.close()


class ProcessRemote:
    """A peer process (conftest ``Peer``) seen through the same interface."""

    def __init__(self, peer) -> None:
        self.peer = peer
        self.handle = peer.handle
        self.address = peer.address

    def read(self, offset: int, length: int) -> bytes:
        return self.peer.read(offset, length)

    def notifies(self, timeout_s: float) -> list[tuple[str, bytes]]:
        return self.peer.notifies(timeout_s)

    def notify(self, address: str, message: bytes) -> None:
        self.peer.call(cmd="notify", peer=address, data=message.hex())

    def unregister(self) -> None:
        self.peer.call(cmd="unregister")

    def kill(self) -> None:
        self.peer.kill()

    def close(self) -> None:
        self.peer.close()


def _make_pair(backend: str, peer_factory, seed: int = 7):
    if backend not in available_backends():
        pytest.skip(f"{backend} backend not available here")
    if backend == "local":
        fabric = LocalFabric()
        return create_engine("local", LocalConfig(fabric)), InProcessRemote(fabric, REMOTE_BYTES, seed)
    if backend == "torch":  # the peer waits for us (rank 0 hosts the store) before saying hello
        port = free_port()
        peer = peer_factory("torch", REMOTE_BYTES, seed, str(port))
        config = TorchConfig(rank=0, world_size=2, master_port=port, connect_timeout_s=60)
        return create_engine("torch", config), ProcessRemote(peer)
    return create_engine(backend), ProcessRemote(peer_factory(backend, REMOTE_BYTES, seed))


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request, peer_factory):
    """A long-lived (engine, remote) pair per backend, shared by the round-trip tests."""
    engine, remote = _make_pair(request.param, peer_factory)
    yield engine, remote
    engine.close()
    remote.close()


@pytest.fixture(params=BACKENDS)
def fresh_pair(request, peer_factory):
    """A pair whose remote the test may unregister or kill."""
    engine, remote = _make_pair(request.param, peer_factory, seed=11)
    yield engine, remote
    engine.close()
    remote.close()


def _local(engine, nbytes: int, seed: int):
    memory = mmap.mmap(-1, nbytes)
    memory[:] = random.Random(seed).randbytes(nbytes)
    return memory, engine.register(memory)


def _scattered_ops(local_handle, remote_handle, num_ops: int, seed: int) -> list[TransferOp]:
    """Non-overlapping, unaligned block ranges at random places on both sides."""
    rng = random.Random(seed)
    slot = 8192
    local_slots = rng.sample(range(local_handle.length // slot), num_ops)
    remote_slots = rng.sample(range(remote_handle.length // slot), num_ops)
    ops = []
    for ls, rs in zip(local_slots, remote_slots, strict=True):
        length = rng.randint(1, 4096)
        ops.append(TransferOp(local_handle, ls * slot + rng.randint(0, 4095), remote_handle,
                              rs * slot + rng.randint(0, 4095), length))
    return ops


@pytest.mark.parametrize("seed", [1, 2])
def test_scattered_put_lands_exactly(pair, seed):
    engine, remote = pair
    memory, local = _local(engine, 1 << 20, seed)
    ops = _scattered_ops(local, remote.handle, 64, seed)
    engine.batch_put(ops)
    for op in ops:
        expected = memory[op.local_offset: op.local_offset + op.length]
        assert remote.read(op.remote_offset, op.length) == expected
    engine.unregister(local)


@pytest.mark.parametrize("seed", [3, 4])
def test_scattered_get_reads_exactly(pair, seed):
    engine, remote = pair
    memory, local = _local(engine, 1 << 20, seed)
    ops = _scattered_ops(local, remote.handle, 64, seed)
    engine.batch_get(ops)
    for op in ops:
        got = memory[op.local_offset: op.local_offset + op.length]
        assert got == remote.read(op.remote_offset, op.length)
    engine.unregister(local)


def test_columnar_batch_of_scattered_blocks_round_trips(pair):
    engine, remote = pair
    block = 4096 + 3  # unaligned block size: every block starts at an odd offset
    memory, local = _local(engine, 64 * block, 12)
    rng = random.Random(12)
    remote_ids = rng.sample(range(remote.handle.length // block), 64)
    batch = TransferBatch.from_blocks(local, remote.handle, list(range(64)), remote_ids, block)
    engine.batch_put(batch)
    for i, rid in enumerate(remote_ids):
        assert remote.read(rid * block, block) == memory[i * block: (i + 1) * block]
    back, back_handle = _local(engine, 64 * block, 13)
    engine.batch_get(TransferBatch.from_blocks(back_handle, remote.handle, list(range(64))[::-1],
                                               remote_ids[::-1], block))
    assert back[:] == memory[:]


def test_notify_after_put_arrives_after_the_bytes(pair):
    engine, remote = pair
    memory, local = _local(engine, 1 << 16, 14)
    engine.batch_put([TransferOp(local, 0, remote.handle, 0, 1 << 16)])
    engine.notify(remote.handle, b"req-7:blocks-landed")
    engine.notify(remote.handle, bytes(range(256)))  # any bytes, in order
    got = _collect(remote.notifies, 2)
    assert got == [(engine.address, b"req-7:blocks-landed"), (engine.address, bytes(range(256)))]
    assert remote.read(0, 1 << 16) == memory[:]


def test_notify_reaches_the_initiator_too(pair):
    engine, remote = pair
    if remote.handle.backend == "mooncake":  # rides a transfer: needs memory of the target
        with pytest.raises(TransferError, match="pass a MemoryHandle"):
            engine.notify("127.0.0.1:1", b"x")
        return
    remote.notify(engine.address, b"ack")
    assert _collect(engine.poll_notifies, 1) == [Notification(remote.address, b"ack")]


def _collect(poll, count: int) -> list:
    got: list = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count and time.monotonic() < deadline:
        got += poll(1.0)
    return got


def test_contiguous_round_trip(pair):
    engine, remote = pair
    nbytes = 3 * (1 << 20) + 5
    memory, local = _local(engine, nbytes + 3, 5)
    engine.batch_put([TransferOp(local, 3, remote.handle, 1, nbytes)])
    back, back_handle = _local(engine, nbytes, 6)
    engine.batch_get([TransferOp(back_handle, 0, remote.handle, 1, nbytes)])
    assert back[:] == memory[3: 3 + nbytes]


def test_async_batches_complete(pair):
    # Concurrent batches are not ordered with respect to each other, so they use disjoint ranges.
    engine, remote = pair
    memory, local = _local(engine, 1 << 20, 8)
    ops = _scattered_ops(local, remote.handle, 32, 8)
    puts = [engine.batch_put_async(ops[:16]), engine.batch_put_async(ops[16:])]
    engine.wait(puts)
    assert all(f.done() for f in puts)
    for op in ops:
        assert remote.read(op.remote_offset, op.length) == memory[op.local_offset: op.local_offset + op.length]
    get = engine.batch_get_async([TransferOp(local, 0, remote.handle, 0, 1 << 16)])
    get.wait()
    assert memory[: 1 << 16] == remote.read(0, 1 << 16)


def test_out_of_range_remote_is_rejected_before_sending(pair):
    engine, remote = pair
    _, local = _local(engine, 4096, 1)
    with pytest.raises(UnregisteredRangeError, match="exceeds the registered"):
        engine.batch_put([TransferOp(local, 0, remote.handle, remote.handle.length - 10, 100)])


def test_forged_remote_handle_gives_clear_error(pair):
    engine, remote = pair
    _, local = _local(engine, 4096, 1)
    forged = attrs.evolve(remote.handle, base_addr=remote.handle.base_addr + (1 << 34),
                          segment=remote.handle.segment + "-forged" if remote.handle.segment else "")
    start = time.monotonic()
    with pytest.raises(UnregisteredRangeError) as info:
        engine.batch_put([TransferOp(local, 0, forged, 0, 64)])
    assert time.monotonic() - start < DEADLINE_S
    assert forged.peer in str(info.value) and "put" in str(info.value)


def test_unregistered_local_handle_is_rejected(pair):
    engine, remote = pair
    _, local = _local(engine, 4096, 1)
    engine.unregister(local)
    with pytest.raises(UnregisteredRangeError, match="local handle is not registered"):
        engine.batch_get([TransferOp(local, 0, remote.handle, 0, 64)])


def test_memory_the_peer_unregistered_is_an_error(fresh_pair):
    engine, remote = fresh_pair
    _, local = _local(engine, 4096, 1)
    engine.batch_put([TransferOp(local, 0, remote.handle, 0, 64)])  # maps / connects first
    remote.unregister()
    start = time.monotonic()
    with pytest.raises(TransferError):
        engine.batch_put([TransferOp(local, 0, remote.handle, 0, 64)])
    assert time.monotonic() - start < DEADLINE_S


def test_peer_killed_mid_transfer_raises_not_hangs(fresh_pair, shm_prefix):
    engine, remote = fresh_pair
    memory, local = _local(engine, remote.handle.length, 2)
    op = TransferOp(local, 0, remote.handle, 0, remote.handle.length)
    start = time.monotonic()
    with pytest.raises((PeerUnreachableError, UnregisteredRangeError, TransferError)) as info:
        future = engine.batch_put_async([op])
        remote.kill()
        future.wait()
        while time.monotonic() - start < DEADLINE_S:
            engine.batch_put([op])
    assert time.monotonic() - start < DEADLINE_S + 1
    assert remote.handle.peer in str(info.value)
    with pytest.raises((PeerUnreachableError, TransferError)):
        engine.notify(remote.handle, b"are you there?")
    assert time.monotonic() - start < DEADLINE_S + 5
    assert eventually(lambda: not glob.glob(f"/dev/shm/{shm_prefix}*"), 5)


def test_double_close_is_harmless_and_later_use_is_clear(fresh_pair):
    engine, _ = fresh_pair
    _, local = _local(engine, 4096, 1)
    engine.close()
    engine.close()
    with pytest.raises(EngineClosedError, match="after close"):
        engine.batch_put([TransferOp(local, 0, local, 0, 1)])
