"""Columnar batches: grouping, validation, coalescing, the vectorised copy; notify limits."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kthena_comm.errors import PeerUnreachableError, UnregisteredRangeError
from kthena_comm.transfer import (
    MAX_NOTIFY_BYTES,
    LocalConfig,
    LocalFabric,
    Notifier,
    TransferBatch,
    TransferOp,
    create_engine,
)
from kthena_comm.transfer.batch import batches_of, coalesce, copy_ranges


def _handle(engine, nbytes: int, fill: int = 0):
    memory = bytearray([fill]) * nbytes if fill else bytearray(nbytes)
    return memory, engine.register(memory)


def test_coalesce_merges_only_ranges_adjacent_on_both_sides():
    dst = np.array([8, 12, 0, 100], dtype=np.int64)
    src = np.array([0, 4, 8, 50], dtype=np.int64)
    lengths = np.array([4, 4, 4, 4], dtype=np.int64)
    d, s, n = coalesce(dst, src, lengths)
    assert d.tolist() == [8, 0, 100] and s.tolist() == [0, 8, 50] and n.tolist() == [8, 4, 4]


def test_batches_of_groups_by_handle_pair_in_order():
    with create_engine("local") as engine:
        _, a = _handle(engine, 64)
        _, b = _handle(engine, 64)
        ops = [TransferOp(a, 0, b, 8, 4), TransferOp(b, 0, a, 0, 2), TransferOp(a, 4, b, 0, 4)]
        batches = batches_of(ops)
        assert [(x.local, x.remote) for x in batches] == [(a, b), (b, a)]
        assert list(batches[0].remote_offsets) == [8, 0]
        many = [TransferOp(a, i, b, 63 - i, 1) for i in range(40)]  # past SMALL_BATCH: numpy
        (columnar,) = batches_of(many)
        assert isinstance(columnar, TransferBatch) and columnar.to_ops() == many


def test_batch_columns_are_checked():
    with create_engine("local") as engine:
        _, a = _handle(engine, 64)
        with pytest.raises(ValueError, match="differ in length"):
            TransferBatch(a, a, [0, 1], [0], [1])
        with pytest.raises(ValueError, match="lengths must be > 0"):
            TransferBatch(a, a, [0], [0], [0])
        with pytest.raises(ValueError, match="block_bytes"):
            TransferBatch.from_blocks(a, a, [0], [1], 0)
        batch = TransferBatch.from_blocks(a, a, [0, 1], [3, 4], 16)  # block 4 ends at 80 > 64
        with pytest.raises(UnregisteredRangeError, match=r"remote range \[64, 80\) exceeds"):
            engine.batch_put(batch)
        with pytest.raises(ValueError, match="read-only"):
            batch.lengths[0] = 1


def test_local_batch_moves_blocks_and_mixed_handles():
    fabric = LocalFabric()
    with create_engine("local", LocalConfig(fabric)) as src, \
            create_engine("local", LocalConfig(fabric)) as dst:
        memory, local = _handle(src, 64 * 10)
        memory[:] = bytes(range(64)) * 10
        target, remote = _handle(dst, 64 * 10)
        src.batch_put(TransferBatch.from_blocks(local, remote, [0, 1, 2, 9], [5, 6, 7, 0], 64))
        assert target[5 * 64: 8 * 64] == memory[:3 * 64] and target[:64] == memory[9 * 64:]
        other_mem, other = _handle(src, 32, fill=7)
        src.batch_put([TransferOp(other, 0, remote, 600, 32), TransferOp(local, 0, remote, 0, 1)])
        assert target[600:632] == other_mem[:] and target[0] == memory[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 40)),
                min_size=1, max_size=30), st.booleans())
def test_copy_ranges_equals_one_memmove_per_range(ranges, shuffle):
    """Non-overlapping random ranges (slot-based), some adjacent, copied like a naive loop."""
    size = 64 * len(ranges)
    src = (ctypes.c_uint8 * size)(*[(i * 7 + 3) % 251 for i in range(size)])
    want, got = (ctypes.c_uint8 * size)(), (ctypes.c_uint8 * size)()
    order = list(range(len(ranges)))[::-1] if shuffle else list(range(len(ranges)))
    s_off = [64 * i + a for i, (a, _, _) in enumerate(ranges)]
    d_off = [64 * j + b for j, (_, b, _) in zip(order, ranges, strict=True)]
    lengths = [n for _, _, n in ranges]
    for d, s, n in zip(d_off, s_off, lengths, strict=True):
        ctypes.memmove(ctypes.addressof(want) + d, ctypes.addressof(src) + s, n)
    copy_ranges(ctypes.addressof(got) + np.array(d_off, dtype=np.int64),
                ctypes.addressof(src) + np.array(s_off, dtype=np.int64),
                np.array(lengths, dtype=np.int64))
    assert bytes(got) == bytes(want)


def test_notify_is_small_and_needs_a_live_peer():
    fabric = LocalFabric()
    with create_engine("local", LocalConfig(fabric)) as a, \
            create_engine("local", LocalConfig(fabric)) as b:
        assert isinstance(a, Notifier)
        with pytest.raises(ValueError, match="exceeds"):
            a.notify(b.address, bytes(MAX_NOTIFY_BYTES + 1))
        with pytest.raises(ValueError, match="must be bytes"):
            a.notify(b.address, "text")
        a.notify(b.address, b"")
        assert [n.message for n in b.poll_notifies()] == [b""]
        assert b.poll_notifies(0.01) == []
        b.close()
        with pytest.raises(PeerUnreachableError, match="no open engine"):
            a.notify(b.address, b"late")
