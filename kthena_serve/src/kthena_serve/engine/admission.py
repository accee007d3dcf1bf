"""Admission: a bound on queued work, so overload is a fast 503 instead of a minute's wait.

A request is *queued* from the moment it is admitted until its first token (or its end)::

    check_admission ──▶ queued (prompt tokens counted) ──first token──▶ served (tokens credited)
         │                        rate = tokens credited / seconds the queue was not empty
         └─ refused: 503 + Retry-After, before anything is generated

The estimated wait of a new request is the queued prompt tokens, its own included, over the
rate at which the queue has been served (``ServiceRate``): prompt tokens that got their first
token per second during which something was queued. That rate is measured on the same path the
client sees (admission to first token), so it holds whatever slows the queue down: decode
protection's prefill cap, a full KV pool, taken seats, preemptions, a remote prefill worker. Its
prior (before a backlog has been seen, and what it decays back to after one) is the step cost
model's prefill capacity at the running decodes (``StepCostModel.prefill_tokens_per_s``).

The queue also waits for KV blocks: a prompt starts only when the pool has its blocks, and
once the pool is full the queue is served as fast as finished requests give blocks back, not
as fast as prompts compute (measured on the soak's 256 MiB pool: prefill fell from 1,300 to
under 300 tokens/s for ten seconds after a burst filled it). So the engine thread reports a
``KVOutlook`` after each step: the free blocks, the blocks the waiting prompts and the running
requests' outputs will still take (outputs at the measured mean length, at most their
``max_tokens``), and the rate finished requests released blocks at (measured, decayed like the
service rate). The KV part of the wait is the blocks missing for everything queued, the new
request included, over that release rate; the estimate is the larger of the two parts.

How far off that estimate runs is measured too, as a ratio: when a request's first token arrives,
``(actual wait + ESTIMATE_FLOOR_S) / (estimate made at its admission + ESTIMATE_FLOOR_S)`` is one
sample (the floor keeps a short wait's step-sized jitter from reading as a large ratio), and a
request still queued past its estimate is a sample of how late it is so far (its ratio will be
at least that: a slowdown shows as soon as the queue runs late, not only once the late first
tokens come). A sample decays towards 1 in log scale (its ratio to the power ``0.5 ^ (age /
FACTOR_HALF_LIFE_S)``); the ``FACTOR_QUANTILE`` quantile of the decayed samples, the median
(``QueueLoad.wait_factor``; below 1 when first tokens came early), scales every estimate before
it is compared with the bound, so a request is refused when the wait it would have had exceeds
the bound, and the deadline below holds the bound for those whose wait runs longer. (The 99th
percentile, at least 1, which this replaced, had the scaled estimates run at twice the waits
the admitted requests saw on issue 52's trace window: docs/kthena_serve.md, "Overload
control".) A ratio, because the error grows with the queue: each admitted request becomes a
decode that takes step time from the prefills behind it, so a full queue is served slower than
the rate measured while it filled (measured: waits of 18 s against estimates of 9 s right
after a burst of admissions). A decay, not a window, because a window that drops its samples at
once lets the queue refill in one burst (measured: a 60 s cycle of overshoot, then refusing
nearly everything for 30 s). ``QueueLoad.accuracy`` reports how the scaled estimates compared
with the waits of the last ``ACCURACY_SAMPLES`` first tokens.

The estimate decides at admission; a deadline keeps the bound afterwards. An admitted request
must *start* (its first prompt chunk scheduled) by its ``start_by``: its admission plus the delay
bound, less its own prompt's compute time at the rate measured then. One still waiting at that
point is refused after all (``timed_out``: ``OverloadedError`` with limit ``queue_timeout``, the
server's 503 with ``Retry-After``; its headers wait for the first output, so this is still a
status, not an event in a 200 stream). So an estimate that ran short costs the few requests it
let in too many, not the TTFT tail of everyone admitted; a request that started is never
refused (a lone prompt longer than the bound is served). Such a refusal is a ratio sample (its
wait against its estimate); a request that ends otherwise without a first token is not (it may
have failed for a reason that is not the queue). Like Triton's queue policy with ``timeout_action: REJECT``, measured from admission.

Two bounds (``AdmissionLimits``, from ``EngineConfig.max_queue_delay_s`` / ``max_queued_tokens``):

* ``max_queue_delay_s``: refuse when the estimated wait, scaled by the measured factor, exceeds it. The same as vLLM's
  ``max_num_queued_tokens`` sized ``target_TTFT x prefill_throughput``, with the throughput
  measured here instead of guessed.
* ``max_queued_tokens``: refuse when the queued prompt tokens, the new ones included, exceed it.

An empty queue always admits (an idle engine serves any request, and serving it is how the rate
and the error are measured again). ``Retry-After`` is the time the queue needs to drain back
under the bound at the measured rate, in whole seconds, 1 to ``MAX_RETRY_AFTER_S``. Every request has priority 0
(the API refuses others), so the queue is first-come first-served and the bound is one number.

Routers (the PD router's ``RemoteEngine``, the DP router's ``DPFrontend``) keep a gate of their
own over what they sent and have not seen a first token of, and hold the bound with a deadline
on that first token instead (``first_token_by``: admission plus the delay bound; a router sees
outputs, not when a prompt starts computing): a request still queued then is refused with the
same ``queue_timeout`` 503 (``timed_out``) and its place given back, and closing its upstream
stream aborts it on the worker. A router's rate starts from ``startup_rate``: the step cost
model's calibrated seed (``DEFAULT_SEED``: SmolLM2-135M on two Zen 5 cores) at the slowest
steps the engine runs (``max_num_seqs`` decode rows beside each prefill step), scaled down by
the share of the seed's two cores an engine has, and never above what the workers report
(their reports start from the same seed at no decode rows). Until its gate has seen a first
token that rate is divided by ``COLD_MARGIN`` (``cold_margin``): the seed is one machine's, and
a burst let in at a rate that runs fast has every first token miss the bound (measured: 16
prompts of 652 tokens on a fresh ``--dp 2`` with ``--kernels torch`` on this project's shared
2-core host, all admitted at the seed's 1,660 tokens/s per replica, every one refused at its
5 s deadline: under 130 tokens/s). An empty queue still admits, so each gate serves one
request whatever the margin; the first tokens then measure the rate and their waits against
their estimates (ratio samples) correct it.

``AdmissionGate`` is the thread-safe bookkeeping one engine front keeps (``AsyncLLM``, the PD
router's ``RemoteEngine``, the DP router per replica): admitted requests it has not seen start
(``claim``) expire after ``claim_timeout_s``, so a request refused later (a 400 after admission) or abandoned before its
stream began cannot hold tokens forever. ``decide`` is the pure decision the DP router also
applies to each replica's reported ``QueueLoad``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kthena_serve.engine.errors import OverloadedError
from kthena_serve.engine.step_cost import StepCostModel

__all__ = ["COLD_MARGIN", "MAX_RETRY_AFTER_S", "QUEUE_TIMEOUT", "SEED_CORES", "AdmissionGate", "AdmissionLimits",
           "KVOutlook", "QueueLoad", "Refusal", "ServiceRate", "decide", "startup_rate"]

MAX_RETRY_AFTER_S = 60
ESTIMATE_FLOOR_S = 1.0  # added to wait and estimate in a ratio sample, and to the estimate scaled
FACTOR_HALF_LIFE_S = 120.0  # a ratio sample's logarithm halves in this many seconds
FACTOR_KEEP_S = 3 * FACTOR_HALF_LIFE_S  # then it is dropped (its logarithm down to 1/8)
FACTOR_QUANTILE = 0.5  # the factor is the median ratio: the scaled estimate is right at p50
ACCURACY_SAMPLES = 1024  # first tokens the estimate's accuracy is reported over (QueueLoad)
QUEUE_DELAY = "queue_delay"  # Refusal.limit: which bound refused
QUEUED_TOKENS = "queued_tokens"
QUEUE_TIMEOUT = "queue_timeout"  # OverloadedError.limit: admitted, then not started in time
SEED_CORES = 2  # the cores the step cost seed was measured on (step_cost.DEFAULT_SEED)
COLD_MARGIN = 10.0  # a router's start-up rate is divided by this until a first token (docs)


def startup_rate(config: Any, num_cores: int) -> float:
    """Prompt tokens per second a router's gate assumes before it has measured (module docs):
    the seed cost model's prefill rate with ``config.max_num_seqs`` decode rows beside
    ``config.max_num_batched_tokens`` prompt tokens a step, times ``min(1, num_cores /
    SEED_CORES)`` (``num_cores``: the cores one engine runs on).

    Raises:
        ValueError: ``num_cores`` < 1.
    """
    if num_cores < 1:
        raise ValueError(f"num_cores must be at least 1, got {num_cores}")
    rate = StepCostModel().prefill_tokens_per_s(config.max_num_seqs,
                                                config.max_num_batched_tokens)
    return rate * min(1.0, num_cores / SEED_CORES)


@attrs.frozen
class AdmissionLimits:
    """The bounds on queued work (None: that bound is off).

    Attributes:
        max_queue_delay_s: the most estimated seconds a new request may wait for its first token.
        max_queued_tokens: the most prompt tokens queued (admitted, no first token yet).
    """

    max_queue_delay_s: float | None = None
    max_queued_tokens: int | None = None

    @classmethod
    def of(cls, config: Any) -> AdmissionLimits:
        """The limits of an ``EngineConfig`` (0 and None both mean off)."""
        return cls(config.max_queue_delay_s or None, config.max_queued_tokens or None)

    @property
    def is_bounded(self) -> bool:
        return self.max_queue_delay_s is not None or self.max_queued_tokens is not None


@attrs.frozen
class KVOutlook:
    """What an engine's KV pool holds in store for its queue (the engine thread's snapshot).

    Attributes:
        free_blocks: blocks an allocation may take now.
        demand_blocks: blocks the waiting prompts (with their outputs) and the running
            requests' remaining outputs will still take.
        release_blocks_per_s: blocks finished requests gave back per second (measured; None:
            none yet).
        block_size: tokens per block.
        out_blocks: a new request's expected output, in blocks (the measured mean length).
    """

    free_blocks: int
    demand_blocks: int
    release_blocks_per_s: float | None
    block_size: int
    out_blocks: int = 0


@attrs.frozen
class QueueLoad:
    """An engine's queue now: what the bound is checked against (reported to routers).

    Attributes:
        num_requests: requests admitted that have no first token yet.
        num_tokens: their prompt tokens.
        prefill_tokens_per_s: the measured rate the queue is served at (None: nothing measured
            and no prior; the delay bound then admits).
        wait_factor: how many times longer than estimated recent first tokens took (the
            median of the decayed ratio samples; below 1 where they came early): scales an
            estimate before it is compared with the bound (``expected_wait_s``).
        kv: the engine's KV outlook (None: the wait is the compute part alone).
        accuracy: how the wait each of the last ``ACCURACY_SAMPLES`` first tokens was admitted
            with (the scaled estimate the bound was checked against) compares with the wait it
            had: the 10th, 50th and 90th percentiles of ``(estimate + ESTIMATE_FLOOR_S) /
            (wait + ESTIMATE_FLOOR_S)`` (None: none yet). Not summed over engines.
        num_accuracy_samples: first tokens those percentiles are over.
    """

    num_requests: int = 0
    num_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    wait_factor: float = 1.0
    kv: KVOutlook | None = None
    accuracy: tuple[float, float, float] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple))
    num_accuracy_samples: int = 0

    def estimated_wait_s(self, num_new_tokens: int = 0) -> float | None:
        """Seconds until the first token of a request of ``num_new_tokens`` prompt tokens
        admitted now: the larger of the compute part (queued prompt tokens over the rate) and
        the KV part (``kv_wait_s``); None: neither can be estimated."""
        rate = self.prefill_tokens_per_s
        compute = None
        if rate is not None:
            tokens = self.num_tokens + num_new_tokens
            compute = tokens / rate if rate > 0 else (math.inf if tokens else 0.0)
        kv = self.kv_wait_s(num_new_tokens)
        if compute is None or kv is None:
            return kv if compute is None else compute
        return max(compute, kv)

    def kv_wait_s(self, num_new_tokens: int = 0) -> float | None:
        """Seconds until the pool has the blocks of everything queued and of a new request of
        ``num_new_tokens`` prompt tokens, at the measured release rate (0: they fit now; None:
        no KV outlook or no release measured)."""
        kv = self.kv
        if kv is None:
            return None
        new = -(-num_new_tokens // kv.block_size) + kv.out_blocks if num_new_tokens else 0
        missing = kv.demand_blocks + new - kv.free_blocks
        if missing <= 0:
            return 0.0
        rate = kv.release_blocks_per_s
        return None if rate is None else (missing / rate if rate > 0 else math.inf)

    def expected_wait_s(self, num_new_tokens: int = 0) -> float | None:
        """The estimate scaled by the measured factor: ``(estimate + ESTIMATE_FLOOR_S) x
        wait_factor - ESTIMATE_FLOOR_S``, at least 0 (the estimate itself at a factor of 1)."""
        wait = self.estimated_wait_s(num_new_tokens)
        if wait is None or self.wait_factor == 1.0 or not math.isfinite(wait):
            return wait
        return max(0.0, (wait + ESTIMATE_FLOOR_S) * self.wait_factor - ESTIMATE_FLOOR_S)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> QueueLoad | None:
        if data is None:
            return None
        kv = data.get("kv")
        return cls(**{**data, "kv": None if kv is None else KVOutlook(**kv)})

    @classmethod
    def total(cls, parts: Sequence[QueueLoad]) -> QueueLoad:
        """Several engines' queues as one (requests, tokens and rates summed; the largest
        factor; no KV outlook: each pool is its own)."""
        rates = [p.prefill_tokens_per_s for p in parts if p.prefill_tokens_per_s is not None]
        return cls(sum(p.num_requests for p in parts), sum(p.num_tokens for p in parts),
                   sum(rates) if rates else None, max((p.wait_factor for p in parts), default=1.0))


@attrs.frozen
class Refusal:
    """Why a request was refused and when to come back.

    Attributes:
        limit: the bound that refused it (``queue_delay`` or ``queued_tokens``).
        estimated_wait_s: the wait it would have had (None: no rate measured).
        retry_after_s: whole seconds until the queue is expected back under the bound.
        message: for the client (names the flag).
    """

    limit: str
    estimated_wait_s: float | None
    retry_after_s: int
    message: str

    def error(self) -> OverloadedError:
        """The exception the engine front raises (the server's 503)."""
        return OverloadedError(self.message, self.retry_after_s, self.limit)


def _retry_after(seconds: float) -> int:
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))


