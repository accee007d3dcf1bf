"""One rank of the MC2 check or benchmark over gloo; `launch` runs a world of them.

    python -m mooncake_ops._mc2_worker {check|bench} RANK WORLD_SIZE PORT

``check`` compares every MC2 op (tile counts, dtypes, bias, 3-D input, each way of naming the
group) with one matmul + one collective and prints ``{"rank": r, "failures": [...]}``;
``bench`` times tiled vs unfused and prints one JSON line per case from rank 0.
"""

from __future__ import annotations

import os

# Two ranks share two cores: one intra-op thread each, no OpenMP spinning (before torch loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mooncake_ops import mc2  # noqa: E402
from mooncake_ops.backends import mc2_tiled  # noqa: E402
from mooncake_ops.errors import OpsShapeError  # noqa: E402

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 2e-2)}


def _inputs(rank: int, dtype: torch.dtype, shape_x, shape_w, shared_w: bool):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(*shape_x, generator=gen).to(dtype)
    w_gen = torch.Generator().manual_seed(7) if shared_w else gen
    return x, torch.randn(*shape_w, generator=w_gen).to(dtype)


def check(rank: int, world: int) -> list[str]:
    failures = []
    comm = mc2.resolve_group(None)
    groups = {"none": None, "commgroup": comm, "process_group": dist.group.WORLD}
    for dtype in (torch.float32, torch.bfloat16):
        for tiles in (1, 3, 4):
            for gname, group in groups.items():
                failures += _check_ops(rank, world, dtype, tiles, group, comm, f"{dtype} t{tiles} {gname}")
    try:
        mc2.matmul_reduce_scatter(torch.zeros(2 * world + 1, 4), torch.zeros(4, 4))
        failures.append("reduce_scatter accepted rows not divisible by the world")
    except OpsShapeError:
        pass
    return failures


def _check_ops(rank, world, dtype, tiles, group, comm, label) -> list[str]:
    failures = []
    bias = torch.randn(24, generator=torch.Generator().manual_seed(3)).to(dtype)
    x, w = _inputs(rank, dtype, (2, 5, 32), (32, 24), shared_w=False)
    cases = [
        ("matmul_all_reduce",
         mc2.matmul_all_reduce(x, w, group, num_tiles=tiles, bias=bias),
         mc2_tiled.unfused_matmul_all_reduce(x.reshape(-1, 32), w, comm, bias).view(2, 5, 24)),
    ]
    x, w = _inputs(rank, dtype, (6, 32), (32, 24), shared_w=True)
    out, gathered = mc2.all_gather_matmul(x, w, group, num_tiles=tiles, bias=bias,
                                          return_gathered=True)
    cases += [("all_gather_matmul", out, mc2_tiled.unfused_all_gather_matmul(x, w, comm, bias)),
              ("all_gather_matmul.gathered", gathered, mc2_tiled.unfused_all_gather_matmul(
                  x, torch.eye(32, dtype=dtype), comm))]
    x, w = _inputs(rank, dtype, (4 * world, 32), (32, 24), shared_w=False)
    cases.append(("matmul_reduce_scatter",
                  mc2.matmul_reduce_scatter(x, w, group, num_tiles=tiles, bias=bias),
                  mc2_tiled.unfused_matmul_reduce_scatter(x, w, comm, bias)))
    atol, rtol = TOL[dtype]
    for name, got, expected in cases:
        if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), atol=atol, rtol=rtol):
            err = (got.float() - expected.float()).abs().max().item() if got.shape == expected.shape else "shape"
            failures.append(f"{label} {name}: {tuple(got.shape)} vs {tuple(expected.shape)}, max err {err}")
    return failures


def _time(fn, repeats: int) -> float:
    fn()
    dist.barrier()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench(rank: int, world: int, repeats: int) -> list[dict]:
    comm = mc2.resolve_group(None)
    rows = []
    for m, k, n in ((256, 1024, 2048), (1024, 512, 4096)):
        x, w = _inputs(rank, torch.float32, (m, k), (k, n), shared_w=False)
        y = x @ w
        compute = _time(lambda: x @ w, repeats)  # noqa: B023
        comm_only = _time(lambda: mc2_tiled.coll.all_reduce(y.clone(), comm), repeats)  # noqa: B023
        unfused = _time(lambda: mc2_tiled.unfused_matmul_all_reduce(x, w, comm), repeats)  # noqa: B023
        for tiles in (2, 4, 8):
            tiled = _time(lambda: mc2.matmul_all_reduce(x, w, num_tiles=tiles), repeats)  # noqa: B023
            hidden = max(0.0, unfused - tiled)
            rows.append({"bench": "mc2", "op": "matmul_all_reduce", "m": m, "k": k, "n": n,
                         "world": world, "num_tiles": tiles, "compute_ms": compute * 1e3,
                         "comm_ms": comm_only * 1e3, "unfused_ms": unfused * 1e3,
                         "tiled_ms": tiled * 1e3, "speedup": unfused / tiled,
                         "overlap_ratio": hidden / min(compute, comm_only)})
    return rows


def main() -> None:
    mode, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        if mode == "check":
            print(json.dumps({"rank": rank, "failures": check(rank, world)}), flush=True)
        else:
            rows = bench(rank, world, int(os.environ.get("MC2_BENCH_REPEATS", "10")))
            if rank == 0:
                for row in rows:
                    print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def launch(mode: str, world: int = 2, timeout_s: float = 120.0,
           extra_env: dict[str, str] | None = None) -> list[str]:
    """Run ``world`` ranks of this module on 127.0.0.1; returns each rank's stdout.

    Raises:
        TimeoutError: a rank ran past ``timeout_s`` (all ranks are killed first).
        RuntimeError: a rank exited non-zero (its stderr is in the message).
    """
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", **(extra_env or {}))
    procs = [subprocess.Popen([sys.executable, "-m", "mooncake_ops._mc2_worker", mode, str(r),
                               str(world), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"MC2 {mode} ranks ran past {timeout_s}s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode:
            raise RuntimeError(f"MC2 {mode} rank {rank} exited {p.returncode}: {err[-2000:]}")
    return [out for out, _ in outputs]


if __name__ == "__main__":
    main()
