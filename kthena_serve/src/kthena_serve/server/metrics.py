"""Prometheus metrics of one server: latency histograms, queue and KV gauges, prefix-cache hits.

Each app has its own registry (several servers can live in one process, as in tests). Gauges
and counters that mirror engine state are read at scrape time from the engine's snapshot and
its KV part (``EngineClient.stats()``: summed over the workers in PD); the histograms are fed as requests finish.
Given the served model's name, the same snapshot and observations are also exported under
vLLM's names (``vllm:*``, see ``vllm_metrics``), which the Kthena router scrapes.

One instance per server: a PD worker hands the same one to its OpenAI app and its control
app (``build_app(..., metrics=...)``), so each request is observed once and each family is
rendered once, whichever path the request took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kthena_serve.engine.admission import QueueLoad
from kthena_serve.engine.request import RequestOutput
from kthena_serve.engine.stats import EngineStats, KVTierStats
from kthena_serve.engine.step_times import PHASES
from kthena_serve.server.vllm_metrics import VllmMetrics, engine_families

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

    from kthena_serve.engine.input_processor import EngineLimits, InputProcessor

__all__ = ["ServerMetrics", "StatsSource", "add_collector"]


class StatsSource(Protocol):
    """What the gauges and counters are read from at scrape time: an ``EngineClient`` (a PD
    prefill worker's counts its control-path tasks too)."""

    def stats(self) -> EngineStats: ...

    @property
    def processor(self) -> InputProcessor:
        """Its limits name the KV pool (``kthena_kv_cache_info``)."""
        ...


_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class _EngineCollector:
    """Reads engine state at scrape time."""

    def __init__(self, engine: StatsSource, model_name: str | None) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        if self.model_name is not None:  # one snapshot, both names
            yield from engine_families(stats, self.model_name)
        kv = stats.kv
        yield _gauge("kthena_num_requests_waiting", "Requests queued", stats.num_waiting)
        yield _gauge("kthena_num_requests_running", "Requests running", stats.num_running)
        yield _gauge("kthena_kv_blocks_used", "KV blocks referenced by requests", kv.num_used_blocks)
        yield _gauge("kthena_kv_blocks_free", "KV blocks free (incl. cached, evictable)",
                     kv.num_free_blocks)
        yield _gauge("kthena_kv_blocks_cached", "KV blocks in the prefix cache", kv.num_cached_blocks)
        yield from _kv_cache_info(self.engine.processor.limits)
        yield from _kernels_info(self.engine.processor.limits)
        yield _counter("kthena_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                       kv.num_query_tokens)
        yield _counter("kthena_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                       kv.num_hit_tokens)
        yield _counter("kthena_computed_prompt_tokens", "Prompt tokens computed (not cached)",
                       stats.num_computed_prompt_tokens)
        yield _counter("kthena_generation_tokens", "Tokens generated", stats.num_generated_tokens)
        yield _counter("kthena_preemptions", "Requests preempted for lack of KV blocks",
                       stats.num_preemptions)
        if stats.kv_tiers:
            yield from _tier_families(stats.kv_tiers)
        if stats.queue is not None:
            yield from _queue_families(stats.queue)
        yield from _doctor_families(stats)


def _doctor_families(stats: EngineStats) -> Iterator[Metric]:
    """What ``kthena doctor`` reads beyond the usual gauges: the KV leak report and where the
    engine thread's time goes (``step_times``)."""
    yield _gauge("kthena_kv_leaked_requests", "Requests the KV manager holds blocks for that "
                 "the engine no longer has (finished without freeing: a leak)",
                 stats.num_leaked_requests)
    yield _gauge("kthena_kv_leaked_blocks", "KV block references held by those requests",
                 stats.num_leaked_blocks)
    seconds = CounterMetricFamily("kthena_step_seconds", "Engine thread seconds by phase: "
                                  "schedule, prefill / decode forwards, sampling "
                                  "(postprocess), idle", labels=["phase"])
    for phase in PHASES:
        seconds.add_metric([phase], stats.step_times.seconds(phase))
    yield seconds


def _queue_families(queue: QueueLoad) -> Iterator[Metric]:
    """``kthena_admission_*``: the queue the overload bound watches (admission.py)."""
    yield _gauge("kthena_admission_queued_requests",
                 "Requests admitted that have no first token yet", queue.num_requests)
    yield _gauge("kthena_admission_queued_prompt_tokens",
                 "Prompt tokens of the requests admitted that have no first token yet",
                 queue.num_tokens)
    if queue.prefill_tokens_per_s is not None:
        yield _gauge("kthena_admission_prefill_tokens_per_second",
                     "Prompt tokens per second the queue is served at (measured, admission to "
                     "first token)", queue.prefill_tokens_per_s)
        yield _gauge("kthena_admission_estimated_wait_seconds",
                     "Estimated wait for the first token of a request admitted now (the larger "
                     "of queued prompt tokens over that rate and the wait for KV blocks; "
                     "before the factor)", queue.estimated_wait_s() or 0.0)
    yield _gauge("kthena_admission_wait_factor",
                 "How many times longer than estimated recent first tokens took (the median; "
                 "scales the estimate before the --max-queue-delay check)", queue.wait_factor)
    if queue.accuracy is not None:
        ratio = GaugeMetricFamily(
            "kthena_admission_estimate_to_wait_ratio", "The scaled wait estimate a request was "
            "admitted with over the wait it had (each plus 1 s), over the last first tokens: "
            "their 10th, 50th and 90th percentiles", labels=["quantile"])
        for q, value in zip(("0.1", "0.5", "0.9"), queue.accuracy, strict=True):
            ratio.add_metric([q], value)
        yield ratio
        yield _gauge("kthena_admission_estimate_to_wait_samples",
                     "First tokens the kthena_admission_estimate_to_wait_ratio percentiles are "
                     "over", queue.num_accuracy_samples)


_TIER_COUNTERS = (  # KVTierStats field -> (kthena_kv_tier_* name, help)
    ("num_hits", "hits", "Promotion lookups this KV tier answered"),
    ("num_misses", "misses", "Promotion lookups that reached this KV tier and missed"),
    ("num_promoted_blocks", "promotions", "KV blocks copied from this tier back into the pool"),
    ("num_stored_blocks", "stored_blocks", "KV blocks put into this tier"),
    ("num_bytes_in", "bytes_in", "Bytes moved into this KV tier"),
    ("num_bytes_out", "bytes_out", "Bytes moved from this KV tier back towards the pool"),
    ("num_dropped", "dropped_offloads",
     "Offloads dropped on the way into this tier (queue full, block reused first, store down)"),
    ("num_errors", "errors", "Failed or corrupt calls to this tier (recomputed instead)"),
)


def _tier_families(tiers: Sequence[KVTierStats]) -> Iterator[Metric]:
    """``kthena_kv_tier_*{tier=...}`` of ``--kv-offload``."""
    for field, name, doc in _TIER_COUNTERS:
        family = CounterMetricFamily(f"kthena_kv_tier_{name}", doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier.tier], getattr(tier, field))
        yield family
    depth = GaugeMetricFamily("kthena_kv_tier_offload_queue_depth",
                              "Offloads waiting for the background copier into this tier",
                              labels=["tier"])
    used = GaugeMetricFamily("kthena_kv_tier_used_bytes",
                             "Bytes this KV tier holds now (absent for the shared Mooncake Store)",
                             labels=["tier"])
    for tier in tiers:
        if tier.queue_depth is not None:
            depth.add_metric([tier.tier], tier.queue_depth)
        if tier.used_bytes is not None:
            used.add_metric([tier.tier], tier.used_bytes)
    yield depth
    yield used


def _kv_cache_info(limits: EngineLimits) -> Iterator[Metric]:
    """``kthena_kv_cache_info{dtype, block_size, num_blocks} 1``: the pool's element type
    (int8 pools hold ~1.9x bf16's blocks) and size; absent while no pool has reported."""
    if limits.kv_cache_dtype is None:
        return
    info = GaugeMetricFamily("kthena_kv_cache_info", "The KV pool (labels: element dtype, "
                             "tokens per block, blocks), always 1",
                             labels=["dtype", "block_size", "num_blocks"])
    info.add_metric([limits.kv_cache_dtype, str(limits.block_size), str(limits.num_kv_blocks)], 1)
    yield info


def _kernels_info(limits: EngineLimits) -> Iterator[Metric]:
    """``kthena_kernels_info{mode, source, matmul_decode, ...} 1``: the kernels the engine runs
    (`mooncake_ops.selection`); absent while none has reported."""
    if not limits.kernels:
        return
    names = sorted(limits.kernels)
    info = GaugeMetricFamily("kthena_kernels_info", "The CPU kernels this engine runs and how "
                             "they were chosen (labels), always 1", labels=names)
    info.add_metric([str(limits.kernels[n]) for n in names], 1)
    yield info


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def register_deployment_info(registry: CollectorRegistry, served: Mapping[str, object]) -> None:
    """Add ``kthena_deployment_info`` with ``served``'s keys as labels, value 1, to ``registry``."""
    names = sorted(served)
    info = Gauge("kthena_deployment_info", "The layout this server runs (labels), always 1",
                 names, registry=registry)
    info.labels(*(str(served[n]) for n in names)).set(1)


class ServerMetrics:
    """The metrics of one server (see module docs)."""

    def __init__(self, engine: StatsSource, model_name: str | None = None) -> None:
        """Args: model_name: the served name; if given, vLLM's names are exported too."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.vllm = VllmMetrics(self.registry, model_name) if model_name is not None else None
        self.ttft = Histogram("kthena_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kthena_time_per_output_token_seconds",
                              "Mean time between output tokens of a request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kthena_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("kthena_requests", "Finished requests by reason",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter("kthena_requests_rejected", "Requests refused before any "
                                "token: reason overload (past --max-queue-delay or "
                                "--max-queued-tokens, which limit names), 503 + Retry-After",
                                ["reason", "limit"], registry=self.registry)
        self.hints = Counter("kthena_prefix_hints", "Client prefix hints (reuse_offset) and "
                             "whether token matching agreed with them", ["agreed"],
                             registry=self.registry)
        self.prompts = Counter("kthena_prompts", "Prompts received, by what they let the "
                               "prefix cache do: salted (a cache_salt keys the cache), short (no "
                               "full block before the last token: can never hit), plain",
                               ["cache"], registry=self.registry)

    def set_deployment(self, served: Mapping[str, object]) -> None:
        """``kthena_deployment_info{tp,pp,dp,sp,mode} 1``: the layout this server runs."""
        register_deployment_info(self.registry, served)

    request_log: Callable[[str], None] | None = None  # --enable-log-requests: where lines go

    def observe(self, out: RequestOutput, reuse_offset: int | None = None) -> None:
        """Record a finished request (under both names: the same samples feed both)."""
        reason = out.finish_reason.value if out.finish_reason else "none"
        if self.request_log is not None:
            self.request_log(finished_line(out))
        self.finished.labels(reason).inc()
        if self.vllm is not None:
            self.vllm.finished(reason, num_prompt_tokens=out.num_prompt_tokens)
        if out.first_token_time is None or out.finish_time is None:
            return
        ttft, e2e = out.first_token_time - out.arrival_time, out.finish_time - out.arrival_time
        num_gaps, decode = len(out.token_ids) - 1, out.finish_time - out.first_token_time
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if num_gaps > 0:
            self.tpot.observe(decode / num_gaps)
        if self.vllm is not None:
            self.vllm.latencies(ttft, e2e, num_gaps, decode)
        if reuse_offset is not None:
            self.hints.labels(str(reuse_offset == out.num_cached_tokens).lower()).inc()

    def observe_prompts(self, lengths: Sequence[int], *, salted: bool, block_size: int) -> None:
        """Count one API call's prompts (``kthena_prompts_total{cache}``): a prompt matches
        whole blocks and never its last token, so one of ``block_size`` tokens or fewer can
        never hit."""
        for length in lengths:
            kind = "salted" if salted else "short" if length <= block_size else "plain"
            self.prompts.labels(kind).inc()

    def observe_rejected(self, limit: str) -> None:
        """A request refused at admission past the queue bound ``limit`` (admission.py)."""
        self.rejected.labels("overload", limit).inc()
        if self.vllm is not None:
            self.vllm.rejected()

    def observe_aborted(self, count: int = 1) -> None:
        """Requests (choices) that ended without finishing: client gone, failed, shut down."""
        if count > 0:
            self.finished.labels("abort").inc(count)
            if self.vllm is not None:
                self.vllm.finished("abort", count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def finished_line(out: RequestOutput) -> str:
    """One request's end, for ``--enable-log-requests``."""
    reason = out.finish_reason.value if out.finish_reason else "none"
    timing = ""
    if out.first_token_time is not None and out.finish_time is not None:
        timing = (f", TTFT {out.first_token_time - out.arrival_time:.3f} s, e2e "
                  f"{out.finish_time - out.arrival_time:.3f} s")
    return (f"finished request {out.request_id}: {reason}, {out.num_prompt_tokens} prompt "
            f"tokens ({out.num_cached_tokens} cached), {len(out.token_ids)} output tokens"
            f"{timing}")


def add_collector(app: FastAPI, collector: Collector) -> None:
    """Export ``collector`` (e.g. ``KVEventsCollector``) on the /metrics of an app from
    ``build_app``, next to the server's own metrics."""
    app.state.api.metrics.registry.register(collector)
