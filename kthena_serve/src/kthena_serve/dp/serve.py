"""``kthena serve --dp N``: N colocated replicas on split cores behind one router on --port.

The launcher (dp/launcher.py) starts the replica processes on 127.0.0.1; the ``Router``
(cluster/router.py) polls their ``/dp/state`` and picks one per request; this process serves
the OpenAI API on ``--host`` / ``--port`` (dp/frontend.py) with the public API key, and stops
the replicas when it stops. Which flags combine with ``--dp`` is ``ServeSpec.resolve``'s to say.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

    from kthena_serve.dp.launcher import ReplicaLauncher
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.input_processor import InputProcessor
    from kthena_serve.spec import ServeSpec

__all__ = ["run_dp"]

_PREFIX = "kthena serve"


def _routing_processor(config: EngineConfig) -> InputProcessor:
    """The replicas' ``InputProcessor``: same tokenizer, chat template and special-token rule."""
    from kthena_serve.engine.input_processor import EngineLimits, InputProcessor
    from kthena_serve.model import ModelConfig, Tokenizer, resolve_checkpoint

    folder = resolve_checkpoint(config.model)
    model = ModelConfig.from_pretrained(folder)
    limits = EngineLimits.for_engine(config, max_position_embeddings=model.max_position_embeddings,
                                     vocab_size=model.shape.vocab_size)
    return InputProcessor(Tokenizer.from_pretrained(folder), limits, config.chat_special_tokens)


def run_dp(spec: ServeSpec, sock: socket.socket | None = None) -> int:
    """Start ``spec.dp`` replicas and serve the router until SIGTERM / SIGINT, on ``sock``
    (``bind_listener(spec.host, spec.port)``; None: bound when the replicas are up).

    Returns 0 after a clean stop; 1 if a replica could not start.

    Raises:
        kthena_serve.server.launch.ListenError: the router's address cannot be listened on.
    """
    from kthena_serve.cluster.worker import exit_on_sigterm
    from kthena_serve.dp.launcher import ReplicaLauncher

    exit_on_sigterm()  # SIGTERM while replicas load: SystemExit, so `finally` stops them
    print(f"{_PREFIX} --dp {spec.dp}: starting {spec.dp} replicas ...", file=sys.stderr,
          flush=True)
    launcher = ReplicaLauncher(spec.engine, spec.dp, spec.served_model_name,
                               stream_stall_timeout=spec.stream_stall_timeout_s,
                               tool_call_parser=spec.tool_call_parser,
                               disable_any_whitespace=spec.disable_any_whitespace)
    try:
        launcher.start()
    except (RuntimeError, TimeoutError) as error:
        print(f"{_PREFIX} --dp {spec.dp}: {error}", file=sys.stderr)
        return 1
    try:
        return _serve(spec, launcher, sock)
    finally:
        launcher.stop()


def _serve(spec: ServeSpec, launcher: ReplicaLauncher, sock: socket.socket | None) -> int:
    from kthena_serve.cluster.router import Router
    from kthena_serve.cluster.worker import serve
    from kthena_serve.dp.frontend import DPFrontend, build_dp_app
    from kthena_serve.engine.admission import AdmissionLimits, startup_rate
    from kthena_serve.serve_args import SHUTDOWN_MESSAGE, curl_line

    config = spec.engine
    router = Router(launcher.endpoints(), spec.pd, config.block_size,
                    secret=launcher.secret, state_path="/dp/state",
                    hash_algo=config.hash_algorithm).start()
    launcher.on_restart = router.set_url
    cores = min(len(w.spec.cores) for w in launcher.workers.values())  # a replica's share
    front = DPFrontend(router, _routing_processor(config), secret=launcher.secret,
                       remember=config.enable_prefix_caching, limits=AdmissionLimits.of(config),
                       startup_rate=startup_rate(config, cores))
    app = build_dp_app(front, api_key=spec.api_key, public_metrics=spec.public_metrics,
                       deployment=spec.report())

    def ready(port: int) -> None:
        print(f"{_PREFIX} --dp {spec.dp}: {spec.served_model_name} on "
              f"http://{spec.host}:{port} ({launcher.describe()}). Try:", flush=True)
        print(curl_line(spec.host, port, spec.served_model_name, bool(spec.api_key)),
              flush=True)

    serve(app, host=spec.host, port=spec.port, on_ready=ready, close=router.close,
          shutdown_timeout=spec.shutdown_timeout_s,
          on_deadline=lambda: front.abort_all(SHUTDOWN_MESSAGE), sock=sock,
          **spec.server_timeouts())
    return 0
