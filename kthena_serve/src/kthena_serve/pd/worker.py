"""One PD worker process: ``python -m kthena_serve.pd.worker --role decode|prefill --name NAME
--spec JSON ...``. ``--spec`` is the deployment as a ``ServeSpec``'s JSON (what ``kthena serve
--mode pd`` resolved, or what ``kthena deploy k8s`` rendered): the worker takes its engine, PD
settings, served model name, public metrics and KV events from it; the flags say only where it
runs (address, cores, the hosts it trusts).

It pins itself to its cores and sets ``OMP_NUM_THREADS`` / ``OMP_WAIT_POLICY=PASSIVE``
*before* torch is imported (OpenMP reads them once), loads the model, and serves a small
control API on 127.0.0.1 (or ``--host``):

    decode:  POST /pd/generate (NDJSON outputs)   prefill: POST /pd/prefill, POST /pd/cancel,
                                                           POST /pd/kv/lease, /pd/kv/release
    both:    GET /pd/state (load, KV stats, KV events since a sequence number), /metrics,
             GET /health (the one route without authentication)
             POST /v1/completions, /v1/chat/completions, GET /v1/models, POST /tokenize ...:
             the OpenAI API as the Kthena router's PD connectors call it (kv_transfer_params)

Every control route (``/pd/*``, ``/metrics``) needs ``Authorization: Bearer <secret>``, but
``/metrics`` is open with the spec's ``public_metrics`` (what a pod the Kthena router scrapes runs
with); the secret comes in the environment variable ``KTHENA_PD_SECRET`` (set by the launcher
or the pod's Secret; never on the command line, which other local users can read), and the
worker refuses to start without it. The OpenAI routes need ``Authorization: Bearer <api key>``
when ``KTHENA_API_KEY`` is set (the key the Kthena router is given), and are open otherwise, as
``kthena serve`` is. A decode worker sends prefill tasks and KV leases only to hosts in
``--prefill-hosts`` (default loopback; hosts or networks such as a pod CIDR).

With the spec's ``kv_events`` it publishes its KV cache's router chunks to that Redis under
that owner name (docs/kv_events.md): a decode worker its pool, a prefill worker its own pool.
In a pod the owner is ``$(POD_NAME).$(POD_NAMESPACE)`` (Kubernetes fills it into the spec); the
PD launcher gives each worker ``--pod-name``'s ``NAME-WORKER.NAMESPACE``.

When ready it writes its port to ``--ready-file``. It asks the kernel to send it SIGTERM if
its parent (the launcher) dies, so no worker outlives a killed launcher. That life (secret,
pinning, PDEATHSIG, ready file, serving) is every worker's: cluster/worker.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kthena_serve.cluster.worker import (
    die_with_parent,
    pin_to_cores,
    serve_worker,
    take_secret,
)

if TYPE_CHECKING:
    from kthena_serve.pd.server import OnePort
    from kthena_serve.spec import ServeSpec

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kthena_serve.pd.worker")
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cores", default="", help="comma-separated CPU ids to pin to")
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--spec", default=None,
                        help="the deployment as a ServeSpec's JSON (ServeSpec.to_json); a "
                             "worker reads its engine, pd, served_model_name, public_metrics "
                             "and kv_events (this worker's own owner name)")
    parser.add_argument("--mooncake-host", default=None, help="address Mooncake advertises")
    parser.add_argument("--prefill-hosts", default="127.0.0.1,localhost,::1",
                        help="comma-separated hosts (or networks, 10.0.0.0/8) a decode worker "
                             "may send prefill tasks and KV leases to")
    parser.add_argument("--advertise-host", default=None,
                        help="address decode workers reach this prefill worker at "
                             "(remote_host; default: --mooncake-host, else --host)")
    return parser.parse_args(argv)


def _spec(args: argparse.Namespace) -> ServeSpec:
    """``--spec`` as a ``ServeSpec``; its KV events' Redis client is imported here, so that a
    missing extra is one message before the model loads.

    Raises:
        ValueError: not a ServeSpec's JSON, or a value its types refuse (the message says
            which). ImportError: redis-py is missing (the message names the extra).
    """
    import json

    import attrs

    from kthena_serve.spec import ServeSpec

    if args.spec is None:
        raise ValueError("--spec is required: the deployment as a ServeSpec's JSON (the PD "
                         "launcher and `kthena deploy k8s` give it)")
    try:
        fields = json.loads(args.spec)
    except json.JSONDecodeError as error:
        raise ValueError(f"--spec: not JSON ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--spec: a ServeSpec's JSON object, got {type(fields).__name__}")
    try:
        spec = ServeSpec.from_json(fields)
    except ValueError as error:
        raise ValueError(f"--spec: {error}") from None
    engine = attrs.evolve(spec.engine, tp=spec.pd.role_tp(args.role, spec.engine.tp))
    if engine.pp > 1:
        raise ValueError(f"--spec: a PD worker of pp={engine.pp} is not run: the hand-off "
                         "moves KV heads between TP ranks, not layers between stages; give "
                         "the role pp=1 (deploy.yaml's pd.<role>.pp)")
    if engine.tp > 1 and (engine.device != "cpu" or engine.ranks_from != "spawn"):
        raise ValueError(f"--spec: a PD worker of tp={engine.tp} runs its ranks as spawned "
                         "processes on cpu (their pools are /dev/shm files), not "
                         f"device={engine.device!r} with ranks_from={engine.ranks_from!r}; "
                         "give the role tp=1")
    spec = attrs.evolve(spec, engine=engine)
    if spec.kv_events is not None:
        from kthena_serve.kv_events.publisher import import_redis

        import_redis()
    return spec


def _take_api_key() -> str | None:
    """The OpenAI routes' API key (``KTHENA_API_KEY``), removed from the environment too."""
    return os.environ.pop("KTHENA_API_KEY", None) or None


