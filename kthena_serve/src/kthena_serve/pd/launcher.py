"""Starts PD workers as processes on split cores, restarts dead ones, cleans their shm.

Cores: the launcher's affinity mask is split into disjoint sets, prefill workers first
(prefill is compute-bound and takes any remainder); with fewer cores than workers they share
round-robin. Each worker pins itself and sets ``OMP_NUM_THREADS`` to its core count before
torch loads (worker.py), so nothing oversubscribes.

Shared memory: a SIGKILLed decode worker cannot unlink its pool (found again by its pid,
``mooncake_kv.shared_pool_paths(pid)``). The monitor thread reaps every worker that exits and
unlinks what that pid left; ``stop()`` does the same for all. Workers get SIGTERM if the
launcher dies (PR_SET_PDEATHSIG) and then clean up themselves.

Authentication: the launcher draws one secret per deployment (``secret``, see pd/auth.py) and
passes it to every worker, restarted ones included, in the child's environment, never on the
command line. The router and ``RemoteEngine`` take it from here. Each decode worker is told
the prefill workers' hosts (``--prefill-hosts``: loopback plus ``host`` / ``worker_hosts``).
The workers' OpenAI routes (what the Kthena router calls) get ``api_key`` the same way
(``KTHENA_API_KEY``); without one they are open, as ``kthena serve`` without ``--api-key``.
With ``public_metrics`` every worker serves ``/metrics`` without the secret (``--public-metrics``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from kthena_serve.pd.auth import LOOPBACK_HOSTS, SECRET_ENV, new_secret
from mooncake_kv import shared_pool_paths

__all__ = ["PDLauncher", "WorkerSpec", "cleanup_shm", "split_cores"]

log = logging.getLogger(__name__)


@attrs.frozen
class WorkerSpec:
    name: str
    role: str
    cores: tuple[int, ...]


def split_cores(cores: list[int], num_prefill: int, num_decode: int) -> list[WorkerSpec]:
    """Disjoint core sets when there are enough cores, else round-robin sharing."""
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in
                                                           range(num_decode)]
    if not roles:
        raise ValueError("start at least one decode worker")
    if len(cores) < len(roles):
        return [WorkerSpec(n, r, (cores[i % len(cores)],)) for i, (n, r) in
                enumerate(zip(names, roles, strict=True))]
    share, extra = divmod(len(cores), len(roles))
    specs, start = [], 0
    for i, (name, role) in enumerate(zip(names, roles, strict=True)):
        count = share + (1 if i < extra else 0)
        specs.append(WorkerSpec(name, role, tuple(cores[start:start + count])))
        start += count
    return specs


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
class _Worker:
    spec: WorkerSpec
    port: int = 0
    proc: subprocess.Popen | None = None
    num_restarts: int = 0


class PDLauncher:
    """Worker processes for one PD deployment on this host.

    Args:
        engine_config: ``EngineConfig`` fields (JSON-able) for every worker.
        pd_config: ``PDConfig`` fields (JSON-able).
        num_prefill, num_decode: worker counts.
        cores: CPU ids to split (default: this process's affinity mask).
        restart: start a worker again when it dies.
        on_restart: called with (name, url) after a restarted worker is ready.
        api_key: what the workers' OpenAI routes require (None: nothing).
        public_metrics: the workers serve /metrics without the secret (``--public-metrics``).

    Attributes:
        secret: this deployment's secret; every worker call needs it (``pd.auth``).
    """

    def __init__(self, engine_config: dict, pd_config: dict, num_prefill: int, num_decode: int,
                 *, cores: list[int] | None = None, host: str = "127.0.0.1", restart: bool = True,
                 on_restart: Callable[[str, str], None] | None = None,
                 mooncake_host: str | None = None, quiet: bool = False,
                 worker_hosts: dict[str, str] | None = None,
                 worker_prefix: dict[str, list[str]] | None = None,
                 api_key: str | None = None, public_metrics: bool = False) -> None:
        cores = cores or sorted(os.sched_getaffinity(0))
        self.specs = split_cores(cores, num_prefill, num_decode)
        self.engine_config = engine_config
        self.pd_config = pd_config
        self.host = host
        self.restart = restart
        self.on_restart = on_restart
        self.mooncake_host = mooncake_host
        self.quiet = quiet
        self.worker_hosts = worker_hosts or {}  # e.g. one address per network namespace
        self.worker_prefix = worker_prefix or {}  # e.g. ["ip", "netns", "exec", "ns-b"]
        self.workers = {s.name: _Worker(s) for s in self.specs}
        self.secret = new_secret()
        self.api_key = api_key
        self.public_metrics = public_metrics
        self._dir = tempfile.TemporaryDirectory(prefix="kthena-pd-")
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    # ---- lifetime -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> PDLauncher:
        for worker in self.workers.values():
            self._spawn(worker)
        try:
            for worker in self.workers.values():
                self._wait_ready(worker, timeout_s)
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="kthena-pd-launcher",
                                         daemon=True)
        self._monitor.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
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

    def __enter__(self) -> PDLauncher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, name: str) -> str:
        return f"http://{self._host(name)}:{self.workers[name].port}"

    def _host(self, name: str) -> str:
        return self.worker_hosts.get(name, self.host)

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
            raise ProcessLookupError(f"PD worker {name} has no process right now (restarting)")
        os.kill(pid, sig)
        return pid

    # ---- internals ----------------------------------------------------------------------------
    def _ready_file(self, worker: _Worker) -> Path:
        return Path(self._dir.name) / f"{worker.spec.name}.port"

    def _spawn(self, worker: _Worker) -> None:
        ready = self._ready_file(worker)
        ready.unlink(missing_ok=True)
        name = worker.spec.name
        cmd = [*self.worker_prefix.get(name, []), sys.executable, "-m",
               "kthena_serve.pd.worker", "--role", worker.spec.role,
               "--name", name, "--host", self._host(name), "--port", str(worker.port),
               "--cores", ",".join(map(str, worker.spec.cores)), "--ready-file", str(ready),
               "--engine-config", json.dumps(self.engine_config),
               "--pd-config", json.dumps(self.pd_config)]
        mooncake_host = self.mooncake_host or self.worker_hosts.get(name)
        if mooncake_host:
            cmd += ["--mooncake-host", mooncake_host]
        if worker.spec.role == "decode":
            cmd += ["--prefill-hosts", ",".join(sorted(self._prefill_hosts()))]
        if self.public_metrics:
            cmd.append("--public-metrics")
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE",
                   OMP_NUM_THREADS=str(len(worker.spec.cores)), GLOG_minloglevel="2")
        env[SECRET_ENV] = self.secret  # the environment, not argv: see pd/auth.py
        env.pop("KTHENA_API_KEY", None)
        if self.api_key:
            env["KTHENA_API_KEY"] = self.api_key
        out = subprocess.DEVNULL if self.quiet else None
        worker.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)

    def _prefill_hosts(self) -> set[str]:
        return set(LOOPBACK_HOSTS) | {self._host(s.name) for s in self.specs
                                      if s.role == "prefill"}

    def _wait_ready(self, worker: _Worker, timeout_s: float) -> None:
        ready = self._ready_file(worker)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if worker.proc is not None and worker.proc.poll() is not None:
                raise RuntimeError(f"PD worker {worker.spec.name} exited with "
                                   f"{worker.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"PD worker {worker.spec.name} not ready in {timeout_s:g} s")
            time.sleep(0.05)
        worker.port = int(ready.read_text())

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            for worker in self.workers.values():
                proc = worker.proc
                if proc is None or proc.poll() is None or self._stopping.is_set():
                    continue
                removed = cleanup_shm(proc.pid)
                log.warning("PD worker %s (pid %d) exited with %s; removed shm %s",
                            worker.spec.name, proc.pid, proc.returncode, removed)
                worker.proc = None
                if self.restart:
                    self._restart(worker)

    def _restart(self, worker: _Worker) -> None:
        worker.num_restarts += 1
        try:
            self._spawn(worker)  # same port: the router's URL stays valid
            self._wait_ready(worker, 600)
        except (RuntimeError, TimeoutError, OSError) as error:
            log.error("restarting %s failed: %s", worker.spec.name, error)
            return
        if self.on_restart is not None:
            self.on_restart(worker.spec.name, self.url(worker.spec.name))
