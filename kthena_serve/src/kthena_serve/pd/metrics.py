"""Prometheus metrics of PD workers and the router (one registry per process, like the server).

* prefill: ``kthena_pd_prefill_seconds``, ``kthena_pd_handoff_seconds``,
  ``kthena_pd_transferred_bytes``, ``kthena_pd_prefill_cached_tokens`` and
  ``kthena_pd_prefill_batch_size`` (prompts per forward: its count is the forwards run).
* decode: ``kthena_pd_handoff_seconds`` (reserve to admit, as the decode worker sees it),
  ``kthena_pd_transfer_failures{policy,reason}``, ``kthena_pd_requests{path}``.
* router: ``kthena_pd_router_decisions{decision}``, ``kthena_pd_worker_up{worker}``
  (cluster/metrics.py's ``RouterMetrics``, which ``PDMetrics`` extends).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kthena_serve.cluster.metrics import RouterMetrics

__all__ = ["PDMetrics"]

_HANDOFF_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0)

_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class PDMetrics(RouterMetrics):
    """The PD metrics of one process, labelled with its role (the router's families too)."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.handoff = Histogram("kthena_pd_handoff_seconds", "KV handoff time per request "
                                 "(prefill: after compute; decode: reserve to admit)", ["role"],
                                 buckets=_HANDOFF_BUCKETS, registry=r)
        self.prefill = Histogram("kthena_pd_prefill_seconds", "Prefill compute per request",
                                 ["role"], buckets=_HANDOFF_BUCKETS, registry=r)
        self.bytes = Counter("kthena_pd_transferred_bytes", "KV bytes copied or sent in "
                             "handoffs (0 for the zero-copy path)", ["role"], registry=r)
        self.prefill_cached = Counter("kthena_pd_prefill_cached_tokens", "Prompt tokens the "
                                      "prefill worker's own prefix cache supplied", ["role"],
                                      registry=r)
        self.batch_size = Histogram("kthena_pd_prefill_batch_size", "Prompts whose chunks "
                                    "one prefill forward computed", ["role"],
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.failures = Counter("kthena_pd_transfer_failures", "Failed handoffs by policy and "
                                "reason", ["role", "policy", "reason"], registry=r)
        self.requests = Counter("kthena_pd_requests", "Requests by path (disaggregated, local)",
                                ["role", "path"], registry=r)
        super().__init__(role, r)  # the router's families last, where they always were

    def observe_handoff(self, seconds: float, num_bytes: int = 0) -> None:
        self.handoff.labels(self.role).observe(seconds)
        self.bytes.labels(self.role).inc(num_bytes)

    def observe_batch(self, num_seqs: int, num_tokens: int) -> None:
        """One prefill forward of ``num_seqs`` prompts' chunks (``num_tokens`` in all)."""
        self.batch_size.labels(self.role).observe(num_seqs)

    def failure(self, policy: str, reason: str) -> None:
        self.failures.labels(self.role, policy, reason).inc()
