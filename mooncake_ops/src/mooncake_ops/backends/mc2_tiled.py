"""MC2 on any torch.distributed backend: the matmul cut into row tiles, each tile's collective
launched asynchronously (kthena_comm) so it runs while the next tile is multiplied.

    matmul_all_reduce       mm0 | mm1 | mm2 | mm3           then wait all
                                 ar0 | ar1 | ar2 | ar3
    all_gather_matmul       ag0 | ag1 | ag2 | ag3           (all launched first)
                                 mm0 | mm1 | mm2 | mm3     (tile i once its gather is in)
    matmul_reduce_scatter   like matmul_all_reduce, with reduce-scatter per tile

Row bookkeeping for the gather / scatter forms (W ranks, m rows per rank, tile = rows a..b):

    gathered x  = [ rank0 rows 0..m-1 | rank1 rows 0..m-1 | ... ]  viewed [W, m, K]
    tile a..b   = x_all[:, a:b]  -> out[:, a:b] = tile @ w          (out viewed [W, m, N])

The unfused forms (one matmul, one collective) are what the tests compare against.
"""

from __future__ import annotations

import torch

from kthena_comm import collectives as coll


def tiles(num_rows: int, num_tiles: int) -> list[tuple[int, int]]:
    """Near-equal row ranges; never more tiles than rows, at least one."""
    k = max(1, min(num_tiles, num_rows))
    cuts = [num_rows * i // k for i in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def matmul_all_reduce(x, w, comm, num_tiles, bias=None, timeout_s=None):
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.result_type(x, w), device=x.device)
    handles = []
    for a, b in tiles(x.shape[0], num_tiles):
        torch.matmul(x[a:b], w, out=out[a:b])
        handles.append(coll.all_reduce(out[a:b], comm, async_op=True))
    for h in handles:
        h.wait(timeout_s)
    return out if bias is None else out.add_(bias)


def all_gather_matmul(x, w, comm, num_tiles, bias=None, timeout_s=None,
                      return_gathered=False):
    m, world = x.shape[0], comm.size
    spans = tiles(m, num_tiles)
    handles = [coll.all_gather(x[a:b].contiguous(), comm, async_op=True) for a, b in spans]
    out = torch.empty(world, m, w.shape[1], dtype=torch.result_type(x, w), device=x.device)
    gathered = torch.empty(world, m, x.shape[1], dtype=x.dtype, device=x.device) \
        if return_gathered else None
    for (a, b), h in zip(spans, handles, strict=True):
        part = h.wait(timeout_s).view(world, b - a, x.shape[1])
        out[:, a:b] = torch.matmul(part, w)
        if gathered is not None:
            gathered[:, a:b] = part
    out = out.view(world * m, -1)
    out = out if bias is None else out.add_(bias)
    return (out, gathered.view(world * m, -1)) if return_gathered else out


def matmul_reduce_scatter(x, w, comm, num_tiles, bias=None, timeout_s=None):
    world = comm.size
    m = x.shape[0] // world
    rows = x.view(world, m, x.shape[1])
    out = torch.empty(m, w.shape[1], dtype=torch.result_type(x, w), device=x.device)
    pending = []
    for a, b in tiles(m, num_tiles):
        part = torch.matmul(rows[:, a:b], w).view(world * (b - a), -1)
        pending.append((a, b, coll.reduce_scatter(part, comm, async_op=True)))
    for a, b, h in pending:
        out[a:b] = h.wait(timeout_s)
    return out if bias is None else out.add_(bias)


# ---- unfused references ---------------------------------------------------------------------
def unfused_matmul_all_reduce(x, w, comm, bias=None):
    y = coll.all_reduce(x @ w, comm)
    return y if bias is None else y + bias


def unfused_all_gather_matmul(x, w, comm, bias=None):
    y = coll.all_gather(x.contiguous(), comm) @ w
    return y if bias is None else y + bias


def unfused_matmul_reduce_scatter(x, w, comm, bias=None):
    y = coll.reduce_scatter(x @ w, comm)
    return y if bias is None else y + bias
