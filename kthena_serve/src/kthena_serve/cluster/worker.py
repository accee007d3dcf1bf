"""The life of a worker process (a PD worker, a DP replica), and of the router that starts them.

A worker, started by a ``ProcessLauncher`` (cluster/launcher.py) or a pod, goes through::

    take_secret()             the deployment secret, from KTHENA_PD_SECRET, then removed from
                              the environment so no child inherits it
    pin_to_cores(cores, n)    affinity, OMP_NUM_THREADS (its cores / its n ranks) and
                              OMP_WAIT_POLICY=PASSIVE: before torch loads (OpenMP reads them once);
                              and ``show_library_notices``: the kernel libraries' progress lines
                              shown, the host-wide ones (native kernels not built) only by the
                              deployment's first worker (the others get QUIET_NOTICES_ENV)
    die_with_parent()         PR_SET_PDEATHSIG: SIGTERM when the launcher dies
    ... load the model, build the app, whose state route answers ``state_reply`` ...
    serve_worker(app, ...)    SIGTERM -> SystemExit; once it listens, its port in the ready file
                              (written atomically); after, ``close()``, and if the launcher died
                              first, the ready file (and the launcher's folder, once empty) removed

The router's process serves its app with ``serve``: SIGTERM drains it and is a clean stop,
after which ``close()`` stops the router and the launcher.

Nothing heavy is imported at the top of this module: a worker imports it before torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from kthena_serve.cluster.auth import SECRET_ENV

if TYPE_CHECKING:
    import socket

    from starlette.types import ASGIApp

    from kthena_serve.cluster.events import EventLog
    from kthena_serve.engine.input_processor import EngineLimits
    from kthena_serve.engine.stats import EngineStats

__all__ = ["QUIET_NOTICES_ENV", "die_with_parent", "exit_on_sigterm", "new_incarnation",
           "pin_to_cores", "remove_ready_file", "serve", "serve_worker", "show_library_notices",
           "state_reply", "take_secret", "write_ready_file"]

# Set ("1") by a launcher for every worker but its first: what is true of the whole host (the
# native kernels are not built) is said once per deployment, not once per worker.
QUIET_NOTICES_ENV = "KTHENA_QUIET_HOST_NOTICES"


# ---- before torch loads -------------------------------------------------------------------------
def take_secret() -> str | None:
    """The deployment secret (``KTHENA_PD_SECRET``), removed from the environment so no child
    inherits it; None when it is not set (or empty)."""
    return os.environ.pop(SECRET_ENV, None) or None


def pin_to_cores(cores: str, num_ranks: int = 1) -> int:
    """Pin this process to ``cores`` (comma-separated CPU ids; empty: keep the affinity mask)
    and set OpenMP's environment; must run before torch is imported.

    Returns:
        threads per rank: the cores owned divided among ``num_ranks`` (at least 1), also
        ``OMP_NUM_THREADS``.
    """
    from kthena_serve.engine.threads import owned_cores

    ids = {int(c) for c in cores.split(",") if c.strip()}
    if ids and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, ids)
    num_threads = max(1, len(owned_cores()) // max(1, num_ranks))
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # workers share the host's cores
    show_library_notices(quiet_host_notices=os.environ.get(QUIET_NOTICES_ENV) == "1")
    return num_threads


class _StderrLines(logging.StreamHandler):
    """Each record's message as a line on the ``sys.stderr`` of the moment (as logging's own
    last-resort handler writes: a redirected stderr is followed)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr


def show_library_notices(*, quiet_host_notices: bool = False) -> None:
    """An entry point's choice of what the kernel library (``mooncake_ops``) says on stderr:
    its INFO lines too (the one-time kernel timing, which otherwise leaves a start-up silent
    for seconds), as plain lines; with ``quiet_host_notices`` not the native-kernels warning,
    which another process of the deployment prints.

    Idempotent: a logger that already has a handler (an embedding application's) is left as
    it is."""
    library = logging.getLogger("mooncake_ops")
    if not library.handlers:
        library.addHandler(_StderrLines())
        library.setLevel(logging.INFO)
    if quiet_host_notices:
        logging.getLogger("mooncake_ops.native").setLevel(logging.ERROR)


def die_with_parent() -> None:
    """SIGTERM when the launcher dies (PR_SET_PDEATHSIG), so no worker outlives it."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:  # no glibc: a killed launcher leaves the worker to its own SIGTERM
        pass


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` clean-up (shm pools) runs.

    uvicorn handles SIGTERM while it serves, then restores the previous handler and raises the
    signal again; with the default handler the process would die before its ``finally``.
    """

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


