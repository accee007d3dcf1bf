"""One rank of the bucketed vs unbucketed all-reduce benchmark (run by ``kthena_comm.bench``)."""

from __future__ import annotations

import json
import sys

import torch

from kthena_comm.bench import median_s
from kthena_comm.bucketing import bucketed_all_reduce
from kthena_comm.collectives import all_reduce
from kthena_comm.env import RankEnv
from kthena_comm.groups import init_parallel_groups
from kthena_core.layout import Layout


def main(repeat: int) -> None:
    torch.set_num_threads(1)
    env = RankEnv.from_env()
    groups = init_parallel_groups(Layout(tp=env.world_size), env)
    gen = torch.Generator().manual_seed(env.rank)
    tensors = [torch.randn(256, generator=gen) for _ in range(100)]  # 100 × 1 KiB

    def unbucketed() -> None:
        for t in tensors:
            all_reduce(t, groups.tp)

    def bucketed() -> None:
        bucketed_all_reduce(tensors, groups.tp, bucket_bytes=1 << 20)

    results = {name: median_s(fn, repeat * 4) for name, fn in
               (("unbucketed", unbucketed), ("bucketed", bucketed))}
    if env.rank == 0:
        print(json.dumps({"world_size": env.world_size, "num_tensors": 100, "tensor_bytes": 1024,
                          "unbucketed_s": results["unbucketed"], "bucketed_s": results["bucketed"],
                          "speedup": results["unbucketed"] / results["bucketed"]}), flush=True)
    groups.destroy()


if __name__ == "__main__":
    main(int(sys.argv[1]))
