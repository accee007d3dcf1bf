"""Tiered KV offload of one engine: the ``--kv-offload`` value and the offloader it opens.

``host=SIZE[,store=mooncake[@HOST:PORT]][,write=spill|through][,segment=SIZE]``
``[,listen=ADDRESS][,queue=N][,timeout=SECONDS]``

* ``host=SIZE``: bytes of host memory (``2GiB``, ``512MiB``) holding offloaded blocks (LRU).
* ``store=mooncake@HOST:PORT``: blocks the host tier pushes out go to the Mooncake Store whose
  ``mooncake_master`` RPC port is HOST:PORT (``store=mooncake`` alone: ``127.0.0.1:50051``,
  the master's default); engines pointed at one master reuse each other's blocks.
* ``write=spill`` (default): the store gets what the host tier pushes out; ``write=through``:
  every offloaded block goes to the store at once too, so other engines find it right away.
* ``segment=SIZE``: bytes of this process's RAM lent to the store (default 64MiB; the store
  holds what its clients and servers lend it).
* ``listen=ADDRESS``: where this process's store client listens and what it advertises
  (default 127.0.0.1). Other clients read this process's segment there, so with a master on
  another host give this host's address on that network; the store tier is refused for a
  remote master with a loopback ``listen``. Mooncake by itself listens on every interface:
  ``mooncake_kv.listen`` keeps it on this address, or the store tier is not opened.
* ``queue=N``: offloads waiting for the background copier at most (default 256; more drop).
* ``timeout=SECONDS``: how long a request waits for its promotion before recomputing the
  blocks not yet copied (default 5).

At tp > 1 (pp 1, spawned cpu ranks: ``EngineConfig`` refuses the rest) rank 0's process maps
every rank's pool and offloads whole blocks of all KV heads in the one-rank layout
(``rank_blocks.RankBlocks``), so keys and bytes are a tp=1 engine's whatever the TP size.

In PD (``kthena serve --mode pd``) every worker, of any TP size, opens these tiers over its own
pool, a store only with ``write=through`` (spec.py), and ``check_store`` refuses a master that
does not answer before any worker starts (docs/pd.md, "Shared KV store").

The engine side is ``mooncake_kv.tiers.AsyncOffloader`` (copier and promoter threads); this
module names its keys (model, dtype, pool geometry) and turns its counters into ``KVTierStats``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kthena_serve.engine.kv_offload_config import DEFAULT_MASTER, KVOffloadConfig
from kthena_serve.engine.stats import KVTierStats

if TYPE_CHECKING:
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.model_runner import Runner
    from mooncake_kv import KVCacheManager
    from mooncake_kv.tiers import AsyncOffloader, OffloadSnapshot
    from mooncake_kv.tiers.offload import BlockStorage

__all__ = ["DEFAULT_MASTER", "KVOffloadConfig", "StoreUnreachableError", "check_store",
           "close_offloader", "open_offloader", "shares_store", "tier_stats"]


class StoreUnreachableError(ValueError):
    """``--kv-offload`` names a store whose ``mooncake_master`` does not answer."""


def shares_store(config: EngineConfig) -> bool:
    """Whether engines of ``config`` put every block they cache into a store at once (a store
    with ``write=through``): what a router may count as the store's (cluster/router.py)."""
    spec = config.kv_offload
    return spec is not None and spec.store_address is not None and spec.store_write_through


def check_store(spec: KVOffloadConfig | None, timeout_s: float = 2.0) -> None:
    """Refuse a store tier whose master does not answer (PD: before any worker starts, where
    an engine alone would leave the store out with a warning).

    Raises:
        StoreUnreachableError: naming the master's address and what to do.
    """
    if spec is None or spec.store_address is None:
        return
    from mooncake_kv.tiers import TierUnavailableError
    from mooncake_kv.tiers.store import probe_master

    try:
        probe_master(spec.store_address, timeout_s)
    except TierUnavailableError as error:
        raise StoreUnreachableError(f"--kv-offload: {error}") from None