# ---- the state route ----------------------------------------------------------------------------
def new_incarnation() -> str:
    """A name for this run of the process: the router forgets a worker whose incarnation
    changed (restarted) and re-learns its KV events."""
    return f"{os.getpid()}-{time.time_ns()}"


def state_reply(name: str, role: str, incarnation: str, *, alive: bool, stats: EngineStats,
                events: EventLog | None, since: int, limits: EngineLimits | None = None,
                **extra: object) -> dict[str, object]:
    """The body of a worker's state route (``GET /pd/state``, ``/dp/state``): what
    ``Router.poll`` reads.

    Args:
        alive: the engine runs (False: the router marks the worker down).
        stats: the engine's stats now (load, KV usage; the router sums them).
        events: the worker's KV events (None: it keeps none, and the reply carries none).
        since: the last event sequence number the router has seen (the route's ``since``).
        limits: the engine's limits (a decode worker's, a replica's), if it reports them.
        extra: what one kind of worker adds (a decode worker's pool, a prefill worker's pins).
    """
    first, last, items = events.since(since) if events is not None else (1, 0, [])
    reply: dict[str, object] = {
        "name": name, "role": role, "incarnation": incarnation, "alive": alive,
        "num_running": stats.num_running, "num_waiting": stats.num_waiting,
        "kv": attrs.asdict(stats.kv), "stats": stats.to_json()}
    if limits is not None:
        reply["limits"] = attrs.asdict(limits)
    reply.update(extra)
    reply.update(first_seq=first, last_seq=last, events=items)
    return reply


# ---- serving ------------------------------------------------------------------------------------
def write_ready_file(path: str | None, port: int) -> None:
    """Write ``port`` to ``path`` atomically (the launcher polls for it); nothing without one."""
    if path:
        with open(f"{path}.tmp", "w") as f:
            f.write(str(port))
        os.replace(f"{path}.tmp", path)


def remove_ready_file(path: str | None) -> None:
    """Remove this worker's ready file and, once the last worker has, the launcher's folder."""
    if not path:
        return
    for remove in (os.remove, lambda p: os.rmdir(os.path.dirname(p))):
        try:
            remove(path)
        except OSError:  # gone already, or another worker's file is still there
            return


def serve_worker(app: ASGIApp, *, host: str, port: int, ready_file: str | None,
                 on_ready: Callable[[int], None], close: Callable[[], None],
                 shutdown_timeout: float = 30.0,
                 on_deadline: Callable[[], None] | None = None) -> None:
    """Serve a worker's ``app`` until SIGTERM, which ends it with ``SystemExit`` (after
    ``run_server``'s drain, if the app has a ``Drain``).

    Args:
        app: the worker's ASGI app, with a ``state`` (``run_server`` reads it).
        ready_file: where the port goes once the server listens (after ``on_ready(port)``).
        close: run after the server stops (the engine, its pools); then, if the launcher died
            first (this process was orphaned), the ready file is removed.
        shutdown_timeout, on_deadline: as ``run_server``'s.
    """
    from kthena_serve.server import run_server

    def ready(bound: int) -> None:
        on_ready(bound)
        write_ready_file(ready_file, bound)

    exit_on_sigterm()
    launcher_pid = os.getppid()
    try:
        run_server(app, host=host, port=port, on_ready=ready, log_level="warning",
                   shutdown_timeout=shutdown_timeout, on_deadline=on_deadline)
    finally:
        close()
        if os.getppid() != launcher_pid:  # orphaned (launcher SIGKILLed): tidy its folder
            remove_ready_file(ready_file)


def serve(app: ASGIApp, *, host: str, port: int, on_ready: Callable[[int], None],
          close: Callable[[], None], shutdown_timeout: float,
          on_deadline: Callable[[], None], sock: socket.socket | None = None,
          keep_alive_s: float | None = None, header_timeout_s: float | None = None) -> None:
    """Serve a router's ``app`` until SIGTERM or SIGINT, then ``close()`` (the router, the
    launcher) however it ended.

    ``run_server`` drains (``shutdown_timeout`` seconds at most, then ``on_deadline()``), and
    SIGTERM's ``SystemExit`` is the clean stop it asked for: this returns. ``sock``,
    ``keep_alive_s``, ``header_timeout_s``: ``run_server``'s (the public flags
    ``--timeout-keep-alive`` / ``--timeout-header-read``).

    Raises:
        kthena_serve.server.launch.ListenError: the address cannot be listened on.
    """
    from kthena_serve.server import run_server

    exit_on_sigterm()
    try:
        with contextlib.suppress(SystemExit):
            run_server(app, host=host, port=port, on_ready=on_ready,
                       shutdown_timeout=shutdown_timeout, on_deadline=on_deadline, sock=sock,
                       keep_alive_s=keep_alive_s, header_timeout_s=header_timeout_s)
    finally:
        close()
