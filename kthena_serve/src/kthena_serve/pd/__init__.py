"""PD disaggregation: prefill and decode workers, the handoff between them, and a router.

See docs/pd.md. It sits on ``kthena_serve.cluster`` (what PD and DP share: the router, the
launcher base, worker lifecycle, auth, the KV events wire). Modules, one concept each:

* ``config``    the PD knobs (failure policy, timeouts, transport, threshold); ``Role`` and
  ``RouterWeights`` re-exported from cluster/config.py
* ``protocol``  the control messages that cross between workers (no KV bytes)
* ``prefill``   the prefill executor: paged prefill straight into the decode worker's blocks
* ``decode``    the decode side: reserve blocks, call a prefill worker, admit or recover
* ``transfer``  the cross-host path: Mooncake one-sided put of a request's blocks
* ``server``    what both workers' HTTP apps share (one port: control API + OpenAI routes)
* ``decode_server``, ``prefill_server``  each role's app: its parts and its route class
* ``prefill_job``  one queued prefill's state (the executor's queue entry)
* ``worker``    one worker process (``python -m kthena_serve.pd.worker``) for either role
* ``kv_params`` ``kv_transfer_params`` as the Kthena router's nixl / mooncake connectors carry it
* ``pins``      a prefill worker's blocks kept for a decode worker to pull, with deadlines
* ``prefill_connector``, ``decode_connector``  each worker's side of that protocol on its OpenAI routes
* ``rank_pull`` that protocol's pull where either worker is a TP engine: heads copied between
  the ranks' /dev/shm pools (shm), or got between their Mooncake-registered pools (mooncake)
* ``frontend``  the router's OpenAI front: ``RemoteEngine`` over the cluster router
* ``launcher``  ``PDLauncher``: the PD workers on split cores (prefill first)
* ``cluster``   ``PDCluster``: launcher + router + OpenAI server in one object
* ``serve``     ``kthena serve --mode pd``: workers + router until SIGTERM
* ``metrics``   Prometheus metrics per role

Its benchmarks live in ``kthena_serve.bench`` (``pd``, ``kv_move``); the router's connector
request sequence in Python, in the tests (``kthena_serve/tests/_kthena_proxy.py``).
"""

from kthena_serve.pd.config import FailurePolicy, PDConfig, Role, RouterWeights

__all__ = ["FailurePolicy", "PDConfig", "Role", "RouterWeights"]
