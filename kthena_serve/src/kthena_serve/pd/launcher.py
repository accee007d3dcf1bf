"""Starts the PD workers of one deployment: prefill workers first on the cores, then decode.

``PDLauncher`` is a ``ProcessLauncher`` (cluster/launcher.py: ready files, restarts, stop, shm
clean-up, the secret) that says what a PD worker runs: ``python -m kthena_serve.pd.worker`` with
its role, cores and the deployment as a ``ServeSpec``'s JSON (``--spec``: the engine, the PD
settings, the served model name, public metrics and the worker's own KV events). Prefill is compute-bound, so ``split_cores``
gives prefill workers the first shares (and any remainder).

Each decode worker is told the prefill workers' hosts (``--prefill-hosts``: loopback plus
``host`` / ``worker_hosts``). The workers' OpenAI routes (what the Kthena router calls) get
``api_key`` in the environment (``KTHENA_API_KEY``); without one they are open, as ``kthena
serve`` without ``--api-key``. With ``public_metrics`` every worker serves ``/metrics`` without
the secret (the spec's ``public_metrics``). With ``kv_events`` every worker publishes its KV events to
Redis under its own owner name (``KVEventsConfig.for_worker``: ``NAME-WORKER.NAMESPACE``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kthena_serve.cluster.auth import LOOPBACK_HOSTS
from kthena_serve.cluster.config import worker_names
from kthena_serve.cluster.launcher import ProcessLauncher, WorkerProcess, WorkerSpec, share_cores
from kthena_serve.model.source import served_name
from kthena_serve.spec import ServeSpec

if TYPE_CHECKING:
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.kv_events.config import KVEventsConfig
    from kthena_serve.pd.config import PDConfig

__all__ = ["PDLauncher", "split_cores"]


def split_cores(cores: list[int], num_prefill: int, num_decode: int) -> list[WorkerSpec]:
    """``prefill-0``.. then ``decode-0``.. and their cores: disjoint sets when there are enough
    cores (prefill first), else round-robin sharing (``share_cores``).

    Raises:
        ValueError: no worker, or no core.
    """
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    names = worker_names(num_prefill, num_decode)
    if not roles:
        raise ValueError("start at least one decode worker")
    return [WorkerSpec(name, role, share) for name, role, share in
            zip(names, roles, share_cores(cores, len(roles)), strict=True)]


class PDLauncher(ProcessLauncher):
    """Worker processes for one PD deployment on this host.

    Args:
        engine_config: every worker's engine (sent to each as JSON).
        pd_config: the deployment's PD settings (sent as JSON).
        num_prefill, num_decode: worker counts.
        cores: CPU ids to split (default: this process's affinity mask).
        restart: start a worker again when it dies.
        on_restart: called with (name, url) after a restarted worker is ready.
        api_key: what the workers' OpenAI routes require (None: nothing).
        public_metrics: the workers serve /metrics without the secret.
        kv_events: every worker publishes its KV cache's router chunks to this Redis, under
            its own owner name (``kv_events.for_worker(name)``); None: no worker publishes.
        served_model_name: the model id the workers' OpenAI routes serve (default:
            ``kv_events.model``, else the model's own name).

    Attributes:
        secret: this deployment's secret; every worker call needs it (cluster/auth.py).
    """

    kind = "PD worker"
    folder_prefix = "kthena-pd-"

    def __init__(self, engine_config: EngineConfig, pd_config: PDConfig, num_prefill: int,
                 num_decode: int,
                 *, cores: list[int] | None = None, host: str = "127.0.0.1", restart: bool = True,
                 on_restart: Callable[[str, str], None] | None = None,
                 mooncake_host: str | None = None, quiet: bool = False,
                 worker_hosts: dict[str, str] | None = None,
                 worker_prefix: dict[str, list[str]] | None = None,
                 api_key: str | None = None, public_metrics: bool = False,
                 kv_events: KVEventsConfig | None = None,
                 served_model_name: str | None = None) -> None:
        cores = cores or sorted(os.sched_getaffinity(0))
        super().__init__(split_cores(cores, num_prefill, num_decode), host=host,
                         restart=restart, on_restart=on_restart, quiet=quiet)
        self.engine_config = engine_config
        self.pd_config = pd_config
        self.mooncake_host = mooncake_host
        self.worker_hosts = worker_hosts or {}  # e.g. one address per network namespace
        self.worker_prefix = worker_prefix or {}  # e.g. ["ip", "netns", "exec", "ns-b"]
        self.api_key = api_key
        self.public_metrics = public_metrics
        self.kv_events = kv_events
        self.served_model_name = (served_model_name or (kv_events.model if kv_events else None)
                                  or served_name(engine_config.model))

    def _host(self, name: str) -> str:
        return self.worker_hosts.get(name, self.host)

    def _command(self, worker: WorkerProcess, ready: Path) -> list[str]:
        name = worker.spec.name
        cmd = [*self.worker_prefix.get(name, []), sys.executable, "-m",
               "kthena_serve.pd.worker", "--role", worker.spec.role,
               "--name", name, "--host", self._host(name), "--port", str(worker.port),
               "--cores", ",".join(map(str, worker.spec.cores)), "--ready-file", str(ready),
               "--spec", json.dumps(self.worker_spec(name).to_json())]
        mooncake_host = self.mooncake_host or self.worker_hosts.get(name)
        if mooncake_host:
            cmd += ["--mooncake-host", mooncake_host]
        if worker.spec.role == "decode":
            cmd += ["--prefill-hosts", ",".join(sorted(self._prefill_hosts()))]
        return cmd

    def worker_spec(self, name: str) -> ServeSpec:
        """What worker ``name`` serves: this deployment's engine and PD settings, its served
        model name and public metrics, and its own KV events' owner name. A worker reads only
        these fields (its address and cores come as flags)."""
        own = None if self.kv_events is None else self.kv_events.for_worker(name)
        return ServeSpec(engine=self.engine_config, mode="pd", pd=self.pd_config,
                         served_model_name=self.served_model_name,
                         public_metrics=self.public_metrics, kv_events=own)

    def _environment(self, worker: WorkerProcess) -> dict[str, str]:
        env = super()._environment(worker)
        if self.api_key:
            env["KTHENA_API_KEY"] = self.api_key
        return env

    def _prefill_hosts(self) -> set[str]:
        return set(LOOPBACK_HOSTS) | {self._host(s.name) for s in self.specs
                                      if s.role == "prefill"}
