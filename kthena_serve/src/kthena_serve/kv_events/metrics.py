"""The publisher's counters as Prometheus metrics, read at scrape time (``kthena_kv_events_*``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kthena_serve.kv_events.publisher import RedisKVPublisher

__all__ = ["KVEventsCollector"]


# (metric name, stats field, help): counters since start, then the one gauge.
_COUNTERS = (
    ("kthena_kv_events_published_keys", "num_published_keys", "Router chunk fields written to "
     "Redis (HSET) as chunks became held or after a Redis failure"),
    ("kthena_kv_events_removed_keys", "num_removed_keys", "Router chunk fields removed from "
     "Redis (HDEL) on eviction and at shutdown"),
    ("kthena_kv_events_dropped_events", "num_dropped_events", "KV events dropped because the "
     "publisher queue was full (the engine never waits)"),
    ("kthena_kv_events_redis_errors", "num_redis_errors", "Failed Redis round trips of the KV "
     "event publisher"),
)


class KVEventsCollector:
    """A prometheus_client collector over one ``RedisKVPublisher``."""

    def __init__(self, publisher: RedisKVPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        stats = self.publisher.stats()
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        yield GaugeMetricFamily(
            "kthena_kv_events_held_chunks", "Router chunks the KV cache holds whole now",
            value=stats.num_held_chunks)
