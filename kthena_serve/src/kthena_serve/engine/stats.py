"""What an engine reports about itself: ``EngineStats`` (counters since start, a queue snapshot,
the KV manager's and each offload tier's stats). Plain data: a PD router or a DP frontend sums
its workers' (``EngineStats.total``), and ``to_json`` / ``from_json`` carry it between processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kthena_serve.engine.admission import QueueLoad
from kthena_serve.engine.step_times import StepTimes
from mooncake_kv import KVCacheStats

__all__ = ["EngineStats", "KVTierStats"]

_KV_FIELDS = tuple(f.name for f in attrs.fields(KVCacheStats))


@attrs.frozen
class KVTierStats:
    """One KV tier below the pool (``--kv-offload``), counters since start.

    Attributes:
        tier: the tier's name (``host``, ``mooncake_store``).
        num_hits, num_misses: promotion lookups this tier answered / reached it and missed.
        num_promoted_blocks: blocks copied from this tier back into the pool.
        num_stored_blocks: blocks put into it (offloads, or spills from the tier above).
        num_bytes_in, num_bytes_out: bytes put into it / read back from it.
        num_dropped: offloads dropped on the way in (queue full, block reused first, a spill
            the tier did not take).
        num_errors: failed or corrupt tier calls (each one a recompute, never wrong KV).
        queue_depth: offloads waiting for the copier (the first tier's queue); None for a tier
            fed synchronously by the one above.
        used_bytes: bytes the tier holds now (the host tier); None for the Mooncake Store,
            which every engine pointed at its master shares.
    """

    tier: str
    num_hits: int
    num_misses: int
    num_promoted_blocks: int
    num_stored_blocks: int
    num_bytes_in: int
    num_bytes_out: int
    num_dropped: int
    num_errors: int
    queue_depth: int | None
    used_bytes: int | None = None


@attrs.frozen
class EngineStats:
    """Counters since start, a queue snapshot, and the KV manager's stats."""

    num_steps: int
    num_computed_prompt_tokens: int  # prompt (and recomputed) tokens actually run
    num_generated_tokens: int
    num_preemptions: int
    num_waiting: int
    num_running: int
    kv: KVCacheStats
    kv_tiers: tuple[KVTierStats, ...] = ()  # --kv-offload tiers, fastest first
    queue: QueueLoad | None = None  # the admission queue (admission.py); None: no front admits
    # kthena doctor's leak report: requests the KV manager holds blocks for that the engine
    # no longer has (finished or aborted without ``free``), and the block references they hold
    num_leaked_requests: int = 0
    num_leaked_blocks: int = 0
    step_times: StepTimes = StepTimes()  # seconds per phase (step_times.py)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineStats:
        fields = dict(data)
        fields["kv"] = KVCacheStats(**fields["kv"])
        fields["kv_tiers"] = tuple(KVTierStats(**t) for t in fields.get("kv_tiers", ()))
        fields["queue"] = QueueLoad.from_json(fields.get("queue"))
        fields["step_times"] = StepTimes(**fields.get("step_times", {}))
        return cls(**fields)

    @classmethod
    def total(cls, parts: Sequence[EngineStats], block_size: int, *,
              kv_from: Sequence[EngineStats] | None = None) -> EngineStats:
        """The sum of several engines' stats (a PD or data-parallel deployment).

        Args:
            parts: every engine's stats; their counters are summed.
            block_size: the deployment's block size.
            kv_from: the engines whose KV pools serve requests (default ``parts``); PD prefill
                workers compute into decode workers' pools, so their KV is not counted twice.
        """
        counters = {f.name: sum(getattr(p, f.name) for p in parts) for f in attrs.fields(cls)
                    if f.name not in ("kv", "kv_tiers", "queue", "step_times")}
        pools = parts if kv_from is None else kv_from
        kv = {name: sum(getattr(p.kv, name) for p in pools) for name in _KV_FIELDS}
        kv["block_size"] = block_size
        queues = [p.queue for p in parts if p.queue is not None]
        return cls(**counters, kv=KVCacheStats(**kv), kv_tiers=_tier_totals(parts),
                   queue=QueueLoad.total(queues) if queues else None,
                   step_times=StepTimes.total([p.step_times for p in parts]))


def _tier_totals(parts: Sequence[EngineStats]) -> tuple[KVTierStats, ...]:
    """Each tier's counters summed over the engines that have it, in first-seen order."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for tier in part.kv_tiers:
            entry = merged.setdefault(tier.tier, {"tier": tier.tier})
            for name, value in attrs.asdict(tier).items():
                if name != "tier" and value is not None:
                    entry[name] = (entry.get(name) or 0) + value
                elif name != "tier":
                    entry.setdefault(name, None)
    return tuple(KVTierStats(**fields) for fields in merged.values())
