"""``kthena serve --mode pd``: workers + router on one host.

Starts ``spec.num_prefill`` prefill and ``spec.num_decode`` decode worker processes
(launcher.py) and serves the OpenAI API from the router in this process; clients see the same
API as ``kthena serve``. ``python -m kthena_serve.pd.serve ARGS`` is ``kthena serve --mode pd
ARGS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from kthena_serve.serve_args import SHUTDOWN_MESSAGE, curl_line

if TYPE_CHECKING:
    import socket

    from kthena_serve.spec import ServeSpec

__all__ = ["add_pd_args", "main", "role_layouts", "run_pd"]


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    """The PD flags of ``kthena serve`` (no defaults of their own: see ``add_engine_args``)."""
    parser.add_argument("--prefill", type=int, help="prefill workers (PD mode; default 1)")
    parser.add_argument("--decode", type=int, help="decode workers (PD mode; default 1)")
    parser.add_argument("--prefill-tp", type=int,
                        help="TP size of each prefill worker (PD mode; default --tp)")
    parser.add_argument("--decode-tp", type=int,
                        help="TP size of each decode worker (PD mode; default --tp)")
    parser.add_argument("--pd-policy", choices=("recompute", "fail"),
                        help="what a failed KV handoff does (default recompute)")
    parser.add_argument("--pd-timeout", type=float,
                        help="seconds a prefill + handoff may take (default 30)")
    parser.add_argument("--pd-transport", choices=("shm", "mooncake"), help="default shm")
    parser.add_argument("--pd-kv-push", choices=("layerwise", "batched"),
                        help="with --pd-transport mooncake, or shm between TP workers: "
                             "layerwise moves each layer's KV blocks while the prefill goes "
                             "on, batched all blocks after it (default layerwise)")
    parser.add_argument("--pd-threshold", type=int,
                        help="uncached prompt tokens below which the decode worker prefills "
                             "(default 32)")
    parser.add_argument("--router-weights",
                        help="overlap,load,kv_usage score weights (default 1.0,0.5,0.25)")


def role_layouts(spec: ServeSpec) -> dict[str, int]:
    """Each role's TP size, checked against the model's heads before any worker starts.

    Raises:
        ValueError: a role's TP size cannot split the model's heads (names the role, the flag
            and the sizes that can).
    """
    from kthena_core.shape import HeadSplitError, check_tp
    from kthena_serve.model import ModelConfig, resolve_checkpoint

    sizes = {role: spec.pd.role_tp(role, spec.engine.tp) for role in ("prefill", "decode")}
    if max(sizes.values()) == 1:
        return sizes
    model = ModelConfig.from_pretrained(resolve_checkpoint(spec.engine.model))
    heads = model.shape.num_attention_heads
    kv_heads = 1 if model.mla is not None else model.shape.num_kv_heads
    for role, tp in sizes.items():
        try:
            check_tp(heads, kv_heads, tp)
        except HeadSplitError as error:
            raise ValueError(f"--{role}-tp {tp}: the {role} workers cannot split "
                             f"{spec.engine.model}'s heads ({error})") from None
    return sizes


def _startup_rate(spec: ServeSpec) -> float:
    """The router's rate before it measures (admission.startup_rate): the cores of this host
    shared by every worker's ranks."""
    from kthena_serve.engine.admission import startup_rate
    from kthena_serve.engine.threads import owned_cores

    ranks = (spec.num_prefill * spec.pd.role_tp("prefill", spec.engine.tp)
             + spec.num_decode * spec.pd.role_tp("decode", spec.engine.tp))
    return startup_rate(spec.engine, max(1, len(owned_cores()) // max(1, ranks)))


def run_pd(spec: ServeSpec, sock: socket.socket | None = None) -> int:
    """Launch the workers ``spec`` names and serve the router until interrupted, on ``sock``
    (``bind_listener(spec.host, spec.port)``; None: bound when the workers are up).

    Returns 0 after a clean stop; 1 if a worker could not start.

    Raises:
        kthena_serve.server.launch.ListenError: the router's address cannot be listened on.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kthena_serve.cluster.router import Router
    from kthena_serve.cluster.worker import serve
    from kthena_serve.engine.kv_offload import check_store, shares_store
    from kthena_serve.pd.frontend import RemoteEngine, build_router_app
    from kthena_serve.pd.launcher import PDLauncher
    from kthena_serve.pd.metrics import PDMetrics

    config, name = spec.engine, spec.served_model_name
    try:
        roles = role_layouts(spec)
        check_store(config.kv_offload)  # every worker opens it: refused before any starts
    except ValueError as error:
        print(f"kthena serve --mode pd: {error}", file=sys.stderr)
        return 2
    print(f"kthena serve --mode pd: starting {spec.num_prefill} prefill (TP{roles['prefill']}) "
          f"+ {spec.num_decode} decode (TP{roles['decode']}) workers ...", file=sys.stderr,
          flush=True)
    try:
        launcher = PDLauncher(config, spec.pd, spec.num_prefill, spec.num_decode,
                              api_key=spec.api_key, kv_events=spec.kv_events,
                              served_model_name=spec.served_model_name).start()
    except (RuntimeError, TimeoutError) as error:  # the worker printed why, in one line
        print(f"kthena serve --mode pd: {error}", file=sys.stderr)
        return 1
    router = Router(launcher.endpoints(), spec.pd, config.block_size, PDMetrics("router"),
                    secret=launcher.secret, hash_algo=config.hash_algorithm,
                    shared_store=shares_store(config)).start()
    launcher.on_restart = router.set_url
    remote = RemoteEngine.for_model(router, config, secret=launcher.secret,
                                    startup_rate=_startup_rate(spec))
    app = build_router_app(remote, model_name=name, aliases=spec.aliases, api_key=spec.api_key,
                           public_metrics=spec.public_metrics, deployment=spec.report(),
                           tool_call_parser=spec.tool_call_parser,
                           disable_any_whitespace=spec.disable_any_whitespace)

    def ready(port: int) -> None:
        from kthena_serve.engine.model_runner import kv_dtype_name

        print(f"kthena serve --mode pd: {name} on http://{spec.host}:{port} "
              f"({launcher.describe()}; kv dtype={kv_dtype_name(config)}). Try:", flush=True)
        print(curl_line(spec.host, port, name, bool(spec.api_key)), flush=True)

    def stop() -> None:
        router.close()
        launcher.stop()

    serve(app, host=spec.host, port=spec.port, on_ready=ready, close=stop,
          shutdown_timeout=spec.shutdown_timeout_s,
          on_deadline=lambda: remote.abort_all(SHUTDOWN_MESSAGE), sock=sock,
          **spec.server_timeouts())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kthena_serve.pd.serve ARGS``: ``kthena serve --mode pd ARGS``."""
    from kthena_core.cli import main as kthena_main

    return kthena_main(["serve", "--mode", "pd", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
