"""One gloo rank for the collective tests (run by path; env: RANK, WORLD_SIZE, MASTER_*).

Usage: python _rank_worker.py SCENARIO   (collectives | groups)

Each rank regenerates every rank's seeded input, so it can check its own result against a
single-process reference. Exits non-zero with a traceback on any mismatch; prints one JSON line.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from kthena_comm import collectives as C  # noqa: E402
from kthena_comm.bucketing import bucketed_all_reduce  # noqa: E402
from kthena_comm.env import RankEnv  # noqa: E402
from kthena_comm.groups import GroupConfig, init_parallel_groups  # noqa: E402
from kthena_core.layout import Layout  # noqa: E402

torch.set_num_threads(1)


def data(rank: int, rows: int = 8, salt: int = 0) -> torch.Tensor:
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(1000 * salt + rank))


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.allclose(got, want, atol=1e-5):
        raise AssertionError(f"{name}: got {got} want {want}")


def reductions(g, world: int, rank: int) -> None:
    for async_op in (False, True):
        everyone = [data(r) for r in range(world)]
        out = C.all_reduce(data(rank), g, "sum", async_op=async_op)
        check("all_reduce", out.wait() if async_op else out, sum(everyone))
        out = C.all_reduce(data(rank), g, "avg", async_op=async_op)
        check("all_reduce avg", out.wait() if async_op else out, sum(everyone) / world)
        out = C.all_reduce(data(rank), g, "max", async_op=async_op)
        check("all_reduce max", out.wait() if async_op else out, torch.stack(everyone).amax(0))
        out = C.reduce_scatter(data(rank, 4 * world), g, async_op=async_op)
        full = sum(data(r, 4 * world) for r in range(world))
        check("reduce_scatter", out.wait() if async_op else out, full[4 * rank: 4 * rank + 4])


def movement(g, world: int, rank: int) -> None:
    for async_op in (False, True):
        out = C.all_gather(data(rank), g, async_op=async_op)
        check("all_gather", out.wait() if async_op else out, torch.cat([data(r) for r in range(world)]))
        out = C.all_to_all(data(rank, 2 * world), g, async_op=async_op)
        want = torch.cat([data(r, 2 * world)[2 * rank: 2 * rank + 2] for r in range(world)])
        check("all_to_all even", out.wait() if async_op else out, want)
        out = C.broadcast(data(rank), g, src=world - 1, async_op=async_op)
        check("broadcast", out.wait() if async_op else out, data(world - 1))
    uneven(g, world, rank)
    ring(g, world, rank)
    C.barrier(g)
    C.barrier(g, async_op=True).wait()


def splits(r: int, world: int) -> list[int]:
    """Rows rank r sends to each peer: uneven, some zero."""
    return [(r + d) % 3 for d in range(world)]


def uneven(g, world: int, rank: int) -> None:
    mine = data(rank, sum(splits(rank, world)), salt=5)
    out = C.all_to_all(mine, g, input_splits=splits(rank, world))
    parts = []
    for r in range(world):
        offsets = [0] + list(torch.tensor(splits(r, world)).cumsum(0).tolist())
        parts.append(data(r, sum(splits(r, world)), salt=5)[offsets[rank]: offsets[rank + 1]])
    check("all_to_all uneven", out, torch.cat(parts))


def ring(g, world: int, rank: int) -> None:
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty(8, 3)
    send = C.send(data(rank), g, dst=nxt, async_op=True)
    C.recv(buf, g, src=prev)
    send.wait()
    check("send/recv", buf, data(prev))


def bucketed(g, world: int, rank: int) -> None:
    shapes = [(i % 7 + 1, 3) for i in range(100)]
    mine = [torch.randn(s, generator=torch.Generator().manual_seed(rank * 1000 + i))
            for i, s in enumerate(shapes)]
    plain = [t.clone() for t in mine]
    for t in plain:
        C.all_reduce(t, g)
    for bucket_bytes in (256, 4096, 1 << 20):
        fused = [t.clone() for t in mine]
        bucketed_all_reduce(fused, g, bucket_bytes=bucket_bytes, async_op=True).wait()
        for a, b in zip(fused, plain, strict=True):
            check(f"bucketed {bucket_bytes}", a, b)


def scenario_collectives(env: RankEnv) -> dict:
    groups = init_parallel_groups(Layout(tp=env.world_size), env, GroupConfig(timeout_s=60))
    g = groups.tp
    reductions(g, env.world_size, g.group_rank)
    movement(g, env.world_size, g.group_rank)
    bucketed(g, env.world_size, g.group_rank)
    groups.destroy()
    return {"backend": groups.backend}


def scenario_groups(env: RankEnv) -> dict:
    groups = init_parallel_groups(Layout(tp=2, dp=2, sp=2), env)
    result = {kind: list(getattr(groups, kind).ranks) for kind in ("tp", "pp", "dp", "sp")}
    # A reduction over a group must sum exactly its members' values.
    for kind in ("tp", "dp"):
        g = getattr(groups, kind)
        out = C.all_reduce(torch.tensor([float(env.rank)]), g)
        result[f"{kind}_sum"] = out.item()
    groups.destroy()
    return result


if __name__ == "__main__":
    rank_env = RankEnv.from_env()
    outcome = {"scenario_collectives": scenario_collectives,
               "scenario_groups": scenario_groups}[f"scenario_{sys.argv[1]}"](rank_env)
    print(json.dumps({"rank": rank_env.rank, **outcome}), flush=True)
