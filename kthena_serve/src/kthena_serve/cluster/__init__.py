"""What every deployment of worker processes shares: PD (``pd/``) and DP (``dp/``) sit on it.

Modules, one concept each (none imports ``pd/`` or ``dp/``; import-linter checks it):

* ``config``    ``Role`` (colocated, prefill, decode) and the router's ``RouterWeights``
* ``auth``      the per-deployment secret workers require, the PD prefill-URL allow-list
* ``events``    KV events on the wire: a worker's ``EventLog``, the codec the router reads
* ``router``    worker registry, health polls, KV-aware + load-aware scoring, the PD decider
* ``metrics``   the router's Prometheus metrics (``RouterMetrics``)
* ``launcher``  ``ProcessLauncher``: worker processes on split cores, restarts, shm clean-up
* ``worker``    a worker process's life: secret, pinning, PDEATHSIG, ready file, state, serving

Nothing is imported here: a worker imports ``cluster.worker`` before torch loads.
"""

__all__: list[str] = []
