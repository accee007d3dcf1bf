"""Tensor parallelism for the engine: rank 0 schedules and samples, ranks 1.. mirror its forwards.

    engine process (rank 0)                      worker process (rank r)
    build inputs ── broadcast_object_list ─────▶ same inputs
    forward (my heads) ◀──── all_reduce ───────▶ forward (its heads)
    logits → sampler                              (logits dropped)

Each rank is pinned to one core and runs one torch thread, with ``OMP_WAIT_POLICY=PASSIVE`` in
its environment before torch loads, so two ranks on two cores never spin against each other.
Every rank holds its own KV pool for its own KV heads with the same number of blocks, so the
scheduler's block ids mean the same slots everywhere. Groups come from kthena_comm. All ranks
are processes of this host, so nothing they open needs to be reachable from elsewhere: the
rendezvous store listens on 127.0.0.1 only, and gloo's sockets bind loopback too (see
``_loopback_gloo``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import sys

import attrs
import torch

from kthena_serve.config import EngineConfig
from kthena_serve.errors import RankDiedError
from kthena_serve.model_inputs import build_inputs
from kthena_serve.model_runner import ModelRunner, create_pool, kv_layout_for, sampled_logits
from kthena_serve.scheduler import ScheduledBatch
from kthena_serve.threads import configure_threads, owned_cores, prepare_worker_env

__all__ = ["TPModelRunner"]


_MASTER_ADDR = "127.0.0.1"  # every rank is on this host: nothing else needs the store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_MASTER_ADDR, 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int):  # noqa: ANN202
    from kthena_comm.env import RankEnv

    return RankEnv(rank=rank, world_size=world_size, master_addr=_MASTER_ADDR, master_port=port)


def _pin(rank: int) -> None:
    cores = owned_cores()
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    configure_threads()  # one thread: the affinity mask now holds one core


def _join(config: EngineConfig, rank: int, port: int, check_peers=None):  # noqa: ANN001, ANN202
    """Join the groups and load this rank's shard; returns (groups, model, tokenizer).

    ``check_peers`` runs while rank 0 waits for the others (see ``_check_workers``).
    """
    from kthena_comm.groups import init_parallel_groups
    from kthena_comm.layout import ParallelConfig
    from kthena_serve.model import TensorParallel, load_model

    _pin(rank)
    layout = ParallelConfig(tp_size=config.tp, pp_size=1, dp_size=1, sp_size=1)
    groups = init_parallel_groups(layout, _rank_env(rank, config.tp, port),
                                  check_peers=check_peers)
    tp = TensorParallel.from_comm_group(groups.tp)
    model, tokenizer = load_model(config.model, dtype=config.torch_dtype, tp=tp)
    return groups, model, tokenizer


def _worker_main(config: EngineConfig, rank: int, port: int) -> None:
    import torch.distributed as dist

    groups, model, _ = _join(config, rank, port)
    runner = ModelRunner(model, create_pool(_layout(config, model), config))
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            runner.forward(box[0])
    finally:
        runner.close()
        groups.destroy()


def _layout(config: EngineConfig, model):  # noqa: ANN001, ANN202
    """This rank's pool layout: its own KV heads, the block count every rank shares."""
    return kv_layout_for(model.config.num_hidden_layers, model.num_kv_heads_per_rank,
                         model.head_dim, config)


def _check_workers(workers: list[mp.process.BaseProcess]) -> None:
    """Raise ``RankDiedError`` for the first worker whose process has exited (rank = index + 1).

    Rank 0 calls this while it waits for the ranks to join, so a rank that dies on start is
    reported at once, with its exit code, instead of as a rendezvous timeout a minute later.
    """
    for rank, worker in enumerate(workers, start=1):
        if worker.exitcode is not None:  # a non-blocking waitpid
            raise RankDiedError(_death_message(rank, worker), rank, worker.exitcode)


