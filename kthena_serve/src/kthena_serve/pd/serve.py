"""``python -m kthena_serve.pd.serve`` / ``kthena serve --mode pd``: workers + router on one host.

Starts ``--prefill N`` and ``--decode M`` worker processes (launcher.py) and serves the
OpenAI API from the router in this process; clients see the same API as ``kthena serve``.
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs

from kthena_serve.serve_args import (
    SHUTDOWN_MESSAGE,
    add_engine_args,
    add_public_metrics_arg,
    curl_line,
    engine_config,
    model_name,
)

__all__ = ["add_pd_args", "engine_fields", "main", "run_pd"]


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    """The PD flags (``kthena serve --mode pd`` shares them)."""
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (PD mode)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (PD mode)")
    parser.add_argument("--pd-policy", default="recompute", choices=("recompute", "fail"),
                        help="what a failed KV handoff does")
    parser.add_argument("--pd-timeout", type=float, default=30.0,
                        help="seconds a prefill + handoff may take")
    parser.add_argument("--pd-transport", default="shm", choices=("shm", "mooncake"))
    parser.add_argument("--pd-kv-push", default="layerwise", choices=("layerwise", "batched"),
                        help="with --pd-transport mooncake: put each layer's KV blocks while the "
                             "prefill goes on, or all blocks after it")
    parser.add_argument("--pd-threshold", type=int, default=32,
                        help="uncached prompt tokens below which the decode worker prefills")
    parser.add_argument("--router-weights", default="1.0,0.5,0.25",
                        help="overlap,load,kv_usage score weights")


def _pd_fields(args: argparse.Namespace) -> dict:
    overlap, load, kv = (float(x) for x in args.router_weights.split(","))
    return {"policy": args.pd_policy, "transfer_timeout_s": args.pd_timeout,
            "transport": args.pd_transport, "kv_push": args.pd_kv_push,
            "pd_threshold_tokens": args.pd_threshold,
            "weights": {"overlap": overlap, "load": load, "kv_usage": kv}}


def engine_fields(config) -> dict:  # noqa: ANN001
    """``EngineConfig`` fields as JSON for the workers (every field: nothing is dropped)."""
    return attrs.asdict(config)


def run_pd(args: argparse.Namespace, config, served_name: str) -> int:  # noqa: ANN001
    """Launch workers and serve the router until interrupted.

    Returns 2 (with a message) for a layout PD cannot run: ``tp`` or ``pp > 1`` on the workers.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if config.tp > 1:
        print(f"kthena serve --mode pd: --tp {config.tp} is not supported in PD mode: a prefill "
              "worker writes a decode worker's whole KV pool, and a TP decode worker's pool is "
              "split across ranks. Use --tp 1 with --mode pd, or --tp N without it.",
              file=sys.stderr)
        return 2
    if config.pp > 1:
        print(f"kthena serve --mode pd: --pp {config.pp} is not supported in PD mode: a prefill "
              "worker writes a decode worker's whole KV pool, and a pipelined decode worker's "
              "pool is split by layers across stages. Use --pp 1 with --mode pd, or --pp N "
              "without it.", file=sys.stderr)
        return 2
    from kthena_serve.pd.config import PDConfig, RouterWeights
    from kthena_serve.pd.frontend import RemoteEngine, build_router_app
    from kthena_serve.pd.launcher import PDLauncher
    from kthena_serve.pd.router import Router
    from kthena_serve.server import run_server

    pd_fields = _pd_fields(args)
    pd_config = PDConfig(**{**pd_fields, "weights": RouterWeights(**pd_fields["weights"])})
    print(f"kthena serve --mode pd: starting {args.prefill} prefill + {args.decode} decode "
          "workers ...", file=sys.stderr, flush=True)
    launcher = PDLauncher(engine_fields(config), pd_fields, args.prefill, args.decode,
                          api_key=getattr(args, "api_key", None)).start()
    router = Router(launcher.endpoints(), pd_config, config.block_size,
                    secret=launcher.secret, hash_algo=config.hash_algorithm).start()
    launcher.on_restart = router.set_url
    remote = RemoteEngine.for_model(router, config, secret=launcher.secret)
    app = build_router_app(remote, model_name=served_name,
                           aliases={config.model, "default"} - {served_name},
                           api_key=getattr(args, "api_key", None),
                           public_metrics=getattr(args, "public_metrics", False),
                           deployment=getattr(args, "deployment", None))

    def ready(port: int) -> None:
        from kthena_serve.model_runner import kv_dtype_name

        workers = ", ".join(f"{s.name}@cores{list(s.cores)}" for s in launcher.specs)
        print(f"kthena serve --mode pd: {served_name} on http://{args.host}:{port} ({workers}; "
              f"kv dtype={kv_dtype_name(config)}). Try:", flush=True)
        print(curl_line(args.host, port, served_name, bool(getattr(args, "api_key", None))),
              flush=True)

    from kthena_serve.pd.worker import exit_on_sigterm

    exit_on_sigterm()
    try:
        run_server(app, host=args.host, port=args.port, on_ready=ready,
                   shutdown_timeout=getattr(args, "shutdown_timeout", 30.0),
                   on_deadline=lambda: remote.abort_all(SHUTDOWN_MESSAGE))
    except SystemExit:
        pass
    finally:
        router.close()
        launcher.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kthena_serve.pd.serve")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("KTHENA_API_KEY"))
    add_public_metrics_arg(parser, "the API key")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM: seconds running requests may take to finish")
    add_pd_args(parser)
    args = parser.parse_args(argv)
    try:
        config = engine_config(args)
    except ValueError as error:
        print(f"kthena serve --mode pd: {error}", file=sys.stderr)
        return 2
    return run_pd(args, config, args.served_model_name or model_name(args.model))


if __name__ == "__main__":
    sys.exit(main())
