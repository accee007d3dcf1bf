"""Starts a deployment's worker processes on split cores, restarts dead ones, cleans their shm.

``ProcessLauncher`` is what every deployment of worker processes shares (ready files,
restarts, stop, the secret); a subclass says what a worker runs: ``PDLauncher``
(pd/launcher.py) the PD workers, ``ReplicaLauncher`` (dp/launcher.py) the data-parallel
replicas of ``kthena serve --dp``.

Cores: ``share_cores`` splits the launcher's affinity mask into disjoint sets (the first take
any remainder); with fewer cores than workers they share round-robin. Each worker pins itself
and sets ``OMP_NUM_THREADS`` to its core count before torch loads (``pin_to_cores`` in
cluster/worker.py), so nothing oversubscribes.

Shared memory: a SIGKILLed worker cannot unlink the KV pool it shares (a PD decode worker's;
found again by its pid, ``mooncake_kv.shared_pool_paths(pid)``). The monitor thread reaps
every worker that exits and unlinks what that pid left; ``stop()`` does the same for all.
Workers get SIGTERM if the launcher dies (PR_SET_PDEATHSIG, ``die_with_parent`` in
cluster/worker.py) and then clean up themselves.

Authentication: the launcher draws one secret per deployment (``secret``, see cluster/auth.py)
and passes it to every worker, restarted ones included, in the child's environment, never on
the command line. The router takes it from here. ``KTHENA_API_KEY`` is removed from the
children's environment: a subclass passes a key explicitly (``PDLauncher(api_key=...)``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from kthena_serve.cluster.auth import SECRET_ENV, new_secret
from kthena_serve.cluster.worker import QUIET_NOTICES_ENV
from mooncake_kv import shared_pool_paths

__all__ = ["ProcessLauncher", "WorkerProcess", "WorkerSpec", "cleanup_shm", "share_cores"]

log = logging.getLogger(__name__)


@attrs.frozen
class WorkerSpec:
    """One worker to start: its name, its role (a ``Role`` value) and the cores it pins to."""

    name: str
    role: str
    cores: tuple[int, ...]


def share_cores(cores: list[int], num_groups: int) -> list[tuple[int, ...]]:
    """``num_groups`` disjoint core sets (the first ones take any remainder) when there are
    enough cores, else one core each, round-robin (group i gets ``cores[i % len(cores)]``).

    Raises:
        ValueError: no group, or no core.
    """
    if num_groups < 1 or not cores:
        raise ValueError(f"share {len(cores)} cores among {num_groups} groups: need at least "
                         "one of each")
    if len(cores) < num_groups:
        return [(cores[i % len(cores)],) for i in range(num_groups)]
    share, extra = divmod(len(cores), num_groups)
    sets, start = [], 0
    for i in range(num_groups):
        count = share + (1 if i < extra else 0)
        sets.append(tuple(cores[start:start + count]))
        start += count
    return sets


def cleanup_shm(pid: int) -> list[str]:
    """Unlink the KV pools a (dead) process created; returns the names removed."""
    removed = []
    for path in shared_pool_paths(pid):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


@attrs.define
class WorkerProcess:
    """One worker: its spec, the port it listens on, its process (None while restarting)."""

    spec: WorkerSpec
    port: int = 0
    proc: subprocess.Popen | None = None
    num_restarts: int = 0


class ProcessLauncher:
    """Worker processes of one deployment on this host: start them, wait until each is ready,
    restart one that dies, stop them all. Subclasses say what to run (``_command``).

    A worker writes its port to the ready file it is given once it listens. Every worker gets
    this deployment's ``secret`` in its environment (never on the command line) and
    ``OMP_WAIT_POLICY=PASSIVE`` / ``OMP_NUM_THREADS`` before torch loads.

    Args:
        specs: one per worker (name, role, cores).
        host: the address workers listen on (and their URLs name).
        restart: start a worker again when it dies.
        on_restart: called with (name, url) after a restarted worker is ready.
        quiet: send the workers' output to /dev/null.

    Attributes:
        secret: this deployment's secret; every worker call needs it (cluster/auth.py).
    """

    kind = "worker"  # how messages name a worker
    folder_prefix = "kthena-workers-"  # of the temporary folder that holds the ready files

    def __init__(self, specs: list[WorkerSpec], *, host: str = "127.0.0.1",
                 restart: bool = True, on_restart: Callable[[str, str], None] | None = None,
                 quiet: bool = False) -> None:
        self.specs = specs
        self.host = host
        self.restart = restart
        self.on_restart = on_restart
        self.quiet = quiet
        self.workers = {s.name: WorkerProcess(s) for s in self.specs}
        self.secret = new_secret()
        # named after this process too, so a leak check can tell its folder from others'
        self._dir = tempfile.TemporaryDirectory(prefix=f"{self.folder_prefix}{os.getpid()}-")
        self._stopping = threading.Event()
        self._spawning = threading.Lock()  # a restart never spawns after stop() has begun
        self._monitor: threading.Thread | None = None

    # ---- what subclasses say ------------------------------------------------------------------
    def _command(self, worker: WorkerProcess, ready: Path) -> list[str]:
        """The command line that starts ``worker`` (it writes its port to ``ready``)."""
        raise NotImplementedError

    def _environment(self, worker: WorkerProcess) -> dict[str, str]:
        """The worker's environment: this one, plus OpenMP settings and the secret."""
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE",
                   OMP_NUM_THREADS=str(len(worker.spec.cores)), GLOG_minloglevel="2")
        env[SECRET_ENV] = self.secret  # the environment, not argv: see cluster/auth.py
        env.pop("KTHENA_API_KEY", None)
        if worker.spec.name != self.specs[0].name:  # host-wide notices: the first worker's
            env[QUIET_NOTICES_ENV] = "1"
        else:
            env.pop(QUIET_NOTICES_ENV, None)
        return env

    # ---- lifetime -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> ProcessLauncher:
        for worker in self.workers.values():
            self._spawn(worker)
        try:
            for worker in self.workers.values():
                self._wait_ready(worker, timeout_s)
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="kthena-launcher",
                                         daemon=True)
        self._monitor.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._spawning:  # a restart in progress has its process in `workers` by now
            procs = [w.proc for w in self.workers.values() if w.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            cleanup_shm(proc.pid)
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self._dir.cleanup()

    def __enter__(self) -> ProcessLauncher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, name: str) -> str:
        return f"http://{self._host(name)}:{self.workers[name].port}"

    def _host(self, name: str) -> str:
        return self.host

    def describe(self) -> str:
        """Each worker and its cores, for a banner: ``prefill-0@cores[0, 1], decode-0@cores[2]``."""
        return ", ".join(f"{s.name}@cores{list(s.cores)}" for s in self.specs)

    def endpoints(self) -> list[tuple[str, str, str]]:
        """(name, role, url) of every worker, for the router."""
        return [(w.spec.name, w.spec.role, self.url(w.spec.name)) for w in self.workers.values()]

    def pid(self, name: str) -> int | None:
        """The worker's process id; None while it is being restarted."""
        proc = self.workers[name].proc
        return None if proc is None else proc.pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a worker (tests and chaos drills); returns its pid.

        Raises:
            ProcessLookupError: the worker is being restarted (no process right now).
        """
        pid = self.pid(name)
        if pid is None:
            raise ProcessLookupError(f"{self.kind} {name} has no process right now "
                                     "(restarting)")
        os.kill(pid, sig)
        return pid

    # ---- internals ----------------------------------------------------------------------------
    def _ready_file(self, worker: WorkerProcess) -> Path:
        return Path(self._dir.name) / f"{worker.spec.name}.port"

    def _spawn(self, worker: WorkerProcess) -> None:
        ready = self._ready_file(worker)
        ready.unlink(missing_ok=True)
        cmd, env = self._command(worker, ready), self._environment(worker)
        out = subprocess.DEVNULL if self.quiet else None
        with self._spawning:
            if self._stopping.is_set():
                raise RuntimeError(f"not starting {self.kind} {worker.spec.name}: stopping")
            worker.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)

    def _wait_ready(self, worker: WorkerProcess, timeout_s: float) -> None:
        ready = self._ready_file(worker)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if worker.proc is not None and worker.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} {worker.spec.name} exited with "
                                   f"{worker.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.kind} {worker.spec.name} not ready in "
                                   f"{timeout_s:g} s")
            if self._stopping.is_set():
                raise RuntimeError(f"{self.kind} {worker.spec.name}: stopped while starting")
            time.sleep(0.05)
        worker.port = int(ready.read_text())

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            for worker in self.workers.values():
                proc = worker.proc
                if proc is None or proc.poll() is None or self._stopping.is_set():
                    continue
                removed = cleanup_shm(proc.pid)
                log.warning("%s %s (pid %d) exited with %s; removed shm %s", self.kind,
                            worker.spec.name, proc.pid, proc.returncode, removed)
                worker.proc = None
                if self.restart:
                    self._restart(worker)

    def _restart(self, worker: WorkerProcess) -> None:
        worker.num_restarts += 1
        try:
            self._spawn(worker)  # same port: the router's URL stays valid
            self._wait_ready(worker, 600)
        except (RuntimeError, TimeoutError, OSError) as error:
            if not self._stopping.is_set():
                log.error("restarting %s failed: %s", worker.spec.name, error)
            return
        if self.on_restart is not None:
            self.on_restart(worker.spec.name, self.url(worker.spec.name))
