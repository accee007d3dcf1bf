"""Benchmark: ``python -m kthena_comm.bench`` prints one JSON line per case.

Cases: the machine; in-process memcpy at each size (the reference, measured in the same run);
put / get, sync / async, contiguous / KV-block batches for every available transfer backend,
each run paired with a memcpy of the same size right after it (``vs_memcpy`` is a same-run ratio);
per-range vs batched submission of 1,000 block ranges (as a list of ``TransferOp`` and as one
columnar ``TransferBatch``, next to a memmove of the same bytes: the floor of any batch); shm zero-copy handoff cost per size; and
bucketed vs unbucketed all-reduce of 100 small tensors over 2 gloo ranks. Fixed seeds, one
warm-up, medians of ``--repeat`` runs. A/B switch: ``--backends`` picks what to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from kthena_comm.transfer import (
    LocalConfig,
    LocalFabric,
    MemoryHandle,
    ShmConfig,
    TorchConfig,
    TransferBatch,
    TransferOp,
    available_backends,
    create_engine,
)
from kthena_core.discovery.host_probe import sample_times
from kthena_core.ports import free_port

MIB = 1 << 20
BLOCK_BYTES = 64 * 1024  # a KV block of a small model: 16 tokens × all layers of one rank
SMALL_RANGE = 4096  # a per-token-sized range for the submission comparison


def emit(case: str, **fields: object) -> None:
    print(json.dumps({"case": case, **fields, "load_avg": os.getloadavg()[0]}), flush=True)


def median_s(fn: Callable[[], object], repeat: int) -> float:
    """Median wall seconds of ``repeat`` calls of ``fn`` after one warm-up call."""
    return statistics.median(sample_times(fn, repeat))


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "kernel": platform.release()}


def filled(nbytes: int, seed: int) -> mmap.mmap:
    memory = mmap.mmap(-1, nbytes)
    memory.write(os.urandom(min(nbytes, MIB)) * max(1, nbytes // MIB))  # touches every page
    return memory


def bench_memcpy(sizes: list[int], repeat: int) -> dict[int, float]:
    src, dst = filled(max(sizes), 1), filled(max(sizes), 2)
    a = ctypes.addressof(ctypes.c_char.from_buffer(src))
    b = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    rates = {}
    for size in sizes:
        t = median_s(lambda n=size: ctypes.memmove(b, a, n), repeat)
        rates[size] = size / t / 1e9
        emit("memcpy", bytes=size, median_s=t, gbps=rates[size])
    src.close()
    dst.close()
    return rates


class Remote:
    """Memory in another process (shm, mooncake) or on an in-process fabric (local)."""

    def __init__(self, backend: str, nbytes: int) -> None:
        self.proc = None
        if backend == "local":
            fabric = LocalFabric()
            self.owner = create_engine("local", LocalConfig(fabric))
            self.memory = filled(nbytes, 3)
            self.handle = self.owner.register(self.memory)
            self.engine = create_engine("local", LocalConfig(fabric))
            return
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "kthena_comm.bench", "--serve",
                                      backend, str(nbytes), str(port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1",
                                              OMP_WAIT_POLICY="PASSIVE"))
        self.engine = create_engine(backend, _config(backend, 0, port))  # torch: rendezvous first
        self.handle = MemoryHandle.from_json(self.proc.stdout.readline())

    def close(self) -> None:
        self.engine.close()
        if self.proc is None:
            self.owner.close()
            return
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _config(backend: str, rank: int, port: int) -> object:
    if backend == "torch":
        return TorchConfig(rank=rank, world_size=2, master_port=port, timeout_s=60)
    return ShmConfig(prefix="kthena-bench") if backend == "shm" else None


def serve(backend: str, nbytes: int, port: int) -> None:
    """Peer side: register ``nbytes``, print the handle, wait for stdin to close."""
    engine = create_engine(backend, _config(backend, 1, port))
    if backend == "shm":
        handle = engine.allocate(nbytes)
        engine.buffer(handle)[:] = b"\1" * nbytes
    else:
        memory = filled(nbytes, 4)
        handle = engine.register(memory)
    print(handle.to_json(), flush=True)
    sys.stdin.read()
    engine.close()


def bench_backend(backend: str, sizes: list[int], repeat: int, memcpy: dict[int, float]) -> None:
    remote = Remote(backend, max(sizes))
    engine = remote.engine
    local = engine.register(filled(max(sizes), 5))
    ref_src, ref_dst = filled(max(sizes), 8), filled(max(sizes), 9)
    ref_a = ctypes.addressof(ctypes.c_char.from_buffer(ref_src))
    ref_b = ctypes.addressof(ctypes.c_char.from_buffer(ref_dst))
    for size in sizes:
        contiguous = [TransferOp(local, 0, remote.handle, 0, size)]
        blocks = block_ops(local, remote.handle, size)
        for layout, ops in (("contiguous", contiguous), ("blocks", blocks)):
            for op, mode, fn in transfer_calls(engine, ops):
                t, ref = paired_median_s(fn, lambda n=size: ctypes.memmove(ref_b, ref_a, n),
                                         repeat)
                emit("transfer", backend=backend, op=op, mode=mode, layout=layout, bytes=size,
                     num_ranges=len(ops), median_s=t, gbps=size / t / 1e9,
                     memcpy_gbps=size / ref / 1e9, vs_memcpy=ref / t)
    bench_submission(backend, engine, local, remote.handle, repeat)
    remote.close()
    ref_src.close()
    ref_dst.close()


def paired_median_s(fn: Callable[[], object], ref: Callable[[], object],
                    repeat: int) -> tuple[float, float]:
    """Medians of ``fn`` and of a reference run right after each ``fn`` run (same-run ratio:
    load changes on a shared machine hit both alike)."""
    fn()
    ref()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        middle = time.perf_counter()
        ref()
        times[0].append(middle - start)
        times[1].append(time.perf_counter() - middle)
    return statistics.median(times[0]), statistics.median(times[1])


def block_ops(local: MemoryHandle, remote: MemoryHandle, size: int) -> list[TransferOp]:
    """``size`` bytes as KV-block ranges, scattered (reversed order) on the remote side."""
    n = max(1, size // BLOCK_BYTES)
    return [TransferOp(local, i * BLOCK_BYTES, remote, (n - 1 - i) * BLOCK_BYTES, BLOCK_BYTES)
            for i in range(n)]


def transfer_calls(engine, ops):
    yield "put", "sync", lambda: engine.batch_put(ops)
    yield "get", "sync", lambda: engine.batch_get(ops)
    yield "put", "async", lambda: engine.batch_put_async(ops).wait()
    yield "get", "async", lambda: engine.batch_get_async(ops).wait()


def bench_submission(backend, engine, local, remote, repeat) -> None:
    """1,000 ranges of 4 KiB: one call per range vs one batch (op list / columnar)."""
    ops = [TransferOp(local, i * SMALL_RANGE, remote, i * SMALL_RANGE, SMALL_RANGE)
           for i in range(1000)]
    ids = list(range(1000))
    columnar = TransferBatch.from_blocks(local, remote, ids, ids, SMALL_RANGE)
    floor = _memmove_s(len(ops) * SMALL_RANGE, repeat)

    def per_range() -> None:
        for op in ops:
            engine.batch_put([op])

    # Interleave the three so load changes on a shared machine hit them alike.
    times: dict[str, list[float]] = {"batched": [], "columnar": [], "per_range": []}
    for _ in range(max(3, repeat)):
        times["batched"].append(median_s(lambda: engine.batch_put(ops), 3))
        times["columnar"].append(median_s(lambda: engine.batch_put(columnar), 3))
        times["per_range"].append(median_s(per_range, 1))
    t = {k: statistics.median(v) for k, v in times.items()}
    emit("submission", backend=backend, num_ranges=len(ops), range_bytes=SMALL_RANGE,
         batched_s=t["batched"], columnar_s=t["columnar"], per_range_s=t["per_range"],
         memmove_same_bytes_s=floor, speedup=t["per_range"] / t["batched"],
         speedup_columnar=t["per_range"] / t["columnar"])


def _memmove_s(nbytes: int, repeat: int) -> float:
    src, dst = filled(nbytes, 6), filled(nbytes, 7)
    a = ctypes.addressof(ctypes.c_char.from_buffer(src))
    b = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    t = median_s(lambda: ctypes.memmove(b, a, nbytes), 4 * repeat)
    src.close()
    dst.close()
    return t


def bench_zero_copy(sizes: list[int], repeat: int) -> None:
    """Cost for a producer to get a writable tensor on a peer's fresh shm pool, per size.

    It maps the pages and writes one byte; no byte of the pool is copied, so it should not grow
    with the pool size.
    """
    import torch

    owner = create_engine("shm", ShmConfig(prefix="kthena-bench"))
    producer = create_engine("shm", ShmConfig(prefix="kthena-bench"))
    for size in sizes:
        handles = iter([owner.allocate(size) for _ in range(repeat + 1)])

        def handoff(handles=handles) -> None:
            view = torch.frombuffer(producer.buffer(next(handles)), dtype=torch.uint8)
            view[0] = 1

        emit("zero_copy_handoff", backend="shm", bytes=size, median_s=median_s(handoff, repeat))
    producer.close()
    owner.close()


def bench_allreduce(repeat: int) -> None:
    from kthena_comm.groups import GroupConfig  # noqa: F401  (fail early without torch)

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "kthena_comm._bench_allreduce", str(repeat)],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=str(port),
                                       MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1"))
             for r in range(2)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    for line in out[0].splitlines():
        emit("allreduce", **json.loads(line))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kthena_comm.bench", description=__doc__)
    parser.add_argument("--sizes-mib", default="1,16,64,256")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backends", default=",".join(available_backends()))
    parser.add_argument("--serve", nargs=3, metavar=("BACKEND", "NBYTES", "PORT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve[0], int(args.serve[1]), int(args.serve[2]))
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every batch at INFO
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    emit("machine", **machine(), sizes_mib=args.sizes_mib, repeat=args.repeat)
    for backend in args.backends.split(","):
        memcpy = bench_memcpy(sizes, 2 * args.repeat)  # re-measured next to each backend
        bench_backend(backend, sizes, args.repeat, memcpy)
    bench_zero_copy(sizes, args.repeat)
    bench_allreduce(args.repeat)


if __name__ == "__main__":
    main()
