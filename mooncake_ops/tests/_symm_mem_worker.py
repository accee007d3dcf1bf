"""One gloo rank of test_mc2_symm_mem.py: the cuda MC2 path's calls, run on CPU tensors.

    python _symm_mem_worker.py RANK PORT

`backends/mc2_symm_mem.py` calls ``torch.ops.symm_mem.fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter``, which torch implements for CUDA only. Here torch's own
fallbacks of those two ops (``_fused_*_fallback``: the unfused definition over funcol
collectives, what torch's test mode runs) are registered as their CPU kernels, so the backend
runs unchanged over gloo: its arguments (order, ``gather_dim``, ``group_name``, ``return_A``),
``enable_symm_mem_for_group`` and its unpacking of the results meet torch's op schemas. The
fused CUDA kernels themselves are not run. Prints one JSON line: each case's largest difference
from the tiled op's unfused reference.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    rank, port = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        import torch.distributed._symmetric_memory as symm_mem

        lib = torch.library.Library("symm_mem", "IMPL")
        lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
        lib.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback,
                 "CPU")
        from kthena_comm.groups import CommGroup
        from kthena_comm.layout import Rank
        from mooncake_ops.backends import mc2_symm_mem as sm
        from mooncake_ops.backends import mc2_tiled as ref

        comm = CommGroup("tp", (Rank(0), Rank(1)), Rank(rank), dist.group.WORLD)
        g = torch.Generator().manual_seed(7 + rank)
        diffs = {}
        for m, k, n in ((1, 8, 6), (5, 16, 24), (12, 32, 8)):
            x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            bias = torch.randn(n, generator=g)
            out, gathered = sm.all_gather_matmul(x, w, comm, 1, bias, None, True)
            diffs[f"all_gather_matmul/{m}x{k}x{n}"] = [
                float((out - ref.unfused_all_gather_matmul(x, w, comm, bias)).abs().max()),
                float((gathered - ref.coll.all_gather(x, comm)).abs().max())]
            rows = torch.randn(2 * m, k, generator=g)
            got = sm.matmul_reduce_scatter(rows, w, comm, 1)
            diffs[f"matmul_reduce_scatter/{m}x{k}x{n}"] = [
                float((got - ref.unfused_matmul_reduce_scatter(rows, w, comm)).abs().max())]
        print(json.dumps({"rank": rank, "diffs": diffs}), flush=True)
        # both ranks done before either tears gloo down: a peer closing its connections while
        # the other still finishes aborted that rank once (SIGABRT after its result was out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
