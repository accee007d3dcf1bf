"""``python -m kthena_serve.bench.kv_move``: article B's KV-move table, on our transfer engines.

Moves the KV of one request (LLaMA-2-70B shape by default: 80 layers, 8 KV heads, head_dim 128,
bf16, 16-token blocks, PER_LAYER pools) from a prefill pool to a decode pool by six methods:

  host_copy            gather the request's blocks into one host staging buffer, one put of it
                       to a staging buffer on the decode side, scatter it into the decode blocks
  per_token_put        one synchronous put per token and K/V part (2 x tokens calls), each
                       carrying that token's row in every layer
  batched_put          one synchronous put of all coalesced ranges (``KVLayout.pair_ranges``)
  batched_async_put    ``batch_put_async`` + ``wait``, submitted after the compute
  layerwise_async_put  one ``batch_put_async`` per layer, submitted as that layer's compute
                       ends, all waited at the end
  zero_copy_shared     the compute writes the KV straight into the decode pool (shm only: a
                       segment both sides map); after the compute only the control message

over each transport: ``shm`` (kthena_comm shm engines), ``mooncake_loopback`` (two kthena_comm
mooncake engines on 127.0.0.1) and, with ``--netns``, ``mooncake_netns`` (prefill and decode in
two child processes, each in its own network namespace, joined by a veth pair).

For every (transport, method) it reports the median over repeats of: ``calls`` (transfer-engine
put calls), ``ranges``, ``bytes`` (put into the decode side), ``transfer_s`` (the move alone,
nothing else running; host_copy includes its gather and scatter) and ``ready_after_compute_s``
(end of the prefill compute until the decode side holds all the KV and has the control message
that says so), with ``start_to_ready_s`` (first layer's compute until then: overlap may slow the
compute, which ``ready_after_compute_s`` alone would hide) and ``layer_compute_ms`` (the
stand-in's measured time per layer in that run). Every move is checked: the decode pool's
destination blocks must equal the source KV byte for byte (``KVMoveMismatchError`` otherwise),
and only then is ``verified`` set.

The prefill compute is a STAND-IN, not a model: per layer one bf16 ``torch.matmul`` sized to
take about ``--layer-compute-ms`` on this CPU, then the layer's K and V written into the pool
(the prefill pool, or the decode pool for zero copy). A 70B model does not run on 2 CPU cores;
the stand-in only gives the layer-wise and async puts real compute to overlap with.

Prints one JSON line (with the article's own figures under ``article_claims``, labelled as
claims) and, with ``--plot PATH``, writes a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kthena_serve.bench.machine import cpu_model
from kthena_serve.bench.netns import NetnsUnavailable, two_namespaces
from kthena_serve.bench.optional import draw, plot_or_note
from kthena_serve.bench.plot import save_figure

if TYPE_CHECKING:
    import torch

    from kthena_comm.transfer import (
        MemoryHandle,
        Notifier,
        TransferBatch,
        TransferEngine,
        TransferFuture,
    )
    from mooncake_kv.layout import RangePair
    from mooncake_kv.pool import KVPool

    class _Engine(TransferEngine, Notifier, Protocol):
        """A transfer engine that also sends control messages (every built-in backend)."""

__all__ = [
    "ARTICLE_CLAIMS",
    "METHODS",
    "KVMoveMismatchError",
    "bench_kv_move",
    "main",
    "plot_kv_move",
]

METHODS = ("host_copy", "per_token_put", "batched_put", "batched_async_put",
           "layerwise_async_put", "zero_copy_shared")
BLOCK_SIZE = 16
_SEED = 20240521
_NOTIFY = b"kv-ready"
_MODULE = "kthena_serve.bench.kv_move"  # run as -m, __name__ is "__main__"
_PROTO = "KVMB "  # prefix of protocol lines from the child processes (Mooncake logs elsewhere)

ARTICLE_CLAIMS = {
    "label": "CLAIMED by article B (its own figures, not measured or reproduced here): "
             "LLaMA-2-70B on 8 Ascend cards, batch 1, 128-token prompts",
    "rows": [
        {"setting": "co-located / copy through host memory", "prefill_ms": 180,
         "decode_first_token_ms": 65, "kv_copy_ms": 35, "throughput_tok_s": 15},
        {"setting": "PD with zero-copy sharing", "prefill_ms": 180,
         "decode_first_token_ms": 18, "kv_copy_ms": 0, "throughput_tok_s": 68},
        {"setting": "+ batched put (2 calls instead of 256)", "prefill_ms": 167,
         "decode_first_token_ms": None, "kv_copy_ms": None, "throughput_tok_s": None},
        {"setting": "+ asynchronous put/get", "prefill_ms": 155,
         "decode_first_token_ms": 12, "kv_copy_ms": None, "throughput_tok_s": None},
    ],
}


class KVMoveMismatchError(AssertionError):
    """The decode pool's destination blocks differ from the source KV after a move."""


