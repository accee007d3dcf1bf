"""EngineClient: the one seam the OpenAI app, its metrics and the CLI talk to.

::

    server/app.py, server/metrics.py, cli.py
                 │  EngineClient: processor (InputProcessor: limits · encode(_chat) · decode
                 │                · check · token_bytes · token_strs)
                 │                · check_admission · generate · abort(_all) · stats
                 │                · is_alive
       ┌─────────┴──────────────┬───────────────────────────┐
    AsyncLLM (in process)     RemoteEngine (PD router)    PrefillEngine (a PD prefill worker)

Every implementation validates with an ``InputProcessor``, so a request gets the same answer
whichever serves it (its ``EngineLimits`` are built in input_processor.py only: ``for_engine``,
``combine``). ``EngineStats`` is plain data: a PD router sums its workers'.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from kthena_serve.admission import QueueLoad
from kthena_serve.request import EngineRequest, RequestOutput
from kthena_serve.step_times import StepTimes
from mooncake_kv import KVCacheStats

if TYPE_CHECKING:
    from kthena_serve.input_processor import InputProcessor

__all__ = ["EngineClient", "EngineStats", "KVConnector", "KVSession",
           "KVTierStats"]

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


@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP app needs of an engine, in process or remote: its input processor (the
    one place requests are tokenised and checked) and four verbs."""

    @property
    def processor(self) -> InputProcessor:
        """Tokenise, render chat, detokenise, check against ``processor.limits``."""
        ...

    @property
    def is_alive(self) -> bool: ...

    def check_admission(self, requests: Sequence[EngineRequest]) -> None:
        """Queue one API call's validated requests, or refuse them all at once when the queue
        is past its bound (``kthena_serve.admission``); called before anything streams.

        Raises:
            OverloadedError: past the bound (the app answers 503 with ``Retry-After``).
        """
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a validated request's outputs; leaving early aborts it."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request wherever it is: one admitted (``check_admission``) that never
        streamed gives its queue place back; a running one stops."""
        ...

    def abort_all(self, message: str) -> None:
        """End every request in flight; each stream fails with ``EngineDeadError(message)``."""
        ...

    def stats(self) -> EngineStats: ...


class KVSession(Protocol):
    """One request's side of ``kv_transfer_params``: its outputs, then the object to answer."""

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (the request ``KVConnector.open`` was given)."""
        ...

    def response_params(self) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of the answer, once the last output is out (or None)."""
        ...


@runtime_checkable
class KVConnector(Protocol):
    """A PD worker's side of the Kthena router's ``nixl`` / ``mooncake`` connectors.

    The OpenAI app hands it a request's ``kv_transfer_params`` before anything streams, so a
    refusal is a clean 400 (kthena_serve.pd.prefill_connector / decode_connector implement it).
    """

    async def open(self, params: Mapping[str, Any], request: EngineRequest, *,
                   stream: bool) -> KVSession | None:
        """Check ``params`` for ``request`` and prepare it; None: a plain request after all.

        Raises:
            InvalidRequestError: params this worker refuses (the app answers 400).
            EngineDeadError: the KV cannot be had and the policy says fail (503).
        """
        ...
