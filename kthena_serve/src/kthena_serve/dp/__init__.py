"""Data-parallel serving: ``kthena serve --dp N``, N whole engines behind one router.

See docs/kthena_serve.md ("Data-parallel replicas"). Modules, one concept each:

* ``launcher``  starts the replica processes on split cores (the PD launcher's base)
* ``replica``   one replica process: a colocated engine, the OpenAI app, ``/dp/state``
* ``frontend``  the router's OpenAI front: tokenise, pick a replica, relay its answer
* ``metrics``   the router's ``kthena_dp_*`` metrics and the replicas' under one scrape
* ``serve``     ``run_dp``: replicas + router + front until SIGTERM; the flag checks

The choice itself is the PD router's (pd/router.py ``Router.pick``): prefix overlap from the
replicas' KV events, then load, then KV usage.
"""

__all__: list[str] = []
