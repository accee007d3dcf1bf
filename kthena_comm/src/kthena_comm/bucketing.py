"""Bucketed all-reduce: many small tensors, few collectives.

Launching one collective per small tensor pays the per-call latency each time. Here tensors are
packed in order into flat buckets of at most ``bucket_bytes`` (same dtype and device per bucket),
each bucket is reduced with one async all-reduce, and the results are copied back::

    tensors   a(4B) b(8B) c(4B) | d(16B)          bucket_bytes = 16
    buckets   [a b c] -> flat 16B   [d] -> flat 16B   (a tensor above the limit gets its own)

This is the source article's ``fused_communication``; PyTorch DDP's gradient buckets do the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kthena_comm.collectives import Handle, all_reduce
from kthena_comm.groups import CommGroup

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def plan_buckets(tensors: Sequence[torch.Tensor],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Group tensor indices into buckets, in order, by dtype/device and a byte limit.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        current, used = open_.get(key, ([], 0))
        if current and used + nbytes > bucket_bytes:
            current, used = [], 0
        if not current:
            buckets.append(current)
        current.append(i)
        open_[key] = (current, used + nbytes)
    return buckets


def bucketed_all_reduce(tensors: Sequence[torch.Tensor], group: CommGroup, op: str = "sum",
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        async_op: bool = False) -> list[torch.Tensor] | Handle[list[torch.Tensor]]:
    """All-reduce every tensor in place, one collective per bucket.

    Returns the same tensors (reduced), or a ``Handle`` whose ``wait()`` returns them.
    """
    pending = []
    for indices in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in indices]
        flat = torch.cat([t.reshape(-1) for t in members])
        pending.append((members, flat, all_reduce(flat, group, op, async_op=True)))

    def finish() -> list[torch.Tensor]:
        for members, flat, handle in pending:
            handle.wait()
            for t, part in zip(members, flat.split([m.numel() for m in members]), strict=True):
                t.copy_(part.view_as(t))
        return list(tensors)

    handle = Handle([], finish)
    return handle if async_op else handle.wait()