# ---- geometry, KV and the compute stand-in ---------------------------------------------------
class _Geometry:
    """The request: ``tokens`` tokens in consecutive blocks; source ids 1.., destination 2.."""

    def __init__(self, tokens: int, layers: int, kv_heads: int, head_dim: int) -> None:
        from mooncake_kv.layout import KVLayout, LayoutKind
        from mooncake_kv.sizing import KVShape

        self.tokens, self.layers = tokens, layers
        self.num_blocks = -(-tokens // BLOCK_SIZE)
        shape = KVShape(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        block_size=BLOCK_SIZE, dtype="bf16")
        self.layout = KVLayout(shape, self.num_blocks + 3, LayoutKind.PER_LAYER)
        self.src = list(range(1, 1 + self.num_blocks))
        self.dst = list(range(2, 2 + self.num_blocks))
        self.row_bytes = kv_heads * head_dim * shape.dtype.element_bytes
        self.kv_bytes = tokens * shape.element_bytes_per_token
        self.block_bytes = self.num_blocks * self.layout.bytes_per_block

    @classmethod
    def from_config(cls, config: dict) -> _Geometry:
        return cls(config["tokens"], config["layers"], config["kv_heads"], config["head_dim"])

    def src_slice(self) -> slice:
        return slice(self.src[0], self.src[-1] + 1)

    def dst_slice(self) -> slice:
        return slice(self.dst[0], self.dst[-1] + 1)


def _fresh_kv(geometry: _Geometry) -> KVPool:
    """The KV the stand-in compute "produces": a private pool of seeded random bytes.

    Seeded, so a process in another namespace rebuilds the same bytes to check against.
    """
    import torch

    from mooncake_kv.pool import KVPool

    pool = KVPool.create(geometry.layout)
    generator = torch.Generator().manual_seed(_SEED)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=generator,
                                    dtype=torch.uint8))
    return pool


def _store_layer(fresh: KVPool, target: KVPool, geometry: _Geometry, layer: int,
                 dst: slice) -> None:
    """Write the request's K and V of ``layer`` from ``fresh`` into ``target``'s blocks ``dst``."""
    src = geometry.src_slice()
    target.k_cache(layer)[dst].copy_(fresh.k_cache(layer)[src])
    target.v_cache(layer)[dst].copy_(fresh.v_cache(layer)[src])


def _verify(fresh: KVPool, pool: KVPool, geometry: _Geometry, where: str) -> None:
    """Raise ``KVMoveMismatchError`` unless every token row of the request is byte-identical.

    Compares the request's ``tokens`` rows (K and V, every layer) of ``pool``'s destination
    blocks with the source KV, as int16 so that bf16 NaN patterns compare by their bits.
    """
    import torch

    src, dst, tokens = geometry.src_slice(), geometry.dst_slice(), geometry.tokens
    for layer in range(geometry.layers):
        for part, view in (("K", "k_cache"), ("V", "v_cache")):
            want = getattr(fresh, view)(layer)[src].flatten(0, 1)[:tokens].view(torch.int16)
            got = getattr(pool, view)(layer)[dst].flatten(0, 1)[:tokens].view(torch.int16)
            if not torch.equal(want, got):
                bad = int((want != got).flatten(1).any(dim=1).nonzero()[0])
                raise KVMoveMismatchError(
                    f"{where}: layer {layer} {part} of token {bad} differs between the source "
                    f"KV and decode block {geometry.dst[bad // BLOCK_SIZE]}; a move must copy "
                    "every byte")


def _zero_request(pool: KVPool, geometry: _Geometry) -> None:
    """Zero the destination blocks, so a move that copies nothing cannot pass the check."""
    buffer = pool.buffer
    for r in pool.layout.batch_ranges(geometry.dst):
        buffer[r.offset:r.end].zero_()


