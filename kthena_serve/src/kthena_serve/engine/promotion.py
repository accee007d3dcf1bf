"""Promotion: waiting requests whose next prompt blocks come back up from the offload tiers.

With tiered offload (an ``AsyncOffloader``), a waiting request whose next blocks after its
pool hit may sit in a tier is admitted as *promoting*: it takes its seat and blocks for those
blocks at once, the offloader's promoter thread copies them in while the scheduler runs the
other requests, and a later ``schedule()`` commits the blocks that arrived (they are matchable
again) and prefills the rest. A promotion not done after ``timeout_s`` is cancelled: the blocks
written so far count, the others are computed, into the slots the promotion reserved (*ahead*
of the request's computed tokens). A step with nothing to run but promotions in flight waits
for the oldest one (at most that long) instead of spinning. ``Promotions`` is the scheduler's
book of them.

PD decode reservations (``Scheduler.reserve``) promote too, without a seat in the step: the
blocks a reservation holds after its pool hit are filled from the tiers while the caller waits
off the engine thread (``wait_reserved``), then ``settle_reserved`` ends the job (what arrived
counts as cached, and the prefill worker computes from there; the rest is cancelled, and a
cancel returns only once no write into those blocks can follow). A reservation released or
aborted before that is settled first, so its blocks are never freed under a promotion.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kthena_serve.engine.request import Request, RequestStatus
from mooncake_kv import ExtraKeys, KVCacheBlocks, KVCacheManager

if TYPE_CHECKING:
    from mooncake_kv.tiers import AsyncOffloader, PromotionJob

__all__ = ["Promotions"]

_log = logging.getLogger(__name__)


class Promotions:
    """The promoting requests of one scheduler, by request id (``in``, ``len``, iteration).

    Args:
        kv: the scheduler's KV cache manager.
        offloader: the tiers to promote from; None: nothing is ever promoted.
        timeout_s: how long a request waits for its promotion at most.
    """

    def __init__(self, kv: KVCacheManager, offloader: AsyncOffloader | None,
                 timeout_s: float) -> None:
        self.kv = kv
        self.offloader = offloader
        self.timeout_s = timeout_s
        # request id -> (request, job, pool-hit blocks); _ahead: request id -> slots reserved
        # past its computed tokens (a promotion's blocks that were not filled)
        self._jobs: dict[str, tuple[Request, PromotionJob, int]] = {}
        self._ahead: dict[str, int] = {}
        self._reserved: dict[str, PromotionJob] = {}  # PD reservations being filled

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._jobs

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def try_start(self, request: Request, num_hit_blocks: int, salt: ExtraKeys | None) -> bool:
        """Start promoting the prompt's blocks after the pool hit; False: admit as usual.

        Needs an offloader, the first such block to be possibly below (``may_hold``) and free
        blocks for all of them; at least one prompt token is always left to compute.
        """
        size = self.kv.block_size
        limit = (request.num_tokens - 1) // size
        if self.offloader is None or num_hit_blocks >= limit:
            return False
        hashes = self.kv.hasher.hash_tokens(request.token_ids[: limit * size], salt)
        wanted = hashes[num_hit_blocks:]
        if not self.offloader.may_hold(wanted[0]):
            return False
        blocks = self.kv.try_allocate(request.request_id, len(wanted) * size)
        if blocks is None:
            return False
        job = self.offloader.start_promotion(wanted, blocks.block_ids[num_hit_blocks:limit])
        request.block_ids = blocks.block_ids
        self._jobs[request.request_id] = (request, job, num_hit_blocks)
        return True

    def try_start_reserved(self, request: Request, num_hit_blocks: int,
                           salt: ExtraKeys | None) -> int:
        """Start filling a PD reservation's blocks after its pool hit (``request.block_ids``
        cover the prompt); the blocks being promoted (0: none, nothing started). At least one
        prompt token is left to compute (the prefill worker samples the first token from it)."""
        size = self.kv.block_size
        limit = (request.num_tokens - 1) // size
        if self.offloader is None or num_hit_blocks >= limit:
            return 0
        hashes = self.kv.hasher.hash_tokens(request.token_ids[: limit * size], salt)
        wanted = hashes[num_hit_blocks:]
        if not self.offloader.may_hold(wanted[0]):
            return 0
        self._reserved[request.request_id] = self.offloader.start_promotion(
            wanted, request.block_ids[num_hit_blocks:limit])
        return len(wanted)

    def wait_reserved(self, request_id: str) -> None:
        """Wait for a reservation's promotion to end, at most until it times out (any
        thread; returns at once when there is none)."""
        job = self._reserved.get(request_id)
        if job is not None:
            job.wait(max(0.0, job.started + self.timeout_s - time.monotonic()))

    def settle_reserved(self, request_id: str) -> int:
        """End a reservation's promotion: the leading blocks written (0 when there is none);
        no write into its blocks follows."""
        job = self._reserved.pop(request_id, None)
        if job is None:
            return 0
        return job.num_promoted if job.done() else job.cancel()

    def collect(self) -> list[Request]:
        """The requests whose promotion ended (or timed out), what arrived committed, each
        ready to run from there (status RUNNING)."""
        now = time.monotonic()
        started = []
        for rid, (request, job, num_hit) in list(self._jobs.items()):
            if job.done():
                num_promoted = job.num_promoted
            elif now - job.started >= self.timeout_s:
                num_promoted = job.cancel()
                _log.warning("promotion of request %s timed out after %.1f s; %d of %d blocks "
                             "arrived, the rest is computed", rid, self.timeout_s,
                             num_promoted, len(job.block_ids))
            else:
                continue
            del self._jobs[rid]
            self._start(request, num_hit, num_promoted, len(job.block_ids))
            started.append(request)
        return started

    def _start(self, request: Request, num_hit: int, num_promoted: int,
               num_reserved: int) -> None:
        size = self.kv.block_size
        computed = (num_hit + num_promoted) * size
        if num_promoted:
            self.kv.commit(request.request_id, request.token_ids[:computed])
        request.num_computed_tokens = computed
        request.num_committed_blocks = num_hit + num_promoted
        if request.num_cached_tokens is None:
            request.num_cached_tokens = computed
        if num_promoted < num_reserved:
            self._ahead[request.request_id] = (num_reserved - num_promoted) * size
        request.status = RequestStatus.RUNNING

    def wait_oldest(self) -> None:
        """Wait for the oldest promotion to end, at most until it times out."""
        _, job, _ = next(iter(self._jobs.values()))
        job.wait(max(0.0, job.started + self.timeout_s - time.monotonic()))

    def cancel(self, request_id: str) -> Request | None:
        """Stop promoting ``request_id`` (no write into its blocks after this); its request, or
        None if it is not promoting. Its blocks are the caller's to free."""
        entry = self._jobs.pop(request_id, None)
        if entry is None:
            return None
        request, job, _ = entry
        job.cancel()
        return request

    def allocate_prefill(self, request_id: str, num_new: int) -> KVCacheBlocks | None:
        """Reserve a prefill chunk's slots, less those a promotion reserved and left unfilled."""
        ahead = self._ahead.get(request_id, 0)
        blocks = self.kv.try_allocate(request_id, max(0, num_new - ahead))
        if blocks is not None and ahead:
            self._ahead[request_id] = max(0, ahead - num_new)
        return blocks

    def forget(self, request_id: str) -> None:
        """Drop the slots reserved ahead for a request that leaves the running set."""
        self._ahead.pop(request_id, None)
