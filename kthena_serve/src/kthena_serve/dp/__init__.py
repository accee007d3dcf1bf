"""Data-parallel serving: ``kthena serve --dp N``, N whole engines behind one router.

See docs/kthena_serve.md ("Data-parallel replicas"). It sits on ``kthena_serve.cluster`` (the
router, the launcher base, worker lifecycle, auth, the KV events wire) and imports nothing of
``pd/``. Modules, one concept each:

* ``launcher``  ``ReplicaLauncher``: the replica processes on split cores (cluster's launcher)
* ``replica``   one replica process: a colocated engine, the OpenAI app, ``/dp/state``
* ``frontend``  the router's OpenAI front: tokenise, pick a replica, relay its answer
* ``metrics``   the router's ``kthena_dp_*`` metrics and the replicas' under one scrape
* ``serve``     ``run_dp``: replicas + router + front until SIGTERM; the flag checks

The choice itself is the cluster router's (cluster/router.py ``Router.pick``): prefix overlap
from the replicas' KV events, then load, then KV usage.
"""

__all__: list[str] = []
