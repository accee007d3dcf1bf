"""What the MoE paths share below the dispatch table: the weighted sum of expert rows back
into tokens, and the byte counts of an EP dispatch and combine. A backend (`backends.moe_a2a`)
imports these without importing the public ops modules, which import the dispatch table.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["ID_BYTES", "SPLIT_BYTES", "Traffic", "traffic", "weighted_sum"]

ID_BYTES = 4  # a dispatched row's expert id travels as int32
SPLIT_BYTES = 8  # a split size (exchange_splits: int64)


@attrs.frozen
class Traffic:
    """The bytes one rank's dispatch and combine all-to-alls carry, per group rank.

    Entry i is what goes to (``*_sent``) or comes from (``*_received``) group rank i, payload
    and metadata together; this rank's own entry is a local copy, counted as the rest.
    """

    rank: int
    dispatch_sent: tuple[int, ...]
    dispatch_received: tuple[int, ...]
    combine_sent: tuple[int, ...]
    combine_received: tuple[int, ...]

    def off_rank(self) -> dict[str, int]:
        """Each direction's total over the other ranks (what crosses the wire)."""
        return {name: sum(v for i, v in enumerate(getattr(self, name)) if i != self.rank)
                for name in ("dispatch_sent", "dispatch_received", "combine_sent",
                             "combine_received")}


def traffic(rank: int, send_splits: list[int], recv_splits: list[int], row_bytes: int,
            dispatch_meta: tuple[int, int]) -> Traffic:
    """`Traffic` of a dispatch of ``send_splits`` rows out and ``recv_splits`` in (rows of
    ``row_bytes``), each peer's dispatch carrying ``dispatch_meta`` = (bytes per peer, bytes
    per row) of metadata; combine sends each row back without metadata."""
    per_peer, per_row = dispatch_meta
    return Traffic(rank,
                   tuple(per_peer + n * (row_bytes + per_row) for n in send_splits),
                   tuple(per_peer + n * (row_bytes + per_row) for n in recv_splits),
                   tuple(n * row_bytes for n in recv_splits),
                   tuple(n * row_bytes for n in send_splits))


def weighted_sum(out_rows: torch.Tensor, weights: torch.Tensor, pair_of: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """``out[t] = sum of weights.flat[pair_of[i]] * out_rows[i]`` over the rows i whose pair
    (``pair_of[i] = token * top_k + slot``) is token t's: [T, H] float32, one ``index_add``
    in row order."""
    scale = weights.reshape(-1).index_select(0, pair_of).float().unsqueeze(1)
    out = torch.zeros(num_tokens, out_rows.shape[1], dtype=torch.float32,
                      device=out_rows.device)
    return out.index_add_(0, pair_of // weights.shape[1], out_rows.float() * scale)
