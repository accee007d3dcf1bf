"""vLLM's metric names for the server's own measurements (what the Kthena router scrapes).

::

    our name (server/metrics.py)              vLLM's name (here)                         type
    kthena_num_requests_running / _waiting    vllm:num_requests_running / _waiting       gauge
    kthena_kv_blocks_used / pool size         vllm:kv_cache_usage_perc (0..1)            gauge
    kthena_prefix_cache_queries / _hits       vllm:prefix_cache_queries / _hits (tokens) counter
    kthena_generation_tokens, _preemptions    vllm:generation_tokens, num_preemptions    counter
    kthena_requests{finish_reason}            vllm:request_success{finished_reason}      counter
    kthena_time_to_first_token_seconds        vllm:time_to_first_token_seconds           histogram
    kthena_request_latency_seconds            vllm:e2e_request_latency_seconds           histogram
    (first token .. last token) / gaps        vllm:inter_token_latency_seconds           histogram
    prompt lengths of finished requests       vllm:prompt_tokens                         counter
    kthena_requests_rejected{reason=overload} vllm:admission_rejections{reason=           counter
                                                max_num_queued_tokens}

One source, two names: the gauges and counters come from the same ``EngineStats`` snapshot
as the ``kthena_*`` ones in the same scrape (``engine_families``), and each finished request
is one ``observe`` call that feeds both sets. Every series has vLLM's ``model_name`` label;
buckets are vLLM's.

vLLM observes every gap between two tokens of a request. The server sees a finished request's
first-token and finish times, so it records its ``n - 1`` gaps as ``n - 1`` observations of
their mean: the count and the sum are exact (the router reads Δsum / Δcount), the bucket of a
single gap is approximate. Both admission bounds (admission.py) bound the prefill backlog in
tokens (the delay bound is the token bound ``delay x measured rate``, vLLM's sizing rule for
``max_num_queued_tokens``), so every refusal counts under vLLM's reason
``max_num_queued_tokens``. ``vllm:prompt_tokens`` counts prompt tokens (cached ones included,
as vLLM does) of requests as they finish; a request that ends without an output (its client
went away) counts in ``request_success{finished_reason="abort"}`` but adds no prompt tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from kthena_serve.engine.stats import EngineStats

__all__ = ["VllmMetrics", "engine_families"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
ADMISSION_REASON = "max_num_queued_tokens"  # vLLM's reason for a prefill-backlog bound
_LABEL = ["model_name"]


def engine_families(stats: EngineStats, model_name: str) -> Iterator:
    """vLLM's gauges and counters of one engine-stats snapshot."""
    kv, labels = stats.kv, [model_name]
    usage = kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0
    for kind, name, doc, value in (
        (GaugeMetricFamily, "vllm:num_requests_running",
         "Number of requests in model execution batches.", stats.num_running),
        (GaugeMetricFamily, "vllm:num_requests_waiting",
         "Number of requests waiting to be processed.", stats.num_waiting),
        (GaugeMetricFamily, "vllm:kv_cache_usage_perc",
         "KV-cache usage. 1 means 100 percent usage.", usage),
        (CounterMetricFamily, "vllm:prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens.", kv.num_query_tokens),
        (CounterMetricFamily, "vllm:prefix_cache_hits",
         "Prefix cache hits, in terms of number of cached tokens.", kv.num_hit_tokens),
        (CounterMetricFamily, "vllm:generation_tokens",
         "Number of generation tokens processed.", stats.num_generated_tokens),
        (CounterMetricFamily, "vllm:num_preemptions",
         "Cumulative number of preemption from the engine.", stats.num_preemptions),
    ):
        family = kind(name, doc, labels=_LABEL)
        family.add_metric(labels, value)
        yield family


class _SpreadHistogram:
    """A histogram that takes ``count`` observations of one value at once (see module docs)."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], model_name: str) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = (*buckets, float("inf"))
        self._counts = [0] * len(self.bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, total: float, count: int) -> None:
        """``count`` observations of ``total / count`` (``count`` > 0)."""
        index = next(i for i, bound in enumerate(self.bounds) if total / count <= bound)
        with self._lock:
            self._counts[index] += count
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.doc, labels=_LABEL)
        family.add_metric([self.model_name], buckets, total)
        yield family


class VllmMetrics:
    """vLLM's per-request metrics, fed by ``ServerMetrics.observe`` (see module docs)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _LABEL,
                              buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _LABEL,
                             buckets=E2E_BUCKETS, registry=registry).labels(model_name)
        self.itl = _SpreadHistogram("vllm:inter_token_latency_seconds",
                                    "Histogram of inter-token latency in seconds.",
                                    ITL_BUCKETS, model_name)
        registry.register(self.itl)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     _LABEL, registry=registry).labels(model_name)
        self.success = Counter("vllm:request_success",
                               "Count of successfully processed requests.",
                               [*_LABEL, "finished_reason"], registry=registry)
        self.admission = Counter("vllm:admission_rejections", "Number of admission attempts "
                                 "rejected by a queue limit, by reason.",
                                 [*_LABEL, "reason"], registry=registry).labels(
                                     model_name, ADMISSION_REASON)  # present from the start
        self.model_name = model_name
        for reason in FINISH_REASONS:  # present from the start, as in vLLM
            self.success.labels(model_name, reason)

    def rejected(self) -> None:
        self.admission.inc()

    def finished(self, reason: str, count: int = 1, num_prompt_tokens: int = 0) -> None:
        self.success.labels(self.model_name, reason).inc(count)
        self.prompt_tokens.inc(num_prompt_tokens)

    def latencies(self, ttft: float, e2e: float, num_gaps: int, gap_sum: float) -> None:
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if num_gaps > 0:
            self.itl.observe(gap_sum, num_gaps)
