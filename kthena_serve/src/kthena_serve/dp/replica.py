"""One data-parallel replica: ``python -m kthena_serve.dp.replica --name replica-0 ...``.

A whole colocated engine (its own KV pool, ``tp x pp`` ranks) behind the plain OpenAI app of
``kthena serve``, on 127.0.0.1 and a port the kernel picks, plus one route for the router::

    GET /dp/state?since=SEQ   load, KV stats, limits, and the KV events after SEQ (block
                              hashes only, as a PD worker's /pd/state: cluster/events.py)

Every route but ``/health`` needs the deployment secret (``Authorization: Bearer``): the
launcher passes it in ``KTHENA_PD_SECRET`` (the environment, never argv), and the replica uses
it as its app's API key, so only the router that started it can call it. The public API key is
the router's business.

Before torch loads it pins itself to ``--cores`` and sets ``OMP_WAIT_POLICY=PASSIVE`` and
``OMP_NUM_THREADS`` (the cores divided among its ``--ranks``: one thread per core a rank owns);
it asks the kernel for SIGTERM if its launcher dies, and writes its port to ``--ready-file``
once it listens. That life is every worker's (cluster/worker.py); a replica's SIGTERM is a
clean stop (status 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING

from kthena_serve.cluster.auth import SECRET_ENV
from kthena_serve.cluster.worker import (
    die_with_parent,
    new_incarnation,
    pin_to_cores,
    serve_worker,
    state_reply,
    take_secret,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kthena_serve.async_engine import AsyncLLM

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
    parser.add_argument("--tool-call-parser", default="hermes")
    parser.add_argument("--any-whitespace", action="store_true",
                        help="JSON constraints that do not say allow whitespace "
                             "(--structured-outputs-config's disable_any_whitespace false)")
    parser.add_argument("--stream-stall-timeout", type=float, default=None)
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    return parser.parse_args(argv)


def build_replica_app(engine: AsyncLLM, name: str, served_model_name: str, aliases: set[str],
                      secret: str, *, tool_call_parser: str = "hermes",
                      disable_any_whitespace: bool = True) -> FastAPI:
    """The OpenAI app over a started ``AsyncLLM``, keyed by ``secret``, plus ``/dp/state``.

    Subscribes to the engine's KV events: call it before the engine serves a request.
    ``tool_call_parser``, ``disable_any_whitespace``: the deployment's ``--tool-call-parser``
    and ``--structured-outputs-config`` (the replica reads requests and parses chat output;
    the router relays them).
    """
    from kthena_serve.cluster.events import EventLog
    from kthena_serve.server import build_app

    events = EventLog(engine.kv_cache)
    incarnation = new_incarnation()
    app = build_app(engine, model_name=served_model_name, aliases=aliases, api_key=secret,
                    tool_call_parser=tool_call_parser,
                    disable_any_whitespace=disable_any_whitespace)

    @app.get("/dp/state")
    async def state(since: int = 0) -> dict:
        return state_reply(name, "colocated", incarnation, alive=engine.is_alive,
                           stats=engine.stats(), events=events, since=since,
                           limits=engine.processor.limits)

    return app


def main(argv: list[str] | None = None) -> int:
    """Run one replica until SIGTERM (then 0); 2 without the deployment secret, or with a
    setting the engine refuses (one line on stderr)."""
    args = _parse(argv)
    num_threads = pin_to_cores(args.cores, args.ranks)  # first: the imports below load torch
    die_with_parent()
    secret = take_secret()
    if secret is None:
        print(f"kthena_serve.dp.replica {args.name}: {SECRET_ENV} is not set; replicas are "
              "started by `kthena serve --dp N`, which sets it", file=sys.stderr)
        return 2

    from kthena_serve.async_engine import STALL_TIMEOUT_S, AsyncLLM
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.spec import model_aliases

    fields = json.loads(args.engine_config)
    if fields.get("tp", 1) * fields.get("pp", 1) == 1:
        fields["num_threads"] = num_threads
    try:
        config = EngineConfig.from_json(fields)
        engine = AsyncLLM.from_config(config, stall_timeout=args.stream_stall_timeout
                                      or STALL_TIMEOUT_S)
    except ValueError as error:  # a setting the engine refuses (e.g. a pool that holds no block)
        print(f"kthena_serve.dp.replica {args.name}: error: {error}", file=sys.stderr)
        return 2
    served = args.served_model_name
    app = build_replica_app(engine, args.name, served, model_aliases(config.model, served),
                            secret, tool_call_parser=args.tool_call_parser,
                            disable_any_whitespace=not args.any_whitespace)
    engine.start()

    def ready(port: int) -> None:
        print(f"dp replica {args.name} on 127.0.0.1:{port}, cores {args.cores}, "
              f"{num_threads} thread(s) per rank", file=sys.stderr, flush=True)

    with contextlib.suppress(SystemExit):  # SIGTERM: the launcher's clean stop
        serve_worker(app, host="127.0.0.1", port=args.port, ready_file=args.ready_file,
                     on_ready=ready, close=engine.shutdown,
                     shutdown_timeout=args.shutdown_timeout,
                     on_deadline=lambda: engine.abort_all("the replica is stopping"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
