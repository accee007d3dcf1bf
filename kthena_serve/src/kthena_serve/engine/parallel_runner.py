"""Tensor x pipeline parallelism for the engine: rank 0 schedules and samples, the others mirror
its forwards.

    rank 0 (stage 0, tp 0)                       every other rank
    split the step into micro-batches
    build inputs ── broadcast_object_list ─────▶ the same inputs
    stage 0 layers (my heads) ◀── all_reduce ──▶ (TP peers of stage 0)
           └─ (hidden, residual) ── send ──────▶ stage 1 ... ─▶ last stage: logits
    logits ◀──────────────────── send ────────── last stage, tp 0
    logits → sampler

Global rank = pp_idx * tp + tp_idx (kthena_comm's layout order). Each stage holds its own
layers (`PipelineStage`), each TP rank its own heads, and each rank its own KV pool for its own
layers and heads with the same number of blocks, so the scheduler's block ids mean the same slots
everywhere. A step is cut into micro-batches (``pp_microbatches``, or by default
min(pp, tokens / MIN_MICROBATCH_TOKENS)), contiguous runs of sequences with near-equal token
counts: stage 0 sends micro-batch m and goes on to m+1 while stage 1 computes m, so the stages
overlap instead of waiting for the whole step.

Each rank binds its device (``cpu``, or ``<type>:LOCAL_RANK`` of ``config.device``), joins the
groups over that device's backend (gloo / nccl / hccl: `kthena_serve.engine.placement`), loads its own
shard onto it (built on the meta device, each checkpoint slice copied in) and creates its pool
there. Rank 0 broadcasts each step's inputs as host tensors (a pickled device tensor would come
back on rank 0's device index); every rank moves them to its device, and the stage-to-stage
sends and the logits stay there.

Ranks come from one of two places (``EngineConfig.ranks_from``):

* ``spawn``: this process is rank 0 and starts ranks 1.. itself as spawned processes of this
  host. Each is pinned to one core and runs one torch thread, with ``OMP_WAIT_POLICY=PASSIVE``
  set before torch loads. The rendezvous store listens on 127.0.0.1 only, and gloo binds
  loopback (``_loopback_gloo``): nothing they open is reachable from elsewhere.
* ``env``: a launcher (``kthena-run`` / torchrun, on one host or several) started every rank and
  set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; rank 0 serves (`ParallelModelRunner`), the
  others run `serve_rank`. The network is the launcher's: gloo binds the interface named by
  ``GLOO_SOCKET_IFNAME`` (``kthena-run`` sets it to the one that reaches the master).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from kthena_core.ports import free_port
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import RankDiedError
from kthena_serve.engine.layer_copy import LayerCopy, RankCopier
from kthena_serve.engine.model_inputs import ModelInputs, build_inputs
from kthena_serve.engine.model_runner import (
    create_pool,
    kv_layout_for,
    layer_caches,
    sampled_logits,
)
from kthena_serve.engine.placement import RankPlacement, group_config, rank_device
from kthena_serve.engine.scheduled import ScheduledBatch
from kthena_serve.engine.threads import configure_threads, owned_cores, prepare_worker_env
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import SHM_DIR, KVPool

if TYPE_CHECKING:
    from kthena_comm.groups import GroupConfig

__all__ = ["MIN_MICROBATCH_TOKENS", "ParallelModelRunner", "serve_rank", "split_microbatches"]


# Without pp_microbatches, a step is cut into min(pp, tokens / this) micro-batches: a forward
# has a fixed cost (~17 ms for SmolLM2's 15-layer stage at batch 1 here) that splitting repeats,
# so a small decode step runs whole (stages alternate) and a prefill-sized one is pipelined.
MIN_MICROBATCH_TOKENS = 64
_MASTER_ADDR = "127.0.0.1"  # spawn: every rank is on this host, nothing else needs the store
_PLACEMENT = "placement"  # rank 0's broadcast asking every rank for its RankPlacement
_POOLS = "pools"  # rank 0's broadcast asking every rank for its shared pool's name and layout


def _rank_env(rank: int, world_size: int, port: int):  # noqa: ANN202
    from kthena_comm.env import RankEnv

    return RankEnv(rank=rank, world_size=world_size, local_rank=rank,  # all on this host
                   master_addr=_MASTER_ADDR, master_port=port)


def _pin(index: int) -> None:
    cores = owned_cores()
    os.sched_setaffinity(0, {cores[index % len(cores)]})
    configure_threads()  # one thread: the affinity mask now holds one core


def split_microbatches(batch: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """Cut ``batch`` into at most ``parts`` contiguous runs of sequences with near-equal token
    counts (never an empty one); their concatenation is ``batch.seqs`` in order."""
    seqs = batch.seqs
    parts = max(1, min(parts, len(seqs)))
    if parts == 1:
        return [ScheduledBatch(seqs)]
    total = sum(len(s.token_ids) for s in seqs)
    runs: list[ScheduledBatch] = []
    start = done = 0
    for i, seq in enumerate(seqs):
        done += len(seq.token_ids)
        left_seqs, left_parts = len(seqs) - i - 1, parts - len(runs) - 1
        if left_parts and (done * parts >= total * (len(runs) + 1) or left_seqs == left_parts):
            runs.append(ScheduledBatch(seqs[start:i + 1]))
            start = i + 1
    runs.append(ScheduledBatch(seqs[start:]))
    return runs


class _Stage:
    """This rank's share of a step: its layers over its pool, and the sends between stages."""

    def __init__(self, config: EngineConfig, rank_env, group: GroupConfig,  # noqa: ANN001
                 check_peers=None, shared_pool: bool = False) -> None:  # noqa: ANN001
        from kthena_comm.groups import init_parallel_groups

        self.shared_pool = shared_pool

        _pin(rank_env.local_rank)
        self.device = rank_device(config, rank_env.local_rank)
        self.groups = init_parallel_groups(config.layout, rank_env, group,
                                           check_peers=check_peers)
        try:  # a model this rank cannot load leaves no process group behind
            stage = self._load(config)
        except BaseException:
            self.groups.destroy()
            raise
        self.kv_caches = layer_caches(self.pool)
        self.stage, self.tp_rank, self.dtype = stage, self.groups.tp.group_rank, config.torch_dtype
        ranks = self.groups.pp.ranks
        self.prev = ranks[stage.rank - 1] if not stage.is_first else None
        self.next = ranks[stage.rank + 1] if not stage.is_last else None
        self.head = ranks[0]  # stage 0 of my TP column: global rank 0 for tp rank 0
        self.copier: RankCopier | None = None  # layer-wise copies out of this pool (PD)

    def _load(self, config: EngineConfig):  # noqa: ANN202 - a PipelineStage
        """This rank's stage of the model, its weights and its pool; returns the stage."""
        from kthena_serve.model import PipelineStage, TensorParallel, load_model
        from kthena_serve.model.config import ModelConfig
        from kthena_serve.model.loader import resolve_checkpoint

        layers = ModelConfig.from_pretrained(resolve_checkpoint(config.model)).shape.num_layers
        stage = PipelineStage.of(layers, config.pp, self.groups.pp.group_rank,
                                 _rank0_split_points(config.pipeline_split_points))
        tp = TensorParallel.from_comm_group(self.groups.tp,
                                            _tp_overlap(config, self.groups.tp, self.device))
        self.model, self.tokenizer = load_model(config.model, dtype=config.torch_dtype,
                                                device=self.device, tp=tp, stage=stage,
                                                quantization=config.quantization,
                                                kernels=config.kernels,
                                                kv_block_size=config.block_size,
                                                sp=_sequence_parallel(config),
                                                expert_parallel=config.expert_parallel)
        self.pool = create_pool(_layout(config, self.model), config, device=self.device,
                                shared=self.shared_pool)
        return stage

    def placement(self) -> RankPlacement:
        """Where this rank's parameters, buffers and pool tensors are."""
        pool = [self.pool.buffer, *(t for layer in self.kv_caches for t in layer)]
        return RankPlacement.of(self.groups.world.rank, self.device, self.groups.backend,
                                self.model, pool)

    @torch.inference_mode()
    def run(self, micro: list[ModelInputs], copies: Sequence[LayerCopy] = ()
            ) -> list[torch.Tensor]:
        """Forward every micro-batch (host tensors) through this stage, on this rank's device;
        rank 0 gets each one's logits back. ``copies``: this rank's heads of each layer copied
        into other pools right after the layer ran (`layer_copy`; pp = 1 only)."""
        from kthena_comm.collectives import recv, send

        pp, stage, device = self.groups.pp, self.stage, self.device
        on_layer = None
        if copies:
            if stage.size > 1:
                raise ValueError("layer-wise copies need pp=1: a stage holds only its layers")
            if self.copier is None:
                self.copier = RankCopier(self.tp_rank, self.pool)
            on_layer = self.copier.hook(copies)
        hidden_size, dtype = self.model.config.shape.hidden_size, self.dtype
        pending, logits = [], []
        micro = [inputs.to(device) for inputs in micro]
        for inputs in micro:
            hidden = None
            if not stage.is_first:
                both = torch.empty(2, inputs.input_ids.shape[0], hidden_size, dtype=dtype,
                                   device=device)
                recv(both, pp, self.prev)
                hidden = (both[0], both[1])
            out = self.model.forward_stage(inputs.input_ids, inputs.positions, inputs.attention,
                                           self.kv_caches, hidden, on_layer=on_layer)
            if not stage.is_last:
                pending.append(send(torch.stack(out), pp, self.next, async_op=True))
            elif stage.is_first:
                logits.append(out)  # pp == 1: rank 0 computed them
            elif self.tp_rank == 0:  # the LM head's output was in the model dtype: exact
                pending.append(send(out.to(dtype), pp, self.head, async_op=True))
        if stage.size > 1 and stage.is_first and self.tp_rank == 0:
            vocab = self.model.config.shape.vocab_size
            for inputs in micro:
                rows = torch.empty(len(inputs.attention.logits_indices), vocab, dtype=dtype,
                                   device=device)
                recv(rows, pp, self.groups.pp.ranks[-1])
                logits.append(rows.float())
        for handle in pending:
            handle.wait()
        return logits

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        self.pool.close()
        self.groups.destroy()


