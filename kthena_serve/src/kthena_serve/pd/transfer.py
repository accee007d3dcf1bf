"""One-sided KV block moves between PD workers' pools over a kthena_comm transfer engine.

Put (``BlockPutter``, the PD router's path across hosts): the decode worker registers its
whole pool with a kthena_comm ``mooncake`` engine and sends the ``MemoryHandle`` in every
``PoolRef``; the prefill worker computes into its own pool and moves (own block ids -> decode
block ids) as byte ranges (``KVLayout.pair_ranges``: consecutive runs on both sides coalesce)
through one ``PushSession`` per request, in one of two ways (``PDConfig.kv_push``):

    layerwise  the model's per-layer hook (``ModelRunner.execute(on_layer=...)``) calls
               ``push_layer`` as soon as a layer has written its K/V: that layer's ranges of
               the blocks this step completed go out as one asynchronous put while the next
               layers compute; at the end of the prefill ``finish`` only waits for them
    batched    ``finish`` puts every block in one asynchronous batch after the prefill

Each block of each layer is pushed once, when it is complete (chunked prefill: a block a chunk
fills only partly goes with a later chunk). The session works over any kthena_comm engine
(``mooncake`` across hosts; ``shm`` when the decode pool is a segment that engine allocated,
as the benchmark does). A failed put is kept, not raised into the model's forward (the batch's
other requests go on); ``finish`` raises it once every put of the request has settled or its
deadline has passed. A put past its deadline may still be running (a partitioned link holds
it in the kernel; after healing its bytes land): ``settled`` says when none is (every future
done, and the kernel holds no unacknowledged byte to the decode host: ``wire_backlog``), and
until then the prefill worker answers that the request is still writing
(``PrefillExecutor.cancel``), so the decode worker keeps the destination blocks quarantined
instead of handing them out; it frees them only once its own kernel holds no unread byte from
the prefill host either (`kthena_serve.pd.late_writes`).

Get (behind the Kthena router, ``BlockGetter``): the prefill worker serves its own pool — in a
``shm`` segment other processes on the host can map (``shm_segment_pool``), or registered with
Mooncake — and the decode worker copies the prompt blocks it lacks into its reservation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kthena_comm.errors import TransferTimeoutError, TransportUnavailableError
from kthena_comm.transfer import (
    AscendDirectConfig,
    MemoryHandle,
    MooncakeConfig,
    ShmConfig,
    ShmEngine,
    TransferBatch,
    TransferEngine,
    TransferFuture,
    create_engine,
)
from mooncake_kv.layout import KVLayout, RangePair
from mooncake_kv.pool import KVPool

__all__ = ["BlockGetter", "BlockPush", "BlockPutter", "PushSession", "mooncake_config_for",
           "register_pool", "shm_engine", "shm_segment_pool"]


def register_pool(pool: KVPool, host: str, timeout_s: float,
                  ) -> tuple[TransferEngine, MemoryHandle]:
    """A mooncake engine with ``pool`` registered; returns (engine, handle).

    The engine listens on ``host`` only (``mooncake_kv.listen``: Mooncake by itself listens
    on every interface, and these ports serve the whole pool).

    Raises:
        mooncake_kv.listen.ListenConfinementError: its listeners cannot be kept on ``host``.
    """
    from kthena_comm.transfer.mooncake import installed_build
    from mooncake_kv.listen import confine_listeners

    config = mooncake_config_for(pool.buffer.device, host, timeout_s)
    installed_build()  # loads Mooncake (or says how to install it) before bind is redirected
    with confine_listeners(host):
        engine = create_engine("mooncake", config)
    return engine, engine.register(pool.buffer)


def mooncake_config_for(device: str | torch.device, host: str,
                        timeout_s: float) -> MooncakeConfig:
    """The Mooncake engine settings for a pool on ``device``: TCP for host and cuda memory
    (a CUDA build registers ``cuda:N``); for ``npu:N`` the ascend_direct transport on that NPU
    (docs/accelerators.md: documentation only; a wheel without it refuses before any side
    effect). ``timeout_s`` must exceed the transport's MC_TRANSFER_TIMEOUT (6 s by default).
    """
    kind, _, index = str(device).partition(":")  # str: torch.device("npu") needs torch_npu
    if kind != "npu":
        return MooncakeConfig(host=host, timeout_s=timeout_s)
    return MooncakeConfig(host=host, timeout_s=timeout_s, protocol="ascend",
                          ascend=AscendDirectConfig(device_id=int(index or 0)))


class BlockPush(Protocol):
    """How a prefill's blocks reach the decode pool (``PushSession`` is the Mooncake one)."""

    layerwise: bool

    def push_layer(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Start moving one layer of completed blocks (compute thread, in the model's hook)."""

    def finish(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        """Move what is left and wait for everything; the bytes moved (hand-off thread)."""

    def settled(self) -> bool:
        """Whether no put of this push is running (none may land any more); any thread."""


# How long the kernel must show no unacknowledged byte to the decode host before a session's
# blocks count as settled: bytes the transport still held in user space at the first look would
# be in the kernel by the second (Mooncake hands a slice to its socket as soon as room frees).
QUIET_S = 0.05


class PushSession:
    """One request's KV push from a local pool into a remote one (see the module docs).

    Args:
        engine: the transfer engine ``local`` is registered with.
        local: the handle of the local (prefill) pool; ``layout`` is its layout.
        remote: the handle of the decode pool; ``dst_layout`` is its layout.
        timeout_s: the most ``finish`` waits for the puts.
        layerwise: push layer by layer (``push_layer``) or all at once in ``finish``.
    """

    def __init__(self, engine: TransferEngine, local: MemoryHandle, layout: KVLayout,
                 remote: MemoryHandle, dst_layout: KVLayout, timeout_s: float, *,
                 layerwise: bool) -> None:
        self.engine, self.local, self.layout = engine, local, layout
        self.remote, self.dst_layout, self.timeout_s = remote, dst_layout, timeout_s
        self.layerwise = layerwise
        self.num_bytes = self.num_calls = 0
        self.last_submit: float | None = None  # perf_counter of the last layer's put
        self._futures: list[TransferFuture] = []
        self._num_checked = 0  # futures _failed has seen finish
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._quiet_since: float | None = None  # when `settled` first saw no backlog

    def push_layer(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Put ``layer``'s K/V of ``src_ids[i]`` -> remote ``dst_ids[i]`` asynchronously.

        Called from the model's hook on the compute thread; never raises (a failure is kept
        for ``finish``, and no later layer is sent).
        """
        if not src_ids or self._failed():
            return
        try:
            pairs = self.layout.pair_ranges(src_ids, dst_ids, self.dst_layout, layer=layer)
        except Exception as error:  # noqa: BLE001 - reported by finish, the forward goes on
            self._error = error
            return
        self.put_ranges(pairs)

    def finish(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        """Complete the push: wait for the layer puts (layerwise) or put ``src_ids`` ->
        ``dst_ids`` in one batch (batched); returns the bytes moved.

        Raises:
            kthena_comm.transfer errors (PeerUnreachableError, TransferTimeoutError ...),
            the first a put met, once every put of this session has settled or the deadline
            (``timeout_s`` from now) has passed (``settled`` then says whether one still runs).
        """
        if not self.layerwise and src_ids and self._error is None:
            self.put_ranges(self.layout.pair_ranges(src_ids, dst_ids, self.dst_layout))
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            futures = list(self._futures)
        for future in futures:  # every one settles (or times out) before the blocks go back
            try:
                future.wait(max(0.0, deadline - time.monotonic()))
            except Exception as error:  # noqa: BLE001 - the first is raised below
                self._error = self._error or error
        if self._error is not None:
            raise self._error
        return self.num_bytes

    def settled(self) -> bool:
        """Whether nothing of this session can still write the remote blocks: every put
        submitted has completed or failed, no connection this process opened to the decode
        host is still open, and the kernel holds no byte sent to it that it has not
        acknowledged (`TransferEngine.wire_backlog`). Mooncake reports a put failed at its
        deadline while the put itself goes on: its TCP transport opens a connection per slice
        and closes it when the slice ends, so an open connection is a slice still sending
        (after a partition heals, it delivers), and an orphan's queue is what a closed one
        left to the kernel. The all-clear must be seen on two calls at least `QUIET_S` apart.
        Only a session with a failed put needs that (a put that completed wrote its bytes);
        with an unknown backlog (not Linux) such a session never settles."""
        with self._lock:
            done = all(future.done() for future in self._futures[self._num_checked:])
        if not done:
            self._quiet_since = None
            return False
        if not self._failed():
            return True  # every put completed: Mooncake confirmed its bytes written
        backlog = self.engine.wire_backlog(self.remote)
        if backlog is None or backlog.unacked or backlog.outgoing:
            self._quiet_since = None
            return False
        now = time.monotonic()
        if self._quiet_since is None:
            self._quiet_since = now
        return now - self._quiet_since >= QUIET_S

    def _failed(self) -> bool:
        """Whether a put failed already (the ones that finished are looked at once)."""
        with self._lock:
            while self._error is None and self._num_checked < len(self._futures):
                future = self._futures[self._num_checked]
                if not future.done():
                    break
                self._num_checked += 1
                try:
                    future.wait(0)
                except Exception as error:  # noqa: BLE001 - raised by finish
                    self._error = error
            return self._error is not None

    def put_ranges(self, pairs: Sequence[RangePair]) -> None:
        """Submit one asynchronous put of ``pairs`` (local -> remote byte ranges: a layer's
        blocks, or a caller's, such as a re-sharding hand-off's head slices); a refusal is
        kept for ``finish``, which waits for it with the others."""
        batch = TransferBatch(self.local, self.remote, [p.src_offset for p in pairs],
                              [p.dst_offset for p in pairs], [p.length for p in pairs])
        try:
            future = self.engine.batch_put_async(batch)
        except Exception as error:  # noqa: BLE001 - raised by finish
            self._error = error
            return
        with self._lock:
            self._futures.append(future)
            self.num_calls += 1
            self.num_bytes += batch.nbytes
        self.last_submit = time.perf_counter()


class BlockPutter:
    """Puts blocks of a local pool into remote pools over Mooncake (``PushSession`` per request)."""

    def __init__(self, pool: KVPool, host: str, timeout_s: float) -> None:
        self.layout = pool.layout
        self.engine, self.local = register_pool(pool, host, timeout_s)
        self.timeout_s = timeout_s

    def session(self, remote_json: str, dst_layout: KVLayout, *, layerwise: bool) -> PushSession:
        """A push of one request's blocks into the pool ``remote_json`` names."""
        return PushSession(self.engine, self.local, self.layout,
                           MemoryHandle.from_json(remote_json), dst_layout, self.timeout_s,
                           layerwise=layerwise)

    def put(self, remote_json: str, dst_layout: KVLayout, src_ids: Sequence[int],
            dst_ids: Sequence[int]) -> int:
        """Copy ``src_ids[i]`` -> remote ``dst_ids[i]`` in one batch; returns the bytes moved.

        Raises:
            kthena_comm.transfer errors (PeerUnreachableError, TransferTimeoutError ...).
        """
        return self.session(remote_json, dst_layout, layerwise=False).finish(src_ids, dst_ids)

    def close(self) -> None:
        self.engine.close()


def shm_engine(timeout_s: float) -> TransferEngine:
    """A kthena_comm ``shm`` engine (same-host one-sided transfer)."""
    return create_engine("shm", ShmConfig(timeout_s=timeout_s))


def shm_segment_pool(engine: ShmEngine, layout: KVLayout) -> tuple[KVPool, MemoryHandle]:
    """A pool in a shared segment ``engine`` (shm) allocates: peers on the host can get from it.

    The segment is the engine's: it goes when the engine closes, or, if the process is
    killed, when the engine's janitor notices (close the pool first).
    """
    handle = engine.allocate(layout.total_bytes)
    buffer = torch.frombuffer(engine.buffer(handle), dtype=torch.uint8)
    return KVPool(layout, buffer, None, is_owner=True), handle


class BlockGetter:
    """Gets blocks of a remote pool into a local registered pool (one batch, async + wait).

    Args:
        engine: the transfer engine ``local`` is registered with (shm or mooncake).
        local: the handle of this worker's pool; None for a device pool over shm (which moves
            host memory only): every ``get`` is then refused, naming the mooncake transport.
        layout: this worker's pool layout.
        timeout_s: the most one get may take.
        refusal: with ``local`` None, why a get is refused (default: the device pool's reason).
    """

    def __init__(self, engine: TransferEngine, local: MemoryHandle | None, layout: KVLayout,
                 timeout_s: float, *, refusal: str | None = None) -> None:
        self.engine, self.local, self.layout, self.timeout_s = engine, local, layout, timeout_s
        self.refusal = refusal
        self._outlived: list[TransferFuture] = []  # gets `get` stopped waiting for
        self._lock = threading.Lock()

    def busy(self) -> bool:
        """Whether a get that timed out is still running in the engine (an shm copy on its
        thread, a Mooncake batch not yet ended): it may still write this pool."""
        with self._lock:
            self._outlived = [f for f in self._outlived if not f.done()]
            return bool(self._outlived)

    def get(self, remote: MemoryHandle, remote_layout: KVLayout, src_ids: Sequence[int],
            dst_ids: Sequence[int]) -> int:
        """Copy remote ``src_ids[i]`` -> local ``dst_ids[i]``; returns the bytes moved.

        Raises:
            mooncake_kv.layout errors: ids out of range or repeated, layouts of another shape.
            kthena_comm.transfer errors (PeerUnreachableError, TransferTimeoutError ...).
            TransportUnavailableError: this worker's pool is in device memory and the engine
                is ``shm`` (host memory only).
        """
        if self.local is None and self.refusal is not None:
            raise TransportUnavailableError(self.engine.backend, "this decode pool",
                                            self.refusal)
        if self.local is None:
            raise TransportUnavailableError(
                self.engine.backend, "a decode KV pool in device memory",
                "this engine moves host memory only; pulling a prefill worker's blocks into a "
                "device pool needs --pd-transport mooncake (device memory registered with a "
                "CUDA build of Mooncake)")
        if not src_ids:
            return 0
        pairs = remote_layout.pair_ranges(list(src_ids), list(dst_ids), self.layout)
        batch = TransferBatch(self.local, remote, [p.dst_offset for p in pairs],
                              [p.src_offset for p in pairs], [p.length for p in pairs])
        future = self.engine.batch_get_async(batch)
        try:
            self.engine.wait([future], timeout_s=self.timeout_s)
        except TransferTimeoutError:
            with self._lock:
                self._outlived.append(future)
            raise
        return batch.nbytes
