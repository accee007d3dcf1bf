"""PD disaggregation: prefill and decode workers, the handoff between them, and a router.

See docs/pd.md. Modules, one concept each:

* ``config``    roles, the PD knobs (failure policy, timeouts, router weights, threshold)
* ``protocol``  the control messages that cross between workers (no KV bytes)
* ``prefill``   the prefill executor: paged prefill straight into the decode worker's blocks
* ``decode``    the decode side: reserve blocks, call a prefill worker, admit or recover
* ``transfer``  the cross-host path: Mooncake one-sided put of a request's blocks
* ``worker``    one worker process (HTTP control API) for any role
* ``auth``      the per-deployment secret workers require, the prefill-URL allow-list
* ``kv_params`` ``kv_transfer_params`` as the Kthena router's nixl / mooncake connectors carry it
* ``pins``      a prefill worker's blocks kept for a decode worker to pull, with deadlines
* ``prefill_api``, ``decode_api``  each worker's side of that protocol on its OpenAI routes
* ``router``    worker registry, health checks, KV-aware + load-aware scoring, PD decider
* ``launcher``  starts the workers on split cores, restarts them, cleans their shared memory
* ``metrics``   Prometheus metrics per role

Its benchmarks live in ``kthena_serve.bench`` (``pd``, ``kv_move``); the router's connector
request sequence in Python, in the tests (``kthena_serve/tests/_kthena_proxy.py``).
"""

from kthena_serve.pd.config import FailurePolicy, PDConfig, Role, RouterWeights

__all__ = ["FailurePolicy", "PDConfig", "Role", "RouterWeights"]