def decide(limits: AdmissionLimits, load: QueueLoad, num_new_tokens: int) -> Refusal | None:
    """Admit (None) or refuse a request of ``num_new_tokens`` prompt tokens given ``load``.

    An empty queue always admits; the token bound counts the new tokens too; the delay bound
    compares the estimated wait (``QueueLoad.estimated_wait_s``, the new tokens included)
    scaled by the measured factor (``QueueLoad.expected_wait_s``).
    """
    if load.num_requests == 0:
        return None
    rate = load.prefill_tokens_per_s
    wait = load.estimated_wait_s(num_new_tokens)
    cap = limits.max_queued_tokens
    tokens = load.num_tokens + num_new_tokens
    if cap is not None and tokens > cap:
        drain = (tokens - cap) / rate if rate else math.inf
        return Refusal(QUEUED_TOKENS, wait, _retry_after(drain),
                       f"the server is overloaded: {tokens} prompt tokens would be queued, over "
                       f"its bound of {cap} (--max-queued-tokens); retry later or on another "
                       "replica")
    bound = limits.max_queue_delay_s
    expected = load.expected_wait_s(num_new_tokens)
    if bound is None or expected is None:
        return None
    if expected > bound:
        parts = [f"{load.num_tokens} prompt tokens queued"
                 + (f" at {rate:.0f} tokens/s" if rate is not None else "")]
        kv_wait = load.kv_wait_s(num_new_tokens)
        if kv_wait:
            parts.append(f"{kv_wait:.1f} s until the KV pool has their blocks")
        if load.wait_factor != 1.0:
            parts.append(f"first tokens lately took {load.wait_factor:.2f}x the estimate "
                         "(median)")
        return Refusal(QUEUE_DELAY, expected, _retry_after(expected - bound),
                       f"the server is overloaded: the first token would come in about "
                       f"{expected:.1f} s ({'; '.join(parts)}), over its bound of {bound:g} s "
                       "(--max-queue-delay); retry later or on another replica")
    return None


