"""Prometheus metrics of the router (cluster/router.py), in a registry of their own by default.

* ``kthena_pd_router_decisions{role,decision}``: ``Router.choose``'s decisions
  (``disaggregated``, ``short_prompt``, ``no_prefill_worker``).
* ``kthena_pd_worker_up{role,worker}``: 1 while a worker passes health checks.

The names keep their ``kthena_pd_`` prefix (dashboards scrape them from the PD router); a PD
process's ``PDMetrics`` (pd/metrics.py) is a ``RouterMetrics`` with the PD families added.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["RouterMetrics"]


class RouterMetrics:
    """The router's metrics, labelled with ``role`` (see module docs).

    Args:
        role: the ``role`` label of every sample (``router`` for the router).
        registry: where the families go (default: a registry of their own).
    """

    def __init__(self, role: str = "router", registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter("kthena_pd_router_decisions", "Router decisions", ["role",
                                 "decision"], registry=self.registry)
        self.worker_up = Gauge("kthena_pd_worker_up", "1 while a worker passes health checks",
                               ["role", "worker"], registry=self.registry)

    def decision(self, decision: str) -> None:
        """Count one ``Router.choose`` decision."""
        self.decisions.labels(self.role, decision).inc()

    def set_up(self, worker: str, is_up: bool) -> None:
        """``kthena_pd_worker_up{worker}``: 1 while ``worker`` passes health checks."""
        self.worker_up.labels(self.role, worker).set(int(is_up))

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