class _Compute:
    """Stand-in for one decoder layer's prefill compute: a bf16 ``n x n`` matmul."""

    def __init__(self, n: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(_SEED)
        self.n = n
        self.a = torch.randn(n, n, generator=generator).to(torch.bfloat16)
        self.out = torch.empty(n, n, dtype=torch.bfloat16)

    def layer(self) -> None:
        import torch

        torch.matmul(self.a, self.a, out=self.out)

    def median_ms(self, samples: int = 9) -> float:
        self.layer()
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            self.layer()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3


def _calibrate(target_ms: float) -> int:
    """The matmul size whose run takes about ``target_ms`` here (multiple of 16, >= 16)."""
    n = 256
    for _ in range(4):
        took = _Compute(n).median_ms(5)
        n = max(16, round(n * (target_ms / max(took, 1e-3)) ** (1 / 3) / 16) * 16)
    return n


# ---- the decode side ---------------------------------------------------------------------------
class _LocalDecode:
    """Decode side in this process: its own engine, a pool and a staging buffer it serves."""

    def __init__(self, engine: Notifier, pool: KVPool, pool_handle: MemoryHandle,
                 staging: torch.Tensor, staging_handle: MemoryHandle, geometry: _Geometry,
                 fresh: KVPool, where: str) -> None:
        self.engine, self.pool, self.pool_handle = engine, pool, pool_handle
        self.staging, self.staging_handle = staging, staging_handle
        self.geometry, self.fresh, self.where = geometry, fresh, where
        self._scatter_armed = False

    def reset(self) -> None:
        _zero_request(self.pool, self.geometry)
        self.staging.zero_()

    def scatter(self) -> float:
        """Copy the staging buffer into the destination blocks; returns the seconds it took."""
        start = time.perf_counter()
        _scatter(self.staging, self.pool, self.geometry)
        return time.perf_counter() - start

    def arm(self, scatter: bool) -> None:
        self._scatter_armed = scatter

    def collect(self, timeout_s: float) -> float:
        """Wait for the control message (then scatter if armed); returns when the KV was ready."""
        _await_notify(self.engine, timeout_s, self.where)
        if self._scatter_armed:
            self.scatter()
        return time.perf_counter()

    def verify(self, method: str) -> None:
        _verify(self.fresh, self.pool, self.geometry, f"{self.where}/{method}")


def _await_notify(engine: Notifier, timeout_s: float, where: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll_notifies(min(0.5, max(0.0, deadline - time.monotonic()))):
            return
    raise TimeoutError(f"{where}: no 'KV ready' message within {timeout_s}s; raise --timeout-s "
                       "if the machine is busy")


def _gather(pool: KVPool, staging: torch.Tensor, geometry: _Geometry) -> None:
    """Copy the request's source blocks, range by range, into the contiguous staging buffer."""
    buffer, position = pool.buffer, 0
    for r in pool.layout.batch_ranges(geometry.src):
        staging[position:position + r.length].copy_(buffer[r.offset:r.end])
        position += r.length


def _scatter(staging: torch.Tensor, pool: KVPool, geometry: _Geometry) -> None:
    """The inverse of ``_gather``, into the destination blocks (same order of ranges)."""
    buffer, position = pool.buffer, 0
    for r in pool.layout.batch_ranges(geometry.dst):
        buffer[r.offset:r.end].copy_(staging[position:position + r.length])
        position += r.length


class _LineChannel:
    """One JSON line per message to and from a child process, with a deadline on reads."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
        self.proc, self.timeout_s, self.what = proc, timeout_s, what
        self._pending = b""

    def send(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def receive(self) -> dict:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        deadline = time.monotonic() + self.timeout_s
        while True:
            line, sep, rest = self._pending.partition(b"\n")
            if sep:
                self._pending = rest
                text = line.decode(errors="replace")
                if not text.startswith(_PROTO):
                    continue  # a library's stray output; protocol lines carry the prefix
                message = json.loads(text[len(_PROTO):])
                if "error" in message:
                    raise RuntimeError(f"{self.what} failed: {message['error']}")
                return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.what} sent nothing for {self.timeout_s}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.what} exited (status {self.proc.poll()})")
                self._pending += chunk


class _RemoteDecode:
    """Decode side in a child process (another namespace), driven over its stdin / stdout."""

    def __init__(self, channel: _LineChannel, where: str) -> None:
        from kthena_comm.transfer import MemoryHandle

        self.channel, self.where = channel, where
        hello = channel.receive()
        self.pool_handle = MemoryHandle.from_json(hello["pool"])
        self.staging_handle = MemoryHandle.from_json(hello["staging"])

    def reset(self) -> None:
        self.channel.send({"cmd": "reset"})
        self.channel.receive()

    def scatter(self) -> float:
        self.channel.send({"cmd": "scatter"})
        return self.channel.receive()["scatter_s"]

    def arm(self, scatter: bool) -> None:
        self.channel.send({"cmd": "await", "scatter": scatter})

    def collect(self, timeout_s: float) -> float:
        return self.channel.receive()["t_ready"]  # CLOCK_MONOTONIC: one clock for the host

    def verify(self, method: str) -> None:
        self.channel.send({"cmd": "verify", "method": method})
        self.channel.receive()


def _decode_side_main(config: dict) -> None:
    """Child process in the decode namespace: serve a registered pool, obey the prefill side."""
    import torch

    from kthena_comm.transfer import MooncakeConfig, create_engine
    from mooncake_kv.pool import KVPool

    torch.set_num_threads(1)
    geometry = _Geometry.from_config(config)
    engine = create_engine("mooncake", MooncakeConfig(host=config["host"],
                                                      timeout_s=config["timeout_s"]))
    pool = KVPool.create(geometry.layout)
    fresh = _fresh_kv(geometry)
    staging = torch.zeros(geometry.block_bytes, dtype=torch.uint8)

    def reply(message: dict) -> None:
        sys.stdout.write(_PROTO + json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        side = _LocalDecode(engine, pool, engine.register(pool.buffer), staging,
                            engine.register(staging), geometry, fresh, "mooncake_netns")
        reply({"pool": side.pool_handle.to_json(), "staging": side.staging_handle.to_json()})
        for line in sys.stdin:
            command = json.loads(line)
            try:
                if command["cmd"] == "reset":
                    side.reset()
                    reply({"ok": True})
                elif command["cmd"] == "scatter":
                    reply({"scatter_s": side.scatter()})
                elif command["cmd"] == "await":
                    side.arm(command["scatter"])
                    reply({"t_ready": side.collect(config["timeout_s"])})
                elif command["cmd"] == "verify":
                    side.verify(command["method"])
                    reply({"verified": True})
                else:
                    reply({"error": f"unknown command {command['cmd']!r}; use reset, scatter, "
                                    "await or verify"})
            except Exception as exc:  # reported to the prefill side, which raises it
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        engine.close()
        pool.close()
        fresh.close()


# ---- the prefill side: methods ----------------------------------------------------------------
class _Sender:
    """The prefill engine, counting put calls, ranges and bytes."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.calls = self.ranges = self.bytes = 0

    def _count(self, batch: TransferBatch) -> None:
        self.calls += 1
        self.ranges += len(batch)
        self.bytes += batch.nbytes

    def put(self, batch: TransferBatch) -> None:
        self._count(batch)
        self.engine.batch_put(batch)

    def put_async(self, batch: TransferBatch) -> TransferFuture:
        self._count(batch)
        return self.engine.batch_put_async(batch)


def _batch(local: MemoryHandle, remote: MemoryHandle, pairs: Sequence[RangePair],
           ) -> TransferBatch:
    from kthena_comm.transfer import TransferBatch

    return TransferBatch(local, remote, [p.src_offset for p in pairs],
                         [p.dst_offset for p in pairs], [p.length for p in pairs])


def _per_token_batches(geometry: _Geometry, local: MemoryHandle, remote: MemoryHandle,
                       ) -> list[TransferBatch]:
    """One batch per (token, K|V): that token's row in every layer."""
    from kthena_comm.transfer import TransferBatch
    from mooncake_kv.layout import KVPart

    layout, row = geometry.layout, geometry.row_bytes
    batches = []
    for token in range(geometry.tokens):
        block, slot = divmod(token, BLOCK_SIZE)
        for part in KVPart:
            src = [layout.segment(geometry.src[block], layer, part).offset + slot * row
                   for layer in range(geometry.layers)]
            dst = [layout.segment(geometry.dst[block], layer, part).offset + slot * row
                   for layer in range(geometry.layers)]
            batches.append(TransferBatch(local, remote, src, dst, [row] * len(src)))
    return batches


class _Method:
    """How one method moves the KV: a hook after each layer's compute, and the rest after."""

    def __init__(self, on_layer: Callable[[int], None], finish: Callable[[], None],
                 scatter: bool = False, in_place: bool = False) -> None:
        self.on_layer, self.finish = on_layer, finish
        self.scatter, self.in_place = scatter, in_place


def _methods(sender: _Sender, local: MemoryHandle, staging_local: MemoryHandle,
             decode: _LocalDecode | _RemoteDecode, prefill_pool: KVPool, staging: torch.Tensor,
             geometry: _Geometry, timeout_s: float, zero_copy: bool) -> dict[str, _Method]:
    from kthena_comm.transfer import TransferBatch

    layout = geometry.layout
    pairs = layout.pair_ranges(geometry.src, geometry.dst, layout)
    batched = _batch(local, decode.pool_handle, pairs)
    per_layer = [_batch(local, decode.pool_handle,
                        layout.pair_ranges(geometry.src, geometry.dst, layout, layer=layer))
                 for layer in range(geometry.layers)]
    per_token = _per_token_batches(geometry, local, decode.pool_handle)
    staged = TransferBatch(staging_local, decode.staging_handle, [0], [0], [geometry.block_bytes])
    pending: list = []

    def nothing(layer: int | None = None) -> None:
        return None

    def host_copy() -> None:
        _gather(prefill_pool, staging, geometry)
        sender.put(staged)

    def per_token_put() -> None:
        for batch in per_token:
            sender.put(batch)

    def batched_async() -> None:
        sender.engine.wait([sender.put_async(batched)], timeout_s)

    def layer_submit(layer: int) -> None:
        pending.append(sender.put_async(per_layer[layer]))

    def layer_wait() -> None:
        futures = list(pending)
        pending.clear()
        sender.engine.wait(futures, timeout_s)

    methods = {
        "host_copy": _Method(nothing, host_copy, scatter=True),
        "per_token_put": _Method(nothing, per_token_put),
        "batched_put": _Method(nothing, lambda: sender.put(batched)),
        "batched_async_put": _Method(nothing, batched_async),
        "layerwise_async_put": _Method(layer_submit, layer_wait),
    }
    if zero_copy:
        methods["zero_copy_shared"] = _Method(nothing, nothing, in_place=True)
    return methods


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _run_transport(transport: str, sender: _Sender, local: MemoryHandle,
                   staging_local: MemoryHandle, decode: _LocalDecode | _RemoteDecode,
                   prefill_pool: KVPool, staging: torch.Tensor, fresh: KVPool,
                   geometry: _Geometry, compute: _Compute, repeats: int, timeout_s: float,
                   shared_decode_pool: KVPool | None = None) -> list[dict]:
    """Every method over one transport; one row each (medians over ``repeats``)."""
    for layer in range(geometry.layers):  # what the prefill computed: its pool holds the KV
        _store_layer(fresh, prefill_pool, geometry, layer, geometry.src_slice())
    methods = _methods(sender, local, staging_local, decode, prefill_pool, staging, geometry,
                       timeout_s, shared_decode_pool is not None)
    control = {"request_id": "req-1", "block_ids": geometry.dst, "tokens": geometry.tokens}
    message = _NOTIFY + json.dumps(control).encode()
    rows = []
    for name in METHODS:
        method = methods.get(name)
        if method is None:
            rows.append(_not_applicable(transport, name))
            continue
        transfer, ready, whole, layer_ms, counts, checks = [], [], [], [], None, 0
        for repeat in range(repeats + 1):  # the first round warms up (Mooncake handshakes)
            if not method.in_place:
                decode.reset()
                sender.calls = sender.ranges = sender.bytes = 0
                start = time.perf_counter()
                for layer in range(geometry.layers):
                    method.on_layer(layer)
                method.finish()
                took = time.perf_counter() - start
                if method.scatter:
                    took += decode.scatter()
                decode.verify(name)  # raises KVMoveMismatchError on any differing byte
                checks += 1
                counts = (sender.calls, sender.ranges, sender.bytes)
                if repeat:
                    transfer.append(took)
            decode.reset()
            decode.arm(method.scatter)
            target, dst = ((shared_decode_pool, geometry.dst_slice()) if method.in_place
                           else (prefill_pool, geometry.src_slice()))
            compute_s, started = 0.0, time.perf_counter()
            for layer in range(geometry.layers):
                begin = time.perf_counter()
                compute.layer()
                _store_layer(fresh, target, geometry, layer, dst)
                compute_s += time.perf_counter() - begin
                method.on_layer(layer)
            end_of_compute = time.perf_counter()
            method.finish()
            sender.engine.notify(decode.pool_handle, message)
            ready_at = decode.collect(timeout_s)
            decode.verify(name)
            checks += 1
            if repeat:
                ready.append(ready_at - end_of_compute)
                whole.append(ready_at - started)
                layer_ms.append(compute_s / geometry.layers * 1e3)
        in_place_bytes = geometry.block_bytes
        calls, ranges, moved = counts if counts else (0, 0, in_place_bytes)
        rows.append({
            "transport": transport, "method": name, "applicable": True,
            "calls": calls, "ranges": ranges, "bytes": moved,
            "transfer_s": _median(transfer) if transfer else 0.0,
            "ready_after_compute_s": _median(ready),
            "start_to_ready_s": _median(whole),
            "layer_compute_ms": _median(layer_ms),
            "samples": repeats, "checks": checks, "verified": checks > 0,
            **_note(name, geometry),
        })
    return rows


def _note(method: str, geometry: _Geometry) -> dict:
    if method == "zero_copy_shared":
        return {"note": "nothing is moved after the compute: it wrote the KV into the decode "
                        "pool; bytes = what it wrote there, calls/ranges = put calls (none)"}
    if method == "host_copy":
        runs = len(geometry.layout.batch_ranges(geometry.src))
        return {"note": f"calls/ranges are the staging put; around it a gather and a scatter "
                        f"of {runs} ranges each copy the KV through host memory"}
    return {}


def _not_applicable(transport: str, method: str) -> dict:
    return {"transport": transport, "method": method, "applicable": False,
            "reason": "Mooncake moves bytes between registered memories of two processes (or "
                      "hosts); there is no pool both sides map, so the prefill cannot write the "
                      "decode pool in place",
            "calls": None, "ranges": None, "bytes": None, "transfer_s": None,
            "ready_after_compute_s": None, "start_to_ready_s": None, "layer_compute_ms": None,
            "samples": 0, "verified": None}


# ---- transports --------------------------------------------------------------------------------
def _shm_rows(geometry: _Geometry, fresh: KVPool, compute: _Compute, repeats: int,
              timeout_s: float) -> list[dict]:
    import torch

    from kthena_serve.pd.transfer import shm_engine, shm_segment_pool
    from mooncake_kv.pool import KVPool

    engines, pools = [], []
    try:
        prefill_engine = shm_engine(timeout_s)
        engines.append(prefill_engine)
        decode_engine = shm_engine(timeout_s)
        engines.append(decode_engine)
        decode_pool, decode_handle = shm_segment_pool(decode_engine, geometry.layout)
        pools.append(decode_pool)
        staging_handle = decode_engine.allocate(geometry.block_bytes)
        decode_staging = torch.frombuffer(decode_engine.buffer(staging_handle), dtype=torch.uint8)
        # the prefill side maps the decode segment: zero copy writes into it in place
        mapped = torch.frombuffer(prefill_engine.buffer(decode_handle), dtype=torch.uint8)
        shared = KVPool(geometry.layout, mapped, None, is_owner=True)
        pools.append(shared)
        prefill_pool = KVPool.create(geometry.layout)
        pools.append(prefill_pool)
        staging = torch.zeros(geometry.block_bytes, dtype=torch.uint8)
        sender = _Sender(prefill_engine)
        decode = _LocalDecode(decode_engine, decode_pool, decode_handle, decode_staging,
                              staging_handle, geometry, fresh, "shm")
        return _run_transport("shm", sender, prefill_engine.register(prefill_pool.buffer),
                              prefill_engine.register(staging), decode, prefill_pool, staging,
                              fresh, geometry, compute, repeats, timeout_s, shared)
    finally:
        for pool in pools:
            pool.close()
        for engine in engines:
            engine.close()


def _mooncake_loopback_rows(geometry: _Geometry, fresh: KVPool, compute: _Compute,
                            repeats: int, timeout_s: float) -> list[dict]:
    import torch

    from kthena_comm.transfer import MooncakeConfig, create_engine
    from mooncake_kv.pool import KVPool

    engines, pools = [], []
    try:
        for _ in range(2):
            engines.append(create_engine("mooncake", MooncakeConfig(host="127.0.0.1",
                                                                    timeout_s=timeout_s)))
        prefill_engine, decode_engine = engines
        prefill_pool, decode_pool = KVPool.create(geometry.layout), KVPool.create(geometry.layout)
        pools += [prefill_pool, decode_pool]
        staging = torch.zeros(geometry.block_bytes, dtype=torch.uint8)
        decode_staging = torch.zeros(geometry.block_bytes, dtype=torch.uint8)
        decode = _LocalDecode(decode_engine, decode_pool,
                              decode_engine.register(decode_pool.buffer), decode_staging,
                              decode_engine.register(decode_staging), geometry, fresh,
                              "mooncake_loopback")
        return _run_transport("mooncake_loopback", _Sender(prefill_engine),
                              prefill_engine.register(prefill_pool.buffer),
                              prefill_engine.register(staging), decode, prefill_pool, staging,
                              fresh, geometry, compute, repeats, timeout_s)
    finally:
        for engine in engines:
            engine.close()
        for pool in pools:
            pool.close()


def _prefill_side_main(config: dict) -> None:
    """Child process in the prefill namespace: start the decode child in the other namespace,
    run every method over Mooncake between them, print the rows."""
    import torch

    from kthena_comm.transfer import MooncakeConfig, create_engine
    from mooncake_kv.pool import KVPool

    torch.set_num_threads(1)
    geometry = _Geometry.from_config(config)
    timeout_s = config["timeout_s"]
    decode_config = dict(config, host=config["decode_addr"])
    stderr = tempfile.TemporaryFile()
    child = subprocess.Popen(
        ["ip", "netns", "exec", config["decode_ns"], sys.executable, "-m", _MODULE,
         "--_decode-side", json.dumps(decode_config)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    engine = pool = fresh = None
    try:
        channel = _LineChannel(child, timeout_s + 30, "the decode process (mooncake_netns)")
        decode = _RemoteDecode(channel, "mooncake_netns")
        engine = create_engine("mooncake", MooncakeConfig(host=config["prefill_addr"],
                                                          timeout_s=timeout_s))
        pool, fresh = KVPool.create(geometry.layout), _fresh_kv(geometry)
        staging = torch.zeros(geometry.block_bytes, dtype=torch.uint8)
        rows = _run_transport("mooncake_netns", _Sender(engine), engine.register(pool.buffer),
                              engine.register(staging), decode, pool, staging, fresh, geometry,
                              _Compute(config["matmul_n"]), config["repeats"], timeout_s)
        sys.stdout.write(_PROTO + json.dumps({"rows": rows}) + "\n")
    except Exception as exc:  # the parent reports it as the reason the row set is missing
        stderr.seek(0)
        tail = stderr.read().decode(errors="replace")[-1500:]
        sys.stdout.write(_PROTO + json.dumps({"error": f"{type(exc).__name__}: {exc}; decode "
                                                       f"process stderr: {tail}"}) + "\n")
    finally:
        sys.stdout.flush()
        with contextlib.suppress(BrokenPipeError, OSError):
            child.stdin.close()  # type: ignore[union-attr]  # EOF: the decode child exits
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if engine is not None:
            engine.close()
        for p in (pool, fresh):
            if p is not None:
                p.close()


def _netns_rows(config: dict, run_timeout_s: float) -> tuple[list[dict], str | None]:
    """Rows of ``mooncake_netns`` from a prefill child in namespace A; or ([], why not)."""
    try:
        with two_namespaces("kvm", 216) as (ns_a, ns_b, addr_a, addr_b):
            child_config = dict(config, decode_ns=ns_b, prefill_addr=addr_a, decode_addr=addr_b)
            child = subprocess.Popen(
                ["ip", "netns", "exec", ns_a, sys.executable, "-m", _MODULE, "--_prefill-side",
                 json.dumps(child_config)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)  # its own group: on a timeout both children go
            try:
                out, err = child.communicate(timeout=run_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.communicate()
                return [], f"the namespace run took over {run_timeout_s:.0f}s and was killed"
            lines = [line[len(_PROTO):] for line in out.decode(errors="replace").splitlines()
                     if line.startswith(_PROTO)]
            if not lines:
                return [], (f"the prefill process exited with status {child.returncode} and no "
                            f"result: {err.decode(errors='replace')[-1500:]}")
            result = json.loads(lines[-1])
            if "error" in result:
                error = (KVMoveMismatchError if "KVMoveMismatchError" in result["error"]
                         else RuntimeError)
                raise error(f"mooncake_netns: {result['error']}")
            return result["rows"], None
    except NetnsUnavailable as exc:
        return [], str(exc)


# ---- entry points -------------------------------------------------------------------------------
def _machine() -> dict:
    import torch

    return {"processor": platform.processor() or platform.machine(), "cpu_model": cpu_model(),
            "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "python": platform.python_version()}


def _positive(name: str, value: float, kind: type = int) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


def bench_kv_move(tokens: int = 128, repeats: int = 5, netns: bool = False, *,
                  layers: int = 80, kv_heads: int = 8, head_dim: int = 128,
                  layer_compute_ms: float = 2.0, timeout_s: float = 60.0) -> dict:
    """Measure every (transport, method) of article B's table; see the module docstring.

    Args:
        tokens: prompt tokens whose KV moves (blocks of 16).
        repeats: measured rounds per method (after one warm-up round); medians are reported.
        netns: also run ``mooncake_netns`` (needs root; skipped with the reason otherwise).
        layers, kv_heads, head_dim: the KV shape (default LLaMA-2-70B: 80, 8, 128; bf16).
        layer_compute_ms: the compute stand-in's target time per layer.
        timeout_s: deadline of one transfer or control message.
    Returns:
        A JSON-able dict: ``rows`` (one per transport and method), ``skipped``, the stand-in's
        size and measured time, the machine and load, and ``article_claims``.
    Raises:
        ValueError: a non-positive size, count or time.
        KVMoveMismatchError: a move left the decode blocks different from the source KV.
    """
    import torch

    for name, value in (("tokens", tokens), ("repeats", repeats), ("layers", layers),
                        ("kv_heads", kv_heads), ("head_dim", head_dim)):
        _positive(name, value)
    _positive("layer_compute_ms", float(layer_compute_ms), float)
    _positive("timeout_s", float(timeout_s), float)
    load_start = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stand-in on one core; the engines' copy threads on the other
    geometry = _Geometry(tokens, layers, kv_heads, head_dim)
    fresh = None
    try:
        matmul_n = _calibrate(layer_compute_ms)
        compute = _Compute(matmul_n)
        calibrated_ms = compute.median_ms()
        fresh = _fresh_kv(geometry)
        rows = _shm_rows(geometry, fresh, compute, repeats, timeout_s)
        rows += _mooncake_loopback_rows(geometry, fresh, compute, repeats, timeout_s)
        skipped = []
        if netns:
            config = {"tokens": tokens, "layers": layers, "kv_heads": kv_heads,
                      "head_dim": head_dim, "repeats": repeats, "timeout_s": timeout_s,
                      "matmul_n": matmul_n}
            netns_rows, reason = _netns_rows(config, run_timeout_s=max(300.0, 10 * timeout_s))
            rows += netns_rows
            if reason:
                skipped.append({"transport": "mooncake_netns", "reason": reason})
    finally:
        torch.set_num_threads(threads)
        if fresh is not None:
            fresh.close()
    return {
        "bench": "kv_move",
        "shape": {"model": "LLaMA-2-70B" if (layers, kv_heads, head_dim) == (80, 8, 128)
                  else "custom", "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                  "dtype": "bf16", "block_size": BLOCK_SIZE, "pool_order": "per_layer"},
        "tokens": tokens, "kv_bytes": geometry.kv_bytes, "blocks": geometry.num_blocks,
        "repeats": repeats,
        "compute_stand_in": {
            "what": "STAND-IN, not a model: per layer one bf16 torch.matmul of n x n by n x n "
                    "on one thread, then that layer's K and V written into the pool",
            "matmul_n": matmul_n, "target_layer_ms": layer_compute_ms,
            "calibrated_layer_ms": calibrated_ms, "torch_threads": 1},
        "rows": rows, "skipped": skipped,
        "machine": dict(_machine(), load_start=list(load_start), load_end=list(os.getloadavg())),
        "article_claims": ARTICLE_CLAIMS,
    }


def plot_kv_move(result: dict, path: str) -> None:
    """Two panels, one bar group per method: the move alone, and ready-after-compute (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transports = list(dict.fromkeys(r["transport"] for r in result["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(transports), 1)
    for ax, key, title in ((axes[0], "transfer_s", "the move alone"),
                           (axes[1], "ready_after_compute_s",
                            "end of compute → decode side has the KV")):
        for i, transport in enumerate(transports):
            rows = {r["method"]: r for r in result["rows"] if r["transport"] == transport}
            xs = [m + (i - (len(transports) - 1) / 2) * width for m in range(len(METHODS))]
            values = [rows[m][key] * 1e3 if rows.get(m) and rows[m][key] is not None else None
                      for m in METHODS]
            bars = ax.bar(xs, [max(v or 0.0, 1e-3) for v in values], width=width,
                          label=transport)
            for x, value, bar in zip(xs, values, bars, strict=True):
                if not value:  # not applicable, or nothing moved (zero copy): a label, no bar
                    ax.text(x, 1.2e-3, "n/a" if value is None else "0 (in place)",
                            ha="center", va="bottom", fontsize=7, rotation=90)
                    bar.set_alpha(0.0)
        ax.set_xticks(range(len(METHODS)), [m.replace("_", "\n", 1) for m in METHODS],
                      fontsize=8)
        ax.set(yscale="log", ylabel="ms (median, log)", title=title)
        ax.legend(fontsize=8)
    machine, stand_in = result["machine"], result["compute_stand_in"]
    save_figure(fig, path, (
        f"KV move of {result['tokens']} tokens ({result['kv_bytes'] / 2**20:.0f} MiB, "
        f"{result['shape']['model']} shape) — {machine['cpu_model'] or machine['processor']}, "
        f"{machine['usable_cores']} cores, load {machine['load_start'][0]:.1f}→"
        f"{machine['load_end'][0]:.1f}; compute stand-in "
        f"{stand_in['calibrated_layer_ms']:.1f} ms/layer"), fontsize=9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kthena_serve.bench.kv_move",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--netns", action="store_true",
                        help="add the mooncake_netns rows (two network namespaces; root)")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layer-compute-ms", type=float, default=2.0,
                        help="target time of the per-layer compute stand-in")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--plot", metavar="PATH", help="write the figure (PNG) here")
    parser.add_argument("--_decode-side", dest="decode_side", help=argparse.SUPPRESS)
    parser.add_argument("--_prefill-side", dest="prefill_side", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.decode_side:
        _decode_side_main(json.loads(opts.decode_side))
        return 0
    if opts.prefill_side:
        _prefill_side_main(json.loads(opts.prefill_side))
        return 0
    plot_path = plot_or_note("kv_move", opts.plot)  # before the runs
    result = bench_kv_move(opts.tokens, opts.repeats, opts.netns, layers=opts.layers,
                           kv_heads=opts.kv_heads, head_dim=opts.head_dim,
                           layer_compute_ms=opts.layer_compute_ms, timeout_s=opts.timeout_s)
    print(json.dumps(result), flush=True)
    if plot_path:
        draw("kv_move", lambda: plot_kv_move(result, plot_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
