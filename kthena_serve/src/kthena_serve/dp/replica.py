"""One data-parallel replica: ``python -m kthena_serve.dp.replica --name replica-0 ...``.

A whole colocated engine (its own KV pool, ``tp x pp`` ranks) behind the plain OpenAI app of
``kthena serve``, on 127.0.0.1 and a port the kernel picks, plus one route for the router::

    GET /dp/state?since=SEQ   load, KV stats, limits, and the KV events after SEQ (block
                              hashes only, as a PD worker's /pd/state: pd/events.py)

Every route but ``/health`` needs the deployment secret (``Authorization: Bearer``): the
launcher passes it in ``KTHENA_PD_SECRET`` (the environment, never argv), and the replica uses
it as its app's API key, so only the router that started it can call it. The public API key is
the router's business.

Before torch loads it pins itself to ``--cores`` and sets ``OMP_WAIT_POLICY=PASSIVE`` and
``OMP_NUM_THREADS`` (the cores divided among its ``--ranks``: one thread per core a rank owns);
it asks the kernel for SIGTERM if its launcher dies, and writes its port to ``--ready-file``
once it listens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["build_replica_app", "main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kthena_serve.dp.replica")
    parser.add_argument("--name", required=True)
    parser.add_argument("--cores", default="", help="comma-separated CPU ids to pin to")
    parser.add_argument("--ranks", type=int, default=1, help="tp x pp ranks of the engine")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--engine-config", default="{}", help="EngineConfig fields as JSON")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--stream-stall-timeout", type=float, default=None)
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    return parser.parse_args(argv)


def _pin(cores: str, num_ranks: int) -> int:
    """Affinity and OpenMP settings (before torch is imported); returns threads per rank."""
    from kthena_serve.threads import owned_cores, prepare_worker_env

    ids = {int(c) for c in cores.split(",") if c.strip()}
    if ids and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, ids)
    num_threads = max(1, len(owned_cores()) // max(1, num_ranks))
    prepare_worker_env(os.environ, num_threads)
    return num_threads


def _die_with_parent() -> None:
    """SIGTERM when the launcher dies (PR_SET_PDEATHSIG), so no replica outlives it."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def build_replica_app(engine, name: str, served_model_name: str, aliases: set[str],  # noqa: ANN001
                      secret: str):  # noqa: ANN201
    """The OpenAI app over a started ``AsyncLLM``, keyed by ``secret``, plus ``/dp/state``.

    Subscribes to the engine's KV events: call it before the engine serves a request.
    """
    import attrs

    from kthena_serve.pd.events import EventLog
    from kthena_serve.server import build_app

    events = EventLog(engine.kv_cache)
    incarnation = f"{os.getpid()}-{time.time_ns()}"
    app = build_app(engine, model_name=served_model_name, aliases=aliases, api_key=secret)

    @app.get("/dp/state")
    async def state(since: int = 0) -> dict:
        stats = engine.stats()
        first, last, items = events.since(since)
        return {"name": name, "role": "colocated", "incarnation": incarnation,
                "alive": engine.is_alive, "num_running": stats.num_running,
                "num_waiting": stats.num_waiting, "kv": attrs.asdict(stats.kv),
                "stats": stats.to_json(), "limits": attrs.asdict(engine.limits()),
                "first_seq": first, "last_seq": last, "events": items}

    return app


def _write_port(path: str | None, port: int) -> None:
    if path:
        with open(f"{path}.tmp", "w") as f:
            f.write(str(port))
        os.replace(f"{path}.tmp", path)


def _tidy_orphan(path: str | None) -> None:
    """The launcher died without stopping us: remove our ready file and, if we are the last,
    its folder."""
    if not path:
        return
    for remove in (os.remove, lambda p: os.rmdir(os.path.dirname(p))):
        try:
            remove(path)
        except OSError:  # gone already, or another replica's file is still there
            return


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    num_threads = _pin(args.cores, args.ranks)  # first: the imports below load torch
    _die_with_parent()
    from kthena_serve.pd.auth import SECRET_ENV

    secret = os.environ.pop(SECRET_ENV, None)  # removed, so no child inherits it
    if not secret:
        print(f"kthena_serve.dp.replica {args.name}: {SECRET_ENV} is not set; replicas are "
              "started by `kthena serve --dp N`, which sets it", file=sys.stderr)
        return 2

    from kthena_serve.async_engine import STALL_TIMEOUT_S, AsyncLLM
    from kthena_serve.config import EngineConfig
    from kthena_serve.pd.worker import exit_on_sigterm
    from kthena_serve.server import run_server

    fields = json.loads(args.engine_config)
    if fields.get("tp", 1) * fields.get("pp", 1) == 1:
        fields["num_threads"] = num_threads
    config = EngineConfig.from_json(fields)
    engine = AsyncLLM.from_config(config, stall_timeout=args.stream_stall_timeout
                                  or STALL_TIMEOUT_S)
    served = args.served_model_name
    app = build_replica_app(engine, args.name, served, {config.model, "default"} - {served},
                            secret)
    engine.start()

    def ready(port: int) -> None:
        _write_port(args.ready_file, port)
        print(f"dp replica {args.name} on 127.0.0.1:{port}, cores {args.cores}, "
              f"{num_threads} thread(s) per rank", file=sys.stderr, flush=True)

    exit_on_sigterm()
    launcher_pid = os.getppid()
    try:
        run_server(app, host="127.0.0.1", port=args.port, on_ready=ready, log_level="warning",
                   shutdown_timeout=args.shutdown_timeout,
                   on_deadline=lambda: engine.abort_all("the replica is stopping"))
    except SystemExit:
        pass
    finally:
        engine.shutdown()
        if os.getppid() != launcher_pid:
            _tidy_orphan(args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
