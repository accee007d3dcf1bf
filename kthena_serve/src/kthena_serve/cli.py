"""``kthena serve``: registered on kthena_core's CLI by an entry point (``kthena bench serve``,
``soak``, ``layouts`` and ``kv`` are registered by ``kthena_serve.bench.cli``).

This module reads argv only: its flags become a ``ServeSpec`` (``spec_from_args``), which
``kthena_serve.deployment.serve`` runs. The environment an entry point reads (``KTHENA_API_KEY``,
WORLD_SIZE, ``OMP_WAIT_POLICY``) is read there, before torch is imported.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kthena_serve.deployment import api_key, launcher_world, prepare_process, resolve_spec, serve
from kthena_serve.pd.serve import add_pd_args
from kthena_serve.serve_args import (
    add_api_key_args,
    add_connection_args,
    add_engine_args,
    add_kv_events_args,
    add_public_metrics_arg,
    add_structured_output_args,
    add_tool_args,
)

if TYPE_CHECKING:
    from kthena_serve.spec import ServeSpec

__all__ = ["register_serve", "spec_from_args"]


# ---- kthena serve -------------------------------------------------------------------------------
_NOT_SETTINGS = ("command", "func", "api_key_file")  # in the namespace, but not ServeSpec settings


def register_serve(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kthena.commands``): add ``kthena serve``.

    Its flags have no argparse defaults (``argument_default=SUPPRESS``): the namespace holds
    exactly the flags given, which ``ServeSpec.resolve`` puts over the config and the defaults.
    """
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API",
                                   argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="a kthena_config.yaml: plan it (cluster.topology, default: this "
                             "machine), print the plan and serve exactly that plan; flags given "
                             "explicitly on the command line override the config "
                             "(docs/kthena_core.md lists what each key drives)")
    parser.add_argument("--calibration", metavar="FILE.json",
                        help="with --config: score the plan with this calibration file's "
                             "factors (`kthena plan --calibrate` writes it; 'none': the "
                             "defaults; default: this machine's cached one when the config's "
                             "topology is auto); GET /plan shows the factors used")
    add_engine_args(parser)
    parser.add_argument("--host", help="address to bind (default 127.0.0.1, loopback)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000)")
    add_api_key_args(parser, "require 'Authorization: Bearer KEY'")
    add_public_metrics_arg(parser, "the API key")
    parser.add_argument("--served-model-name",
                        help="the model id clients send (default: the --model folder's or "
                             "file's name, or the repo id ORG/NAME)")
    parser.add_argument("--shutdown-timeout", type=float,
                        help="on SIGTERM: seconds running requests may take to finish before "
                             "they are ended with an error event (default 30)")
    parser.add_argument("--stream-stall-timeout", type=_positive_seconds,
                        help="colocated: a stream whose client reads nothing for this long "
                             "(its request paused by backpressure) is stopped and its KV blocks "
                             "freed (default 120; PD decode workers use 120)")
    parser.add_argument("--mode", choices=("colocated", "pd"),
                        help="colocated (default) or pd: separate prefill and decode worker "
                             "processes behind a router")
    parser.add_argument("--dp", "--data-parallel-size", type=int,
                        help="colocated: data-parallel replicas (whole engines, each of tp x pp "
                             "ranks) behind one prefix- and load-aware router on --port "
                             "(default 1)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (prompt / generation throughput, running "
                             "and waiting requests, KV usage, prefix hit rate; every 10 s, "
                             "$KTHENA_LOG_STATS_INTERVAL to change) (default: off, the line "
                             "is printed)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="print a line per request received (id, prompt tokens, sampling "
                             "parameters) and finished (reason, tokens, latency) (default: off)")
    parser.add_argument("--no-engine-process", action="store_true",
                        help="run the engine on a thread of the API process (default: off; "
                             "one colocated rank without --kv-events runs its engine in a "
                             "process of its own, every other layout on a thread)")
    add_tool_args(parser)
    add_structured_output_args(parser)
    add_connection_args(parser)
    add_kv_events_args(parser)
    add_pd_args(parser)
    parser.set_defaults(func=_cmd_serve)


def spec_from_args(args: argparse.Namespace, world_size: int = 1) -> ServeSpec:
    """The ``ServeSpec`` of a parsed ``kthena serve`` command line (the API key read from the
    flag, its file or the environment).

    Raises:
        ValueError: a bad config, an unservable plan, or a refused flag.
    """
    given = vars(args)
    flags = {k: v for k, v in given.items() if k not in _NOT_SETTINGS}
    flags["api_key"] = api_key(given)
    return resolve_spec(flags, flags.pop("config", None), world_size,
                        calibration=flags.pop("calibration", None))


def _cmd_serve(args: argparse.Namespace) -> int:
    prepare_process()
    try:
        spec = spec_from_args(args, launcher_world())
        if spec.engine.world_size > 1 or spec.engine.ranks_from == "env":
            from kthena_serve.engine.placement import dist_backend

            dist_backend(spec.engine.device)  # a KTHENA_DIST_BACKEND it cannot take: one line
        if spec.kv_events is not None:
            from kthena_serve.kv_events.publisher import import_redis

            import_redis()  # a missing extra is one message, before the model loads
    except (ValueError, ImportError) as error:
        print(f"kthena serve: {error}", file=sys.stderr)
        return 2
    return serve(spec)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value