def namespace(config: EngineConfig) -> str:
    """What every key of this engine starts with: the model (``default``, or the real path of
    the checkpoint folder it resolves to: a Hub repo's snapshot folder names its revision, so
    new weights under the same repo id get new keys) and the compute dtype; the pool's
    geometry and the block-hash chain follow."""
    from kthena_serve.model import resolve_checkpoint

    model = (config.model if config.model == "default"
             else os.path.realpath(resolve_checkpoint(config.model)))
    return f"kthena|{model}|{config.dtype}|{config.hash_algorithm}"


def open_offloader(config: EngineConfig, runner: Runner, kv: KVCacheManager,
                   ) -> AsyncOffloader:
    """The offloader ``config.kv_offload`` asks for, following ``kv``'s events over the blocks
    of ``runner``: its pool, or at tp > 1 every rank's pool in the one-rank layout
    (``rank_blocks.RankBlocks``: the keys and bytes a tp=1 engine of the model gives a
    block). Close it with ``close_offloader``.

    A store that cannot be reached is left out with a warning (host tier only).

    Raises:
        ValueError: a tp > 1 runner whose rank pools are private (not ``shared_pool``).
    """
    import logging

    from kthena_serve.engine.rank_blocks import block_storage
    from mooncake_kv.tiers import (
        AsyncOffloader,
        HostMemoryTier,
        StoreTierConfig,
        TierError,
        open_tier,
    )

    spec: KVOffloadConfig = config.kv_offload
    storage = block_storage(runner)  # first: a refused runner opens no store client
    tiers = [HostMemoryTier(spec.host_bytes, "host")]
    if spec.store_address is not None:
        try:
            tiers.append(open_tier(StoreTierConfig(
                master_address=spec.store_address, namespace="kthena",
                global_segment_size=spec.store_segment_bytes,
                local_hostname=spec.store_listen)))
        except TierError as error:
            logging.getLogger(__name__).warning(
                "KV offload: the Mooncake Store at %s is left out, blocks past the host tier "
                "are recomputed: %s", spec.store_address, error)
    try:
        return AsyncOffloader(kv, storage, tiers, namespace=namespace(config),
                              queue_depth=spec.queue_depth,
                              write_through=spec.store_write_through)
    except BaseException:
        _close_storage(storage)
        raise


def close_offloader(offloader: AsyncOffloader) -> None:
    """Close ``offloader`` (its threads, its tiers), then unmap the rank pools it read at
    tp > 1 (never the runner's own pool: the runner closes that). Safe to repeat."""
    offloader.close()
    _close_storage(offloader.pool)


def _close_storage(storage: BlockStorage) -> None:
    from kthena_serve.engine.rank_blocks import RankBlocks

    if isinstance(storage, RankBlocks):
        storage.close()


def tier_stats(snapshot: OffloadSnapshot) -> tuple[KVTierStats, ...]:
    """Per-tier numbers for ``EngineStats``: the queue feeds the first tier, so its depth and
    its dropped offloads are that tier's; a lower tier's drops are the spills it did not take
    (it failed or was paused). With one lower tier or more, spills only reach the second."""
    out = []
    for level, tier in enumerate(snapshot.tiers):
        first = level == 0
        out.append(KVTierStats(
            tier=tier.name, num_hits=tier.num_hits, num_misses=tier.num_misses,
            num_promoted_blocks=tier.num_promoted_blocks,
            num_stored_blocks=tier.num_stored_blocks,
            num_bytes_in=tier.num_bytes_in, num_bytes_out=tier.num_bytes_out,
            num_dropped=(snapshot.num_dropped + snapshot.num_failed if first
                         else snapshot.num_spilled_lost),
            num_errors=tier.num_errors + tier.num_corrupt,
            queue_depth=snapshot.queue_depth if first else None, used_bytes=tier.used_bytes))
    return tuple(out)
