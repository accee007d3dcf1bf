"""Collectives over a ``CommGroup``: sync, or async with a ``Handle`` to wait on.

Every function returns its result when ``async_op=False`` and a ``Handle`` whose ``wait()``
returns the same result when ``async_op=True``, so compute can run between launch and wait. On a
single-rank group every collective is a local no-op. The backend (gloo / nccl / hccl) is the
group's; nothing here branches on it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from kthena_comm.groups import CommGroup

T = TypeVar("T")

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "avg": dist.ReduceOp.SUM,
}
# avg is sum then divide: gloo has no native AVG on every torch version.

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle(Generic[T]):
    """An in-flight collective: ``wait()`` blocks until it is done and returns its result."""

    def __init__(self, works: list[Any], finish: Callable[[], T]) -> None:
        self._works = works
        self._finish = finish
        self._result: tuple[T] | None = None

    def is_completed(self) -> bool:
        return self._result is not None or all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: float | None = None) -> T:
        """Block until complete; returns the collective's result."""
        if self._result is None:
            for work in self._works:
                work.wait(timedelta(seconds=timeout_s)) if timeout_s else work.wait()
            self._result = (self._finish(),)
        return self._result[0]


def _reduce_op(op: str) -> Any:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; allowed: {', '.join(_OPS)}") from None


def _launch(
    group: CommGroup, start: Callable[[], Any], finish: Callable[[], T], async_op: bool
) -> T | Handle[T]:
    works = [] if group.size == 1 else [start()]
    handle = Handle([w for w in works if w is not None], finish)
    return handle if async_op else handle.wait()


def all_reduce(
    tensor: torch.Tensor, group: CommGroup, op: str = "sum", async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``tensor`` in place across ``group`` (ops: sum, avg, max, min, product)."""
    reduce_op = _reduce_op(op)

    def finish() -> torch.Tensor:
        return tensor.div_(group.size) if op == "avg" else tensor

    return _launch(
        group,
        lambda: dist.all_reduce(tensor, reduce_op, group.process_group, async_op=True),
        finish,
        async_op,
    )


def all_gather(
    tensor: torch.Tensor, group: CommGroup, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Concatenate every rank's ``tensor`` along dim 0, in group-rank order."""
    out = (
        torch.empty(
            (group.size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        if group.size > 1
        else tensor.clone()
    )
    return _launch(
        group,
        lambda: _all_gather_single(out, tensor.contiguous(), group.process_group, True),
        lambda: out,
        async_op,
    )


def reduce_scatter(
    tensor: torch.Tensor, group: CommGroup, op: str = "sum", async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``tensor`` across ranks; rank i keeps the i-th of ``group.size`` dim-0 chunks."""
    if tensor.shape[0] % group.size:
        raise ValueError(
            f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the "
            f"group size ({group.size}); pad the input"
        )
    reduce_op = _reduce_op(op)
    out = (
        torch.empty(
            (tensor.shape[0] // group.size, *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        if group.size > 1
        else tensor.clone()
    )

    def finish() -> torch.Tensor:
        return out.div_(group.size) if op == "avg" else out

    return _launch(
        group,
        lambda: _reduce_scatter_single(
            out, tensor.contiguous(), reduce_op, group.process_group, True
        ),
        finish,
        async_op,
    )


def all_to_all(
    tensor: torch.Tensor,
    group: CommGroup,
    input_splits: list[int] | None = None,
    output_splits: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Send dim-0 chunk i of ``tensor`` to group rank i; receive theirs, concatenated.

    Even split when both split lists are ``None``. With only ``input_splits`` the output sizes
    are exchanged first (one small synchronous all-to-all), as uneven sequence parallelism needs.
    """
    if input_splits is not None and output_splits is None:
        output_splits = exchange_splits(input_splits, group)
    if output_splits is None:
        rows = tensor.shape[0]
    else:
        rows = sum(output_splits)
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if group.size == 1:
        out.copy_(tensor)
    return _launch(
        group,
        lambda: dist.all_to_all_single(
            out,
            tensor.contiguous(),
            output_splits,
            input_splits,
            group.process_group,
            async_op=True,
        ),
        lambda: out,
        async_op,
    )


def exchange_splits(input_splits: list[int], group: CommGroup) -> list[int]:
    """Tell every rank how many rows it will receive from each peer."""
    if len(input_splits) != group.size:
        raise ValueError(
            f"input_splits has {len(input_splits)} entries; the group has "
            f"{group.size} ranks, one entry per rank is required"
        )
    if group.size == 1:
        return list(input_splits)
    counts = torch.tensor(input_splits, dtype=torch.int64)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group.process_group)
    return received.tolist()


def broadcast(
    tensor: torch.Tensor, group: CommGroup, src: int, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Copy global rank ``src``'s ``tensor`` into every member's ``tensor`` (in place)."""
    _require_member(group, src, "src")
    return _launch(
        group,
        lambda: dist.broadcast(tensor, src, group.process_group, async_op=True),
        lambda: tensor,
        async_op,
    )


def send(
    tensor: torch.Tensor, group: CommGroup, dst: int, async_op: bool = False
) -> None | Handle[None]:
    """Send ``tensor`` to global rank ``dst`` (must be another member of ``group``)."""
    _require_peer(group, dst, "dst")
    return _launch(
        group,
        lambda: dist.isend(tensor.contiguous(), dst, group.process_group),
        lambda: None,
        async_op,
    )


def recv(
    tensor: torch.Tensor, group: CommGroup, src: int, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Receive into ``tensor`` from global rank ``src``."""
    _require_peer(group, src, "src")
    return _launch(
        group, lambda: dist.irecv(tensor, src, group.process_group), lambda: tensor, async_op
    )


def barrier(group: CommGroup, async_op: bool = False) -> None | Handle[None]:
    """Wait until every member reaches the barrier."""
    return _launch(
        group, lambda: dist.barrier(group.process_group, async_op=True), lambda: None, async_op
    )


def _require_member(group: CommGroup, rank: int, name: str) -> None:
    if rank not in group.ranks:
        raise ValueError(
            f"{name}={rank} is not in the {group.kind} group {list(group.ranks)}; "
            "pass a global rank that is a member"
        )


def _require_peer(group: CommGroup, rank: int, name: str) -> None:
    _require_member(group, rank, name)
    if rank == group.rank:
        raise ValueError(
            f"{name}={rank} is this rank; send/recv need another member of {list(group.ranks)}"
        )