def _advertised(args: argparse.Namespace) -> str:
    """The host decode workers reach this worker at: a wildcard bind is resolved by name."""
    host = args.advertise_host or args.mooncake_host or args.host
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = socket.gethostbyname(socket.gethostname())
    return host


def main(argv: list[str] | None = None) -> int:
    """Run one PD worker until SIGTERM; 2 without the deployment secret, or with a setting the
    engine refuses (one line on stderr)."""
    args = _parse(argv)
    secret = take_secret()
    api_key = _take_api_key()
    if secret is None:
        print(f"kthena_serve.pd.worker {args.name}: KTHENA_PD_SECRET is not set; workers are "
              "started by the PD launcher, which sets it", file=sys.stderr)
        return 2
    num_threads = pin_to_cores(args.cores)  # first: the imports below load torch
    die_with_parent()
    try:
        spec = _spec(args)
    except (ValueError, ImportError) as error:
        print(f"kthena_serve.pd.worker {args.name}: {error}", file=sys.stderr)
        return 2
    try:
        app, close = _build_app(args, spec, secret, api_key, num_threads)
    except ValueError as error:  # a setting the engine refuses (e.g. a pool that holds no block)
        print(f"kthena_serve.pd.worker {args.name}: error: {error}", file=sys.stderr)
        return 2

    dead_rank = getattr(app.state, "dead_rank", None)
    if dead_rank is not None:
        _watch_ranks(args.name, dead_rank)

    def ready(port: int) -> None:
        on_port = getattr(app.state, "on_port", None)
        if on_port is not None:  # a prefill worker names its port in kv_transfer_params
            on_port(port)
        print(f"pd worker {args.name} ({args.role}) on {args.host}:{port}, "
              f"{num_threads} threads", file=sys.stderr, flush=True)

    serve_worker(app, host=args.host, port=args.port, ready_file=args.ready_file,
                 on_ready=ready, close=close)
    return 0


def _watch_ranks(name: str, dead_rank: Callable[[], Exception | None]) -> None:
    """A TP worker stops itself (SIGTERM) as soon as one of its ranks has died: a forward
    needs every rank, and the launcher (or the pod) starts the worker again, ranks and all."""
    import signal
    import threading
    import time

    def watch() -> None:
        while (error := dead_rank()) is None:
            time.sleep(0.2)
        print(f"kthena_serve.pd.worker {name}: {error}; stopping this worker so that it is "
              "started again", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kthena-rank-watch", daemon=True).start()


def _build_app(args: argparse.Namespace, spec: ServeSpec, secret: str, api_key: str | None,
               num_threads: int) -> tuple[OnePort, Callable[[], None]]:
    """The decode or prefill worker's app (pd/decode_server.py, pd/prefill_server.py) and
    what closes it."""
    import attrs

    from kthena_serve.pd.decode_server import build_decode_app
    from kthena_serve.pd.prefill_server import build_prefill_app

    engine_config = attrs.evolve(spec.engine, num_threads=num_threads)
    common = {"secret": secret, "mooncake_host": args.mooncake_host, "api_key": api_key,
              "served_model_name": spec.served_model_name,
              "public_metrics": spec.public_metrics, "kv_events": spec.kv_events}
    if args.role == "decode":
        hosts = [h.strip() for h in args.prefill_hosts.split(",") if h.strip()]
        return build_decode_app(args.name, engine_config, spec.pd, prefill_hosts=hosts,
                                **common)
    return build_prefill_app(args.name, engine_config, spec.pd,
                             advertise_host=_advertised(args), **common)

if __name__ == "__main__":
    sys.exit(main())
