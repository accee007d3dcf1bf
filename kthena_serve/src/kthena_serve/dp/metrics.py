"""Prometheus metrics of the DP router, and its replicas' own metrics in the same scrape.

The router's families (its own registry):

* ``kthena_dp_routed_requests_total{replica, reason}``: completions and chat requests sent to
  each replica; ``reason`` is ``prefix`` (the router's index has leading blocks of the prompt
  on that replica) or ``load`` (it had none: load and KV usage chose).
* ``kthena_dp_replica_failures_total{replica}``: calls that failed on the wire (refused, reset,
  cut mid-stream); the replica is then out of rotation until a poll of it succeeds.
* ``kthena_dp_rejected_requests_total{reason}``: calls the router refused itself (503 +
  ``Retry-After``): ``overload``, every replica up reported (or the router's own queue for it
  holds) a queue past its bound; ``queue_timeout``, a stream with no first token by its
  deadline (dp/frontend.py).
* ``kthena_dp_passed_on_total{replica}``: calls a replica refused past its queue bound (503
  ``overloaded``) that the router sent to another replica.
* ``kthena_dp_replica_up{replica}``, ``kthena_dp_replica_in_flight{replica}``: read from the
  router when scraped.
* ``kthena_deployment_info{tp,pp,dp,sp,mode} 1``: the layout served, as ``kthena serve`` exports
  it (the replicas do not, so the family appears once).

``merge_replica_metrics`` turns each replica's /metrics text into one exposition with a
``replica`` label on every sample: each ``kthena_*`` / ``vllm:*`` family appears once, and each
sample is what that replica measured (sum over ``replica`` in PromQL for the deployment).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kthena_serve.server.metrics import register_deployment_info

__all__ = ["DPMetrics", "merge_replica_metrics"]


class _Families:
    """A collector that yields fixed families (what a scrape of the replicas returned)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        yield from self.families


class _ReplicaGauges:
    """``kthena_dp_replica_up`` and ``_in_flight``, read from the router's replica states."""

    def __init__(self, workers: Mapping) -> None:
        self.workers = workers

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("kthena_dp_replica_up", "1 while a replica passes health "
                               "checks and takes requests", labels=["replica"])
        in_flight = GaugeMetricFamily("kthena_dp_replica_in_flight", "Requests the router "
                                      "sent to a replica that have not ended", labels=["replica"])
        for name, worker in sorted(self.workers.items()):
            up.add_metric([name], int(worker.is_up))
            in_flight.add_metric([name], worker.num_in_flight)
        yield up
        yield in_flight


class DPMetrics:
    """The router's metrics (see module docs).

    Args:
        workers: the router's replica states by name (``Router.workers``).
    """

    def __init__(self, workers: Mapping) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter("kthena_dp_routed_requests", "Completions and chat requests "
                              "sent to each replica, by why it was chosen (prefix, load)",
                              ["replica", "reason"], registry=self.registry)
        self.failures = Counter("kthena_dp_replica_failures", "Calls to a replica that "
                                "failed on the wire", ["replica"], registry=self.registry)
        self.rejected = Counter("kthena_dp_rejected_requests", "Calls the router refused "
                                "itself, by reason (overload: every replica past its queue "
                                "bound; queue_timeout: no first token by the deadline)", ["reason"], registry=self.registry)
        self.passed_on = Counter("kthena_dp_passed_on", "Calls a replica refused past its "
                                 "queue bound that went to another replica", ["replica"],
                                 registry=self.registry)
        self.registry.register(_ReplicaGauges(workers))

    def set_deployment(self, served: Mapping[str, object]) -> None:
        """``kthena_deployment_info{tp,pp,dp,sp,mode} 1``: the layout this deployment runs."""
        register_deployment_info(self.registry, served)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_replica_metrics(texts: Mapping[str, str]) -> bytes:
    """One exposition of several replicas' /metrics texts, each sample labelled ``replica``.

    Args:
        texts: replica name -> the text its /metrics returned.

    Raises:
        ValueError: a text is not in the Prometheus text format.
    """
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            merged.samples.extend(
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp,
                       s.exemplar) for s in family.samples)
    if not families:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)