def _sequence_parallel(config: EngineConfig):  # noqa: ANN202
    """SP over the TP group for forwards of ``sp_min_tokens`` or more (None: ``sp == 1``)."""
    from kthena_serve.model import SequenceParallel

    return SequenceParallel(config.sp_min_tokens) if config.sp > 1 else None


def _tp_overlap(config: EngineConfig, group, device: torch.device):  # noqa: ANN001, ANN202
    """MC2 ops over the TP group when ``tp_overlap`` is on (None: matmul, then collective)."""
    if not config.tp_overlap:
        return None
    from kthena_serve.model import mc2_overlap

    return mc2_overlap(group, device.type, num_tiles=config.tp_overlap_tiles,
                       sequence_parallel=config.sp > 1)


def _rank0_split_points(points: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Rank 0's ``pipeline_split_points``, on every rank. Under a launcher each rank resolved
    its own config, and a plan's moved split rests on figures measured on each host; rank 0's
    is the one it serves and reports, so every stage is cut where rank 0 cuts it."""
    import torch.distributed as dist

    box = [points]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _layout(config: EngineConfig, model):  # noqa: ANN001, ANN202
    """This rank's pool layout: its own layers and KV heads, the block count every rank shares."""
    return kv_layout_for(len(model.layers), model.num_kv_heads_per_rank, model.head_dim, config,
                         num_parts=model.kv_parts)


def _serve_steps(stage: _Stage) -> None:
    import torch.distributed as dist

    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            if box[0] == _PLACEMENT:
                dist.gather_object(stage.placement(), None, dst=0)
                continue
            if box[0] == _POOLS:
                dist.gather_object((stage.pool.name, stage.pool.layout), None, dst=0)
                continue
            stage.run(*box[0])
    finally:
        stage.close()


def _worker_main(config: EngineConfig, rank: int, port: int, group: GroupConfig,
                 shared_pool: bool = False) -> None:
    _exit_with_parent()
    _serve_steps(_Stage(config, _rank_env(rank, config.world_size, port), group,
                        shared_pool=shared_pool))


def _exit_with_parent(interval_s: float = 0.5) -> None:
    """A spawned rank ends when rank 0's process is gone (killed, say, while the ranks still
    met): a daemon thread sees the parent change, unlinks the /dev/shm pools this process made
    and exits. Rank 0's close() stops ranks the normal way; this covers the rest."""
    import threading
    import time

    from mooncake_kv import shared_pool_paths

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        for path in shared_pool_paths(os.getpid()):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os._exit(1)

    threading.Thread(target=watch, name="kthena-rank-parent", daemon=True).start()


def serve_rank(config: EngineConfig, rank_env) -> None:  # noqa: ANN001 - kthena_comm RankEnv
    """Run rank ``rank_env.rank`` (> 0) of a launcher-started deployment until rank 0 closes.

    Raises:
        ValueError: rank 0 (it serves: build the engine with ``ranks_from="env"``), or a
            WORLD_SIZE other than tp x pp.
        kthena_serve.engine.placement.DistBackendError: ``KTHENA_DIST_BACKEND`` does not fit the device.
        kthena_comm.errors.DeviceUnavailableError: no device LOCAL_RANK on this host.
    """
    _check_world(config, rank_env)
    if rank_env.rank == 0:
        raise ValueError("rank 0 serves the API: build the engine (ranks_from='env') there; "
                         "serve_rank is for ranks 1..")
    _serve_steps(_Stage(config, rank_env, group_config(config)))


def _check_world(config: EngineConfig, rank_env) -> None:  # noqa: ANN001
    if rank_env.world_size != config.world_size:
        raise ValueError(f"WORLD_SIZE={rank_env.world_size}, but tp {config.tp} x pp {config.pp} "
                         f"needs {config.world_size} ranks; launch that many (kthena-run "
                         "--nnodes x --nproc_per_node) or change --tp / --pp")


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
    message = (f"parallel rank {rank} (process {worker.name}, pid {worker.pid}) "
               f"{_how_it_ended(code)} "
               "before joining rank 0; its own error is on stderr above.")
    if _spawn_reruns_main():  # the usual cause of a rank dying on start
        message += (" Each rank is a spawned process that first imports your main script: if "
                    "the script creates the engine (LLM(tp=...)) at top level, that import "
                    "starts the engine again and multiprocessing stops it (\"An attempt has been "
                    "made to start a new process before the current process has finished its "
                    "bootstrapping phase\"). Put that code under "
                    '`if __name__ == "__main__":`.')
    return message


def _how_it_ended(code: int) -> str:
    """A process's exit status in words (negative: the signal that killed it)."""
    return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"


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


class ParallelModelRunner:
    """A model runner spread over ``config.tp * config.pp`` processes (this one is rank 0).

    Args:
        config: the engine config (``tp``, ``pp``, ``pp_microbatches``, ``ranks_from``).
        rank_env: with ``ranks_from="env"``, this process's launcher environment
            (``RankEnv.from_env()``; its rank must be 0).
        shared_pool: every rank makes its pool a /dev/shm file (``rank_pools`` names them):
            what a PD worker's ranks hold, which the hand-off maps and copies between.

    Attributes:
        model, tokenizer: rank 0's shard (stage 0's layers, its heads) and the tokenizer.
        takes_layer_copies: ``execute`` runs layer-wise copies in every rank (``copies``)
            where a one-process runner takes a per-layer hook.
    """

    takes_layer_copies = True

    def __init__(self, config: EngineConfig, rank_env=None, *,  # noqa: ANN001
                 shared_pool: bool = False) -> None:
        """Start ranks 1.. (spawn) or join the launcher's ranks (env), as rank 0.

        Raises:
            RankDiedError: a spawned rank exited before it joined (at once, not on timeout).
            kthena_comm.errors.InitError: the ranks did not all join within the deadline.
            ValueError: ``ranks_from="env"`` without rank 0 of a tp x pp world.
            kthena_serve.engine.placement.DistBackendError: ``KTHENA_DIST_BACKEND`` (read here, and
                by each launcher-started rank) does not name the device's backend.
        """
        group = group_config(config)  # before any rank starts: a bad variable is one error
        if shared_pool and (config.ranks_from == "env" or str(config.device) != "cpu"):
            raise ValueError("shared rank pools are /dev/shm files of one host's spawned ranks: "
                             "they need ranks_from='spawn' and device 'cpu'")
        self._shared_pool = shared_pool
        self._rank_pool_names: list[str] = []  # rank_pools(): what close() unlinks if left
        self._config = self._fixed_pool_size(config)
        # Rank 0 pins this process to one core and one thread; close() gives both back, so a
        # later engine of this process spawns its ranks onto every core again.
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        self._workers: list[mp.process.BaseProcess] = []
        self._stage: _Stage | None = None
        if config.ranks_from == "env":
            if rank_env is None or rank_env.rank != 0:
                raise ValueError("ranks_from='env': pass rank 0's RankEnv (RankEnv.from_env()); "
                                 "the other ranks run serve_rank")
            _check_world(config, rank_env)
            self._stage = _Stage(self._config, rank_env, group)
        else:
            port = free_port(_MASTER_ADDR)
            with _loopback_gloo():
                self._workers = self._start_workers(port, group)
                try:
                    self._stage = _Stage(self._config, _rank_env(0, config.world_size, port),
                                         group, check_peers=lambda: _check_workers(self._workers),
                                         shared_pool=shared_pool)
                except BaseException:
                    self._stop_workers(grace_s=0)
                    os.sched_setaffinity(0, self._saved[0])
                    torch.set_num_threads(self._saved[1])
                    raise
        self.model, self.tokenizer = self._stage.model, self._stage.tokenizer
        self.block_size = config.block_size
        self._parts = config.pp_microbatches

    def _start_workers(self, port: int, group: GroupConfig) -> list[mp.process.BaseProcess]:
        context = mp.get_context("spawn")
        workers = []
        with _worker_environment():
            for rank in range(1, self._config.world_size):
                worker = context.Process(target=_worker_main,
                                         args=(self._config, rank, port, group,
                                               self._shared_pool),
                                         name=f"kthena-rank{rank}", daemon=True)
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
        """Ranks may hold different KV head counts (3 heads over 2 ranks: 2 + 1) and stages
        different layer counts (``pipeline_split_points``); all need the same block count, sized
        here by the largest share of heads and the stage with the most layers, so every rank
        fits the budget (a stage with fewer layers has a smaller pool of as many blocks).

        Raises:
            TensorParallelError: the split points do not cut the model's layers into pp
                non-empty stages (checked here, before any rank starts).
        """
        from kthena_serve.model import ModelConfig, PipelineStage, resolve_checkpoint

        model = ModelConfig.from_pretrained(resolve_checkpoint(config.model))
        layers = max(len(PipelineStage.of(model.shape.num_layers, config.pp, stage,
                                          config.pipeline_split_points).layers)
                     for stage in range(config.pp))
        if config.num_kv_blocks is not None:
            return config
        layout = kv_layout_for(layers, model.kv_heads_per_rank(config.tp), model.kv_head_dim,
                               config, num_parts=model.kv_parts)
        return attrs.evolve(config, num_kv_blocks=layout.num_blocks)

    @property
    def num_blocks(self) -> int:
        assert self._stage is not None
        return self._stage.pool.layout.num_blocks

    @property
    def device(self) -> torch.device:
        assert self._stage is not None
        return self._stage.device

    def placements(self) -> list[RankPlacement]:
        """Every rank's `RankPlacement`, in rank order: the device it bound, its backend, and
        where its parameters, buffers and KV pool tensors are (asked of each rank between
        steps)."""
        import torch.distributed as dist

        assert self._stage is not None
        dist.broadcast_object_list([_PLACEMENT], src=0)
        gathered: list[RankPlacement | None] = [None] * self._config.world_size
        dist.gather_object(self._stage.placement(), gathered, dst=0)
        return [p for p in gathered if p is not None]

    def rank_pools(self) -> list[tuple[str, KVLayout]]:
        """Every rank's shared pool as (/dev/shm name, layout), in rank order (asked of each
        rank between steps).

        Raises:
            ValueError: the runner was not made with ``shared_pool``.
        """
        import torch.distributed as dist

        assert self._stage is not None
        if not self._shared_pool:
            raise ValueError("rank_pools: this runner's pools are private (shared_pool=False)")
        dist.broadcast_object_list([_POOLS], src=0)
        gathered: list[tuple[str, KVLayout] | None] = [None] * self._config.world_size
        dist.gather_object((self._stage.pool.name, self._stage.pool.layout), gathered, dst=0)
        pools = [p for p in gathered if p is not None]
        self._rank_pool_names = [name for name, _ in pools[1:]]
        return pools

    def dead_rank(self) -> RankDiedError | None:
        """The first spawned rank whose process has exited, as an error naming it and how it
        ended; None while every rank runs (a non-blocking look: any thread)."""
        for rank, worker in enumerate(list(self._workers), start=1):
            code = worker.exitcode
            if code is not None:
                return RankDiedError(f"parallel rank {rank} (pid {worker.pid}) "
                                     f"{_how_it_ended(code)}", rank, code)
        return None

    @property
    def pool(self) -> KVPool:
        """Rank 0's KV pool (its heads of its stage's layers)."""
        assert self._stage is not None
        return self._stage.pool

    def execute(self, batch: ScheduledBatch, on_layer: None = None,
                copies: Sequence[LayerCopy] = ()) -> torch.Tensor:
        """Forward ``batch`` on every rank; rank 0's fp32 logits of the sampled rows.

        ``copies``: each rank copies its heads of the blocks they name into other pools on this
        host, layer by layer as the forward goes (`layer_copy`); all done when this returns.

        Raises:
            ValueError: an ``on_layer`` hook (ModelRunner's): the layers run in every rank's
                process, so no hook of this one sees them (``copies`` say what they do).
        """
        import torch.distributed as dist

        assert self._stage is not None
        if on_layer is not None:
            raise ValueError("a parallel runner runs no per-layer hook: its layers run in "
                             "every rank's process (give layer-wise copies as `copies`)")
        parts = self._parts or max(1, min(self._config.pp,
                                          batch.num_tokens // MIN_MICROBATCH_TOKENS))
        micro = [build_inputs(part, self.block_size)  # host tensors: each rank moves its own
                 for part in split_microbatches(batch, parts)]
        dist.broadcast_object_list([(micro, tuple(copies))], src=0)
        logits = self._stage.run(micro, copies)
        return sampled_logits(torch.cat(logits) if len(logits) > 1 else logits[0], batch)

    def close(self) -> None:
        import torch.distributed as dist

        if self._stage is None:
            return
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([None], src=0)
        self._stop_workers()
        self._stage.close()
        self._stage = None
        for name in self._rank_pool_names:  # a rank that died could not unlink its own pool
            with contextlib.suppress(FileNotFoundError, ValueError):
                (SHM_DIR / name).unlink()
        self._rank_pool_names = []
        os.sched_setaffinity(0, self._saved[0])
        torch.set_num_threads(self._saved[1])
