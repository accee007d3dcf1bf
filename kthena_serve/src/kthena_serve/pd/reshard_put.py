"""PD between TP instances across hosts: each prefill rank's KV heads put over Mooncake into
the decode ranks that own them, re-sharded by the same rule as on one host (pd/reshard.py).

The decode worker registers every rank's pool with its Mooncake engine (rank 0's is its own
process's; it maps the others' /dev/shm files) and names them in its ``PoolRef``
(``rank_mooncake_handles``, rank 0's first). The prefill worker registers each of its own
rank pools with its engine (``RankPutter``) and, once the prompt's last forward has run, puts
what the decode worker lacks (``ReshardPut``, a ``BlockPush``)::

    for each move of kv_head_moves(kv_heads, prefill tp, decode tp)
        prefill rank p's pool ──put──▶ decode rank d's pool     (one PushSession)
            each block pair, layer and part (K, V; int8 scales; MLA's one latent):
            heads [src_start, +count) of every token ─▶ heads [dst_start, +count)

A move of every head on both sides (TP2 -> TP2) is whole units, whose ranges coalesce over
consecutive blocks; a slice of a unit's heads is one range per token (``KVLayout
.head_pair_ranges``). Every session is submitted before any is waited for, and ``finish``
returns once each has completed or failed or its deadline has passed; ``settled`` is true only
when no put of any session can still land. Until then the prefill worker answers that the
request is still writing, and the decode worker keeps its blocks quarantined, as for tp=1
(transfer.py). Not layer-wise: the layers ran in the ranks' processes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kthena_comm.transfer import MemoryHandle, TransferEngine
from kthena_core.shape import HeadMove, kv_head_moves
from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.protocol import PoolRef
from kthena_serve.pd.reshard import RankPools, rank_layouts
from kthena_serve.pd.transfer import PushSession

__all__ = ["RankPutter", "ReshardPut"]


class ReshardPut:
    """One request's hand-off from a prefill instance's rank pools into a decode instance's,
    over Mooncake (see the module docs): one ``PushSession`` per head move.

    Args:
        moves: the head moves, each with its session (from prefill rank ``src_rank``'s pool
            into decode rank ``dst_rank``'s).
    """

    layerwise = False

    def __init__(self, moves: Sequence[tuple[HeadMove, PushSession]]) -> None:
        self.moves = list(moves)

    def push_layer(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        raise ValueError("a re-sharding put is not layer-wise: the layers ran in the ranks")

    def finish(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        """Put each move's heads of ``src_ids[i]`` into ``dst_ids[i]``; the bytes put.

        Raises:
            mooncake_kv.layout errors (ids out of range or repeated), or the kthena_comm
            transfer error a put met, once every session has settled or passed its deadline.
        """
        error: BaseException | None = None
        if src_ids:
            for move, session in self.moves:
                try:
                    session.put_ranges(session.layout.head_pair_ranges(
                        src_ids, dst_ids, session.dst_layout, src_head=move.src_start,
                        dst_head=move.dst_start, num_heads=move.count))
                except Exception as failed:  # noqa: BLE001 - the submitted ones are waited for
                    error = failed
                    break
        for _move, session in self.moves:  # every session settles before this returns
            try:
                session.finish((), ())
            except Exception as failed:  # noqa: BLE001 - the first is raised below
                error = error or failed
        if error is not None:
            raise error
        return sum(session.num_bytes for _move, session in self.moves)

    def settled(self) -> bool:
        """Whether no put of any move can still write the decode pools (any thread)."""
        return all(session.settled() for _move, session in self.moves)


class RankPutter:
    """A prefill instance's rank pools registered with one Mooncake engine; a ``ReshardPut``
    per request.

    Args:
        engine: the Mooncake engine; ``first`` is rank 0's pool registered with it (the
            worker's ``BlockPutter``), the other ranks' pools are registered here.
        ranks: this worker's rank pools, rank 0's first.
        model_config: the model's ``ModelConfig`` (its KV heads; MLA's latent).
        config: this worker's engine config (its model).
        timeout_s: the most one session's ``finish`` waits for its puts.
    """

    def __init__(self, engine: TransferEngine, first: MemoryHandle, ranks: RankPools,
                 model_config, config: EngineConfig, timeout_s: float) -> None:  # noqa: ANN001
        self.engine, self.ranks, self.timeout_s = engine, ranks, timeout_s
        self.model_config, self.config = model_config, config
        self.handles = [first, *(engine.register(pool.buffer) for pool in ranks.pools[1:])]

    def push(self, ref: PoolRef) -> ReshardPut:
        """The hand-off into the decode instance ``ref`` names.

        Raises:
            ValueError: ``ref`` names no Mooncake handle per rank.
        """
        remote = [MemoryHandle.from_json(handle) for handle in ref.rank_handles()]
        layouts = rank_layouts(self.model_config, self.config, ref)
        heads = (1 if self.model_config.mla is not None
                 else self.model_config.shape.num_kv_heads)
        return ReshardPut([
            (move, PushSession(self.engine, self.handles[move.src_rank],
                               self.ranks.pools[move.src_rank].layout, remote[move.dst_rank],
                               layouts[move.dst_rank], self.timeout_s, layerwise=False))
            for move in kv_head_moves(heads, self.ranks.tp, ref.tp)])