def _death_message(rank: int, worker: mp.process.BaseProcess) -> str:
    code = worker.exitcode
    assert code is not None
    how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
    message = (f"tensor-parallel rank {rank} (process {worker.name}, pid {worker.pid}) {how} "
               "before joining rank 0; its own error is on stderr above.")
    if _spawn_reruns_main():  # the usual cause of a rank dying on start
        message += (" Each rank is a spawned process that first imports your main script: if "
                    "the script creates the engine (LLM(tp=...)) at top level, that import "
                    "starts the engine again and multiprocessing stops it (\"An attempt has been "
                    "made to start a new process before the current process has finished its "
                    "bootstrapping phase\"). Put that code under "
                    '`if __name__ == "__main__":`.')
    return message


def _spawn_reruns_main() -> bool:
    """Whether spawned children import this process's ``__main__`` (a script or ``-m`` module),
    as multiprocessing's spawn does; not for ``python -c`` or an interactive session."""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is not None or bool(getattr(main, "__file__", None))


@contextlib.contextmanager
def _loopback_gloo():
    """Gloo binds the address this host's name resolves to (often a LAN address) unless
    ``GLOO_SOCKET_IFNAME`` names an interface: name loopback while the groups form (children
    inherit it at spawn). A value the user set is kept."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


@contextlib.contextmanager
def _worker_environment():
    """Children inherit os.environ at spawn: give them PASSIVE OpenMP and one thread."""
    saved = dict(os.environ)
    prepare_worker_env(os.environ, 1)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class TPModelRunner:
    """A ModelRunner spread over ``config.tp`` processes (this one is rank 0).

    Attributes:
        model, tokenizer: rank 0's shard and the tokenizer.
    """

    def __init__(self, config: EngineConfig) -> None:
        """Start ranks 1.. as spawned processes and join them as rank 0.

        Raises:
            RankDiedError: a rank's process exited before it joined (at once, not on timeout).
            kthena_comm.errors.InitError: the ranks did not all join within the deadline.
        """
        port = _free_port()
        self._config = self._fixed_pool_size(config)
        with _loopback_gloo():
            self._workers = self._start_workers(port)
            try:
                self._groups, self.model, self.tokenizer = _join(
                    self._config, 0, port, check_peers=lambda: _check_workers(self._workers))
            except BaseException:
                self._stop_workers(grace_s=0)
                raise
        self._inner = ModelRunner(self.model, create_pool(_layout(self._config, self.model),
                                                          self._config))
        self.block_size = config.block_size

    def _start_workers(self, port: int) -> list[mp.process.BaseProcess]:
        context = mp.get_context("spawn")
        workers = []
        with _worker_environment():
            for rank in range(1, self._config.tp):
                worker = context.Process(target=_worker_main, args=(self._config, rank, port),
                                         name=f"kthena-tp{rank}", daemon=True)
                worker.start()
                workers.append(worker)
        return workers

    def _stop_workers(self, grace_s: float = 10) -> None:
        """Wait up to ``grace_s`` for each worker to exit, then terminate it."""
        for worker in self._workers:
            worker.join(timeout=grace_s)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        self._workers = []

    @staticmethod
    def _fixed_pool_size(config: EngineConfig) -> EngineConfig:
        """Ranks may hold different KV head counts (3 heads over 2 ranks: 2 + 1); all need the
        same block count, sized here by the largest share so every rank fits the budget."""
        if config.num_kv_blocks is not None:
            return config
        from kthena_core import kv_heads_per_rank
        from kthena_serve.model import ModelConfig, resolve_checkpoint

        model = ModelConfig.from_pretrained(resolve_checkpoint(config.model))
        heads = kv_heads_per_rank(model.num_key_value_heads, config.tp)
        layout = kv_layout_for(model.num_hidden_layers, heads, model.head_dim, config)
        return attrs.evolve(config, num_kv_blocks=layout.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self._inner.num_blocks

    @property
    def device(self) -> torch.device:
        return self._inner.device

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        import torch.distributed as dist

        inputs = build_inputs(batch, self.block_size, self._inner.device)
        dist.broadcast_object_list([inputs], src=0)
        return sampled_logits(self._inner.forward(inputs), batch)

    def close(self) -> None:
        import torch.distributed as dist

        if not self._workers:
            return
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([None], src=0)
        self._stop_workers()
        self._inner.close()
        self._groups.destroy()
