"""PD disaggregation: prefill and decode workers, the handoff between them, and a router.

See docs/pd.md. Modules, one concept each:

* ``config``    roles, the PD knobs (failure policy, timeouts, router weights, threshold)
* ``protocol``  the control messages that cross between workers (no KV bytes)
* ``prefill``   the prefill executor: paged prefill straight into the decode worker's blocks
* ``decode``    the decode side: reserve blocks, call a prefill worker, admit or recover
* ``transfer``  the cross-host path: Mooncake one-sided put of a request's blocks
* ``worker``    one worker process (HTTP control API) for any role
* ``auth``      the per-deployment secret workers require, the prefill-URL allow-list
* ``router``    worker registry, health checks, KV-aware + load-aware scoring, PD decider
* ``launcher``  starts the workers on split cores, restarts them, cleans their shared memory
* ``metrics``   Prometheus metrics per role
"""

from kthena_serve.pd.config import FailurePolicy, PDConfig, Role, RouterWeights

__all__ = ["FailurePolicy", "PDConfig", "Role", "RouterWeights"]
