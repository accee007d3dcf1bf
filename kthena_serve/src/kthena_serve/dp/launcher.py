"""Starts the replicas of ``kthena serve --dp N`` as processes on split cores.

The launcher base every deployment shares (cluster/launcher.py ``ProcessLauncher``: ready
files, restart of a replica that dies, SIGTERM then SIGKILL on stop, the deployment secret in
each child's environment) with the replica's command line (dp/replica.py). Cores, from this
process's affinity mask::

    cores >= N    disjoint shares, the first replicas take any remainder
                  (8 cores, N = 3: replica-0 0,1,2  replica-1 3,4,5  replica-2 6,7)
    cores <  N    one core each, round-robin: replica i gets core i % cores

A replica of ``tp x pp`` ranks runs one thread per core each rank owns (the share divided by
the ranks, at least 1); its ranks pin themselves inside the share (parallel_runner.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kthena_serve.cluster.config import Role
from kthena_serve.cluster.launcher import ProcessLauncher, WorkerProcess, WorkerSpec, share_cores
from kthena_serve.engine.threads import owned_cores

if TYPE_CHECKING:
    from kthena_serve.engine.config import EngineConfig

__all__ = ["ReplicaLauncher", "replica_specs"]

ROLE = Role.COLOCATED.value  # a replica computes its prompts and decodes them


def replica_specs(cores: list[int], num_replicas: int) -> list[WorkerSpec]:
    """``replica-0`` .. ``replica-{N-1}`` and their cores (see module docs).

    Raises:
        ValueError: ``num_replicas`` < 1 or no core.
    """
    return [WorkerSpec(f"replica-{i}", ROLE, share)
            for i, share in enumerate(share_cores(cores, num_replicas))]


class ReplicaLauncher(ProcessLauncher):
    """The replica processes of one data-parallel deployment on this host (127.0.0.1 only).

    Args:
        engine_config: every replica's engine (sent to each as JSON).
        num_replicas: how many replicas.
        served_model_name: the ``model`` the replicas' OpenAI routes accept.
        cores: CPU ids to split (default: this process's affinity mask).
        restart: start a replica again when it dies (same port).
        on_restart: called with (name, url) after a restarted replica is ready.
        stream_stall_timeout: the replicas' ``--stream-stall-timeout`` (None: its default).
        tool_call_parser: the replicas' ``--tool-call-parser`` (they parse chat output).
        disable_any_whitespace: the replicas' JSON whitespace default
            (``--structured-outputs-config``; they read the requests).
        quiet: send the replicas' output to /dev/null.

    Attributes:
        secret: this deployment's secret; every call to a replica but /health needs it.
    """

    kind = "DP replica"
    folder_prefix = "kthena-dp-"

    def __init__(self, engine_config: EngineConfig, num_replicas: int, served_model_name: str, *,
                 cores: list[int] | None = None, restart: bool = True,
                 on_restart: Callable[[str, str], None] | None = None,
                 stream_stall_timeout: float | None = None, quiet: bool = False,
                 tool_call_parser: str = "hermes", disable_any_whitespace: bool = True) -> None:
        super().__init__(replica_specs(cores or owned_cores(), num_replicas), restart=restart,
                         on_restart=on_restart, quiet=quiet)
        self.engine_config = engine_config
        self.served_model_name = served_model_name
        self.stream_stall_timeout = stream_stall_timeout
        self.tool_call_parser = tool_call_parser
        self.disable_any_whitespace = disable_any_whitespace
        self.num_ranks = engine_config.world_size

    def threads_per_rank(self, worker: WorkerProcess) -> int:
        """OpenMP threads of each of the replica's ranks: its cores / ranks, at least 1."""
        return max(1, len(worker.spec.cores) // self.num_ranks)

    def _command(self, worker: WorkerProcess, ready: Path) -> list[str]:
        cmd = [sys.executable, "-m", "kthena_serve.dp.replica", "--name", worker.spec.name,
               "--cores", ",".join(map(str, worker.spec.cores)),
               "--ranks", str(self.num_ranks), "--port", str(worker.port),
               "--ready-file", str(ready), "--engine-config", json.dumps(self.engine_config.to_json()),
               "--served-model-name", self.served_model_name,
               "--tool-call-parser", self.tool_call_parser]
        if self.stream_stall_timeout is not None:
            cmd += ["--stream-stall-timeout", str(self.stream_stall_timeout)]
        if not self.disable_any_whitespace:
            cmd.append("--any-whitespace")
        return cmd

    def _environment(self, worker: WorkerProcess) -> dict[str, str]:
        env = super()._environment(worker)
        env["OMP_NUM_THREADS"] = str(self.threads_per_rank(worker))
        return env