class ServiceRate:
    """Prompt tokens served per second of backlogged time, exponentially decayed in wall time.

    ``advance(now, backlogged)`` accrues the time since the last call as busy when something
    was queued throughout; ``credit(n)`` adds the prompt tokens of a request that got its first
    token. ``rate(prior)`` blends the evidence with ``prior`` tokens/s worth ``prior_s`` seconds,
    so it starts at the prior and returns to it when the evidence has decayed (an idle spell).

    Args:
        half_life_s: wall seconds after which evidence counts half.
        prior_s: how many busy seconds the prior is worth.
    """

    def __init__(self, *, half_life_s: float = 10.0, prior_s: float = 1.0) -> None:
        if not half_life_s > 0 or not prior_s > 0:
            raise ValueError(f"half_life_s and prior_s must be positive (got {half_life_s}, "
                             f"{prior_s})")
        self.half_life_s = half_life_s
        self.prior_s = prior_s
        self._tokens = 0.0
        self._busy_s = 0.0
        self._last: float | None = None

    def advance(self, now: float, backlogged: bool) -> None:
        if self._last is not None and now > self._last:
            dt = now - self._last
            decay = 0.5 ** (dt / self.half_life_s)
            self._tokens *= decay
            self._busy_s = self._busy_s * decay + (dt if backlogged else 0.0)
        self._last = now if self._last is None else max(self._last, now)

    def credit(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def rate(self, prior: float | None) -> float | None:
        """Tokens per second (None: no prior and no busy time measured yet)."""
        if prior is None or not prior > 0:
            return self._tokens / self._busy_s if self._busy_s > 1e-3 else None
        return (self._tokens + prior * self.prior_s) / (self._busy_s + self.prior_s)


class AdmissionGate:
    """The queue of one engine front, and its admission decision (thread-safe; module docs).

    Args:
        limits: the bounds (off: every request is admitted, the queue is still measured).
        clock: seconds, monotonic (tests inject one).
        claim_timeout_s: how long an admitted request may take to start its stream.
        rate: the service-rate meter (default ``ServiceRate()``).
        cold_margin: until a first token has been seen, the prior rate is divided by this
            (a router's start-up: ``COLD_MARGIN``; module docs).
    """

    def __init__(self, limits: AdmissionLimits, *, clock: Callable[[], float] = time.monotonic,
                 claim_timeout_s: float = 30.0, rate: ServiceRate | None = None,
                 cold_margin: float = 1.0) -> None:
        if not cold_margin >= 1.0:
            raise ValueError(f"cold_margin must be at least 1, got {cold_margin}")
        self.limits = limits
        self._cold_margin = cold_margin  # 1 once a first token has been seen
        self._clock = clock
        self._claim_timeout_s = claim_timeout_s
        self._rate = rate or ServiceRate()
        self._lock = threading.Lock()
        # request id -> [prompt tokens, claim deadline | None, admitted at, estimate | None,
        #                start by | None, scaled estimate | None]
        self._queued: dict[str, list] = {}
        self._num_tokens = 0
        self._ratios: deque[tuple[float, float]] = deque()  # (when, ratio sample; module docs)
        self._accuracy: deque[float] = deque(maxlen=ACCURACY_SAMPLES)  # QueueLoad.accuracy
        self._num_accuracy = 0

    def try_admit(self, requests: Sequence[tuple[str, int]], prior: float | None = None,
                  kv: KVOutlook | None = None, slowdown: float = 1.0) -> Refusal | None:
        """Queue ``requests`` ((request id, prompt tokens) of one API call) or refuse them all.

        Args:
            prior: the prefill capacity the rate starts from (tokens/s; None: none known).
            kv: the engine's KV outlook (None: the wait is the compute part alone).
            slowdown: scales the measured rate: how much slower the queue will compute once
                the requests ahead decode beside it (the engine's ``prefill_slowdown``).
        """
        num_new = sum(n for _, n in requests)
        with self._lock:
            now = self._advance()
            self._expire(now)
            load = self._load(prior, kv, slowdown)
            refusal = decide(self.limits, load, num_new)
            if refusal is None:
                estimate = load.estimated_wait_s(num_new)
                expected = load.expected_wait_s(num_new)
                for request_id, num_tokens in requests:
                    self._add(request_id, num_tokens, now + self._claim_timeout_s, now,
                              estimate, self._start_by(now, num_tokens, load), expected)
            return refusal

    def start_by(self, request_id: str) -> float | None:
        """When (the gate's clock) the admitted request must have started computing, or be
        refused after all (``timed_out``): its admission plus the delay bound less its own
        prompt's compute time at the rate measured then (module docs). None: no delay bound,
        no rate known at its admission, or not admitted here."""
        with self._lock:
            entry = self._queued.get(request_id)
            return None if entry is None else entry[4]

    def first_token_by(self, request_id: str) -> float | None:
        """A router's deadline (module docs): the admitted request's admission plus the delay
        bound, on the gate's clock. None: no delay bound, or not admitted here."""
        bound = self.limits.max_queue_delay_s
        with self._lock:
            entry = self._queued.get(request_id)
            return None if entry is None or bound is None else entry[2] + bound

    def timed_out(self, request_id: str, *, waited_for: str = "start") -> OverloadedError:
        """The refusal of an admitted request that did not start by its ``start_by`` (a
        router's: that got no first token by its ``first_token_by``,
        ``waited_for="first_token"``); it leaves the queue, and its wait is a ratio sample
        (the queue was that late at least).

        Raises:
            ValueError: ``waited_for`` is neither ``"start"`` nor ``"first_token"``.
        """
        if waited_for not in ("start", "first_token"):
            raise ValueError(f"waited_for must be 'start' or 'first_token', got {waited_for!r}")
        with self._lock:
            now = self._advance()
            entry = self._queued.get(request_id)
            waited = 0.0 if entry is None else now - entry[2]
            if entry is not None and entry[3] is not None and math.isfinite(entry[3]):
                self._ratios.append((now, _ratio(waited, entry[3])))
            self._leave(request_id)
            expected = self._load(None).expected_wait_s()
        bound = self.limits.max_queue_delay_s or 0.0
        missed = (f"start within its share of the queue bound ({waited:.1f} s queued; "
                  f"--max-queue-delay {bound:g} s, less its own prompt's compute time)"
                  if waited_for == "start" else
                  f"get a first token within the queue bound ({waited:.1f} s queued; "
                  f"--max-queue-delay {bound:g} s)")
        return OverloadedError(
            f"the server is overloaded: this request did not {missed}; retry later or on "
            "another replica",
            _retry_after(0.0 if expected is None else expected - bound), QUEUE_TIMEOUT)

    def claim(self, request_id: str, num_tokens: int) -> None:
        """The request's stream started: it stays queued until ``started`` or ``forget``
        (one that was never admitted, e.g. from ``LLM``, is queued now)."""
        with self._lock:
            now = self._advance()
            entry = self._queued.get(request_id)
            if entry is None:
                self._add(request_id, num_tokens, None, now, None)
            else:
                entry[1] = None

    def started(self, request_id: str) -> None:
        """Its first token arrived: it leaves the queue, its tokens count as served and, if it
        was admitted with an estimate, its wait against that estimate is a ratio sample."""
        with self._lock:
            now = self._advance()
            entry = self._queued.pop(request_id, None)
            if entry is not None:
                tokens, _, admitted, estimate, _, expected = entry
                self._num_tokens -= tokens
                self._rate.credit(tokens)
                self._cold_margin = 1.0
                if estimate is not None and math.isfinite(estimate):
                    self._ratios.append((now, _ratio(now - admitted, estimate)))
                if expected is not None and math.isfinite(expected):
                    self._accuracy.append(1.0 / _ratio(now - admitted, expected))
                    self._num_accuracy += 1

    def forget(self, request_id: str) -> None:
        """It ended (or was released) without a first token; nothing happens if it left. Not a
        ratio sample: it may have failed for a reason that is not the queue (a partition
        between PD workers waits out the transfer timeout), and its lateness counted while it
        was queued."""
        with self._lock:
            self._advance()
            self._leave(request_id)

    def load(self, prior: float | None = None, kv: KVOutlook | None = None,
             slowdown: float = 1.0) -> QueueLoad:
        with self._lock:
            self._expire(self._advance())
            return self._load(prior, kv, slowdown, accuracy=True)

    @property
    def num_queued(self) -> int:
        """Requests admitted that have no first token yet."""
        with self._lock:
            return len(self._queued)

    # ---- under the lock -----------------------------------------------------------------------
    def _advance(self) -> float:
        now = self._clock()
        self._rate.advance(now, bool(self._queued))
        return now

    def _add(self, request_id: str, num_tokens: int, deadline: float | None, now: float,
             estimate: float | None, start_by: float | None = None,
             expected: float | None = None) -> None:
        old = self._queued.pop(request_id, None)
        if old is not None:
            self._num_tokens -= old[0]
        self._queued[request_id] = [num_tokens, deadline, now, estimate, start_by, expected]
        self._num_tokens += num_tokens

    def _leave(self, request_id: str) -> None:
        entry = self._queued.pop(request_id, None)
        if entry is not None:
            self._num_tokens -= entry[0]

    def _start_by(self, now: float, num_tokens: int, load: QueueLoad) -> float | None:
        bound, rate = self.limits.max_queue_delay_s, load.prefill_tokens_per_s
        if bound is None or rate is None or not rate > 0:
            return None
        return now + max(0.0, bound - num_tokens / rate)

    def _expire(self, now: float) -> None:
        stale = [rid for rid, entry in self._queued.items()
                 if entry[1] is not None and entry[1] < now]
        for rid in stale:
            self._num_tokens -= self._queued.pop(rid)[0]

    def _load(self, prior: float | None, kv: KVOutlook | None = None,
              slowdown: float = 1.0, *, accuracy: bool = False) -> QueueLoad:
        """The queue now; ``accuracy`` adds the estimate's percentiles (a sort of up to
        ``ACCURACY_SAMPLES`` values: for reports, not for every admission)."""
        rate = self._rate.rate(None if prior is None else prior / self._cold_margin)
        return QueueLoad(len(self._queued), self._num_tokens,
                         None if rate is None else rate * slowdown, self._wait_factor(), kv,
                         self._accuracy_percentiles() if accuracy else None, self._num_accuracy)

    def _accuracy_percentiles(self) -> tuple[float, float, float] | None:
        if not self._accuracy:
            return None
        values = sorted(self._accuracy)
        return tuple(values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]
                     for q in (0.1, 0.5, 0.9))

    def _wait_factor(self) -> float:
        """The ``FACTOR_QUANTILE`` (nearest rank) of the recorded ratio samples (each decayed
        towards 1 in log scale) and of how late the requests still queued past their estimate
        are so far; 1 with none."""
        now = self._clock()
        while self._ratios and self._ratios[0][0] < now - FACTOR_KEEP_S:
            self._ratios.popleft()
        values = [ratio ** (0.5 ** ((now - when) / FACTOR_HALF_LIFE_S))
                  for when, ratio in self._ratios]
        values += [_ratio(now - admitted, estimate)
                   for _, _, admitted, estimate, _, _ in self._queued.values()
                   if estimate is not None and math.isfinite(estimate)
                   and now - admitted > estimate]
        if not values:
            return 1.0
        values.sort()
        return values[min(len(values) - 1, math.ceil(FACTOR_QUANTILE * len(values)) - 1)]


def _ratio(waited_s: float, estimate_s: float) -> float:
    """One sample of how much longer than estimated a first token took (module docs)."""
    return (waited_s + ESTIMATE_FLOOR_S) / (estimate_s + ESTIMATE_FLOOR_S)
