"""``kthena serve --dp N``: N colocated replicas on split cores behind one router on --port.

The launcher (dp/launcher.py) starts the replica processes on 127.0.0.1; the PD ``Router``
(pd/router.py) polls their ``/dp/state`` and picks one per request; this process serves the
OpenAI API on ``--host`` / ``--port`` (dp/frontend.py) with the public API key, and stops the
replicas when it stops.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["check_dp_flags", "run_dp"]

_PREFIX = "kthena serve"


def check_dp_flags(args: argparse.Namespace) -> None:
    """Refuse what ``--dp`` cannot be combined with.

    Raises:
        ValueError: the message starts with the flag and says what to change.
    """
    dp = getattr(args, "dp", 1)
    if dp < 1:
        raise ValueError(f"--dp: must be at least 1 (1: one engine; N > 1: N replicas behind "
                         f"one router), got {dp}")
    if dp == 1:
        return
    if getattr(args, "mode", "colocated") == "pd":
        raise ValueError(f"--dp {dp}: not supported with --mode pd, which sets its own worker "
                         "counts (--prefill N --decode M); drop --dp or --mode pd")
    if getattr(args, "kv_events", None) is not None:
        raise ValueError(f"--dp {dp}: not supported with --kv-events: the replicas would "
                         "publish under one --pod-name and overwrite each other's blocks; "
                         "run one replica per pod with --kv-events, or drop it")


def _weights(text: str):  # noqa: ANN202 - RouterWeights
    """``--router-weights overlap,load,kv_usage``.

    Raises:
        ValueError: not three non-negative numbers.
    """
    from kthena_serve.pd.config import RouterWeights

    try:
        overlap, load, kv_usage = (float(x) for x in text.split(","))
        return RouterWeights(overlap=overlap, load=load, kv_usage=kv_usage)
    except ValueError as error:
        raise ValueError(f"--router-weights: takes overlap,load,kv_usage as three numbers "
                         f">= 0 (default 1.0,0.5,0.25), got {text!r} ({error})") from None


def _routing_processor(config):  # noqa: ANN001, ANN202 - EngineConfig -> InputProcessor
    """The replicas' ``InputProcessor``: same tokenizer, chat template and special-token rule."""
    from kthena_serve.client import EngineLimits
    from kthena_serve.input_processor import InputProcessor
    from kthena_serve.model import ModelConfig, Tokenizer, resolve_checkpoint

    folder = resolve_checkpoint(config.model)
    model = ModelConfig.from_pretrained(folder)
    limits = EngineLimits(model.max_position_embeddings, model.vocab_size, config.max_n, 0,
                          config.block_size)
    return InputProcessor(Tokenizer.from_pretrained(folder), limits, config.chat_special_tokens)


def run_dp(args: argparse.Namespace, config, served_name: str) -> int:  # noqa: ANN001
    """Start ``args.dp`` replicas of ``config`` and serve the router until SIGTERM / SIGINT.

    Returns 0 after a clean stop; 2 (with a message) for refused flags; 1 if a replica could
    not start.
    """
    try:
        check_dp_flags(args)
        weights = _weights(getattr(args, "router_weights", "1.0,0.5,0.25"))
    except ValueError as error:
        print(f"{_PREFIX}: {error}", file=sys.stderr)
        return 2
    from kthena_serve.dp.launcher import ReplicaLauncher
    from kthena_serve.pd.serve import engine_fields
    from kthena_serve.pd.worker import exit_on_sigterm

    exit_on_sigterm()  # SIGTERM while replicas load: SystemExit, so `finally` stops them
    print(f"{_PREFIX} --dp {args.dp}: starting {args.dp} replicas ...", file=sys.stderr,
          flush=True)
    launcher = ReplicaLauncher(engine_fields(config), args.dp, served_name,
                               stream_stall_timeout=getattr(args, "stream_stall_timeout", None))
    try:
        launcher.start()
    except (RuntimeError, TimeoutError) as error:
        print(f"{_PREFIX} --dp {args.dp}: {error}", file=sys.stderr)
        return 1
    try:
        return _serve(args, config, served_name, launcher, weights)
    finally:
        launcher.stop()


def _serve(args: argparse.Namespace, config, served_name: str, launcher, weights) -> int:  # noqa: ANN001
    from kthena_serve.dp.frontend import DPFrontend, build_dp_app
    from kthena_serve.pd.config import PDConfig
    from kthena_serve.pd.router import Router
    from kthena_serve.serve_args import SHUTDOWN_MESSAGE, curl_line
    from kthena_serve.server import run_server

    router = Router(launcher.endpoints(), PDConfig(weights=weights), config.block_size,
                    secret=launcher.secret, state_path="/dp/state",
                    hash_algo=config.hash_algorithm).start()
    launcher.on_restart = router.set_url
    front = DPFrontend(router, _routing_processor(config), secret=launcher.secret,
                       remember=config.enable_prefix_caching)
    api_key = getattr(args, "api_key", None)
    app = build_dp_app(front, api_key=api_key,
                       public_metrics=getattr(args, "public_metrics", False),
                       deployment=getattr(args, "deployment", None))

    def ready(port: int) -> None:
        replicas = ", ".join(f"{s.name}@cores{list(s.cores)}" for s in launcher.specs)
        print(f"{_PREFIX} --dp {args.dp}: {served_name} on http://{args.host}:{port} "
              f"({replicas}). Try:", flush=True)
        print(curl_line(args.host, port, served_name, bool(api_key)), flush=True)

    try:
        run_server(app, host=args.host, port=args.port, on_ready=ready,
                   shutdown_timeout=getattr(args, "shutdown_timeout", 30.0),
                   on_deadline=lambda: front.abort_all(SHUTDOWN_MESSAGE))
    except SystemExit:
        pass
    finally:
        router.close()
    return 0
