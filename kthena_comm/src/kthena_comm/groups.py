"""Process groups from a parallel layout and a rank's environment.

``init_parallel_groups`` rendezvouses over a TCPStore at MASTER_ADDR:MASTER_PORT (its master
listens on MASTER_ADDR only: ``kthena_comm.store``), initialises the world group with the device's
backend (gloo / nccl / hccl, overridable), then creates every TP, PP, DP and SP group in the same
order on every rank, as torch.distributed requires. Each failure (unreachable master, port taken,
ranks missing, world size not matching the layout) raises within ``timeout_s`` with the rank, the
address and the variable to check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist

from kthena_comm.device import backend_for_device, device_backend
from kthena_comm.env import RankEnv
from kthena_comm.errors import InitError, LayoutError
from kthena_comm.hccl import hccl_comm_name
from kthena_comm.layout import GroupKind, Rank, group_ranks
from kthena_comm.store import open_store
from kthena_core.layout import Layout

_JOIN_KEY = "kthena_comm/joined"

PeerCheck = Callable[[], None]
"""Raises if a rank this one waits for can no longer join (say, the process that was to run it
has exited), so the wait ends at once instead of at the deadline. A launcher that starts the
ranks itself knows this; the store does not. It must be cheap: it runs every 20 ms."""


@attrs.frozen
class GroupConfig:
    """How to initialise groups: device type, optional backend override, deadline."""

    device_type: str = "cpu"
    backend: str | None = None
    timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))


@attrs.frozen
class CommGroup:
    """One process group seen from one rank: its kind, members and torch handle.

    ``process_group`` is ``None`` for a single-rank group (collectives on it are local no-ops).
    ``hccl_comm_name`` is the group's HCCL communicator name (hccl backend only), which CANN's
    fused matmul + collective (MC2) kernels take; see ``kthena_comm.hccl``.
    """

    kind: str
    ranks: tuple[Rank, ...]
    rank: Rank
    process_group: Any = attrs.field(default=None, eq=False, repr=False)
    hccl_comm_name: str | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def group_rank(self) -> int:
        """This rank's index inside the group."""
        return self.ranks.index(self.rank)


@attrs.frozen
class ParallelGroups:
    """The world plus this rank's TP, PP, DP and SP groups."""

    backend: str
    world: CommGroup
    tp: CommGroup
    pp: CommGroup
    dp: CommGroup
    sp: CommGroup

    def destroy(self) -> None:
        """Tear down every group (safe to call twice)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def init_parallel_groups(layout: Layout, env: RankEnv,
                         config: GroupConfig | None = None, *,
                         check_peers: PeerCheck | None = None) -> ParallelGroups:
    """Initialise torch.distributed and build this rank's groups.

    Args:
        layout: sizes of TP / PP / DP / SP: kthena_core's ``Layout`` (a plan's ``plan.layout``).
        env: this rank's launch environment (see ``RankEnv.from_env``).
        config: device type, backend override and deadline.
        check_peers: called while waiting for the other ranks to join (see ``PeerCheck``).

    Raises:
        LayoutError: the layout needs a different WORLD_SIZE.
        InitError: rendezvous or backend init failed or ran past ``config.timeout_s``.
        Whatever ``check_peers`` raises.
    """
    config = config or GroupConfig()
    if layout.num_devices != env.world_size:
        raise LayoutError(f"rank {env.rank}: layout tp={layout.tp} × pp={layout.pp} × "
                          f"dp={layout.dp} needs {layout.num_devices} ranks but "
                          f"WORLD_SIZE={env.world_size}; launch that many ranks or change the plan")
    device_backend(config.device_type).prepare(env.local_rank)
    backend = backend_for_device(config.device_type, config.backend)
    store = connect_store(env, config.timeout_s, check_peers=check_peers)
    _init_world(store, env, backend, config.timeout_s)
    world = CommGroup("world", tuple(Rank(r) for r in range(env.world_size)), Rank(env.rank),
                      dist.group.WORLD)
    kinds = {kind: _build_kind(layout, kind, world) for kind in ("tp", "pp", "dp")}
    sp = kinds["tp"] if layout.sp > 1 else _single(world, "sp")
    groups = ParallelGroups(backend, world, kinds["tp"], kinds["pp"], kinds["dp"],
                            attrs.evolve(sp, kind="sp"))
    return with_hccl_names(groups) if backend == "hccl" else groups


def with_hccl_names(groups: ParallelGroups, device: Any = None) -> ParallelGroups:
    """``groups`` with each multi-rank group's HCCL communicator name filled in."""
    def named(group: CommGroup) -> CommGroup:
        if group.process_group is None:
            return group
        return attrs.evolve(group, hccl_comm_name=hccl_comm_name(group.process_group,
                                                                 int(group.rank), device))

    return attrs.evolve(groups, world=named(groups.world), tp=named(groups.tp),
                        pp=named(groups.pp), dp=named(groups.dp), sp=named(groups.sp))


def connect_store(env: RankEnv, timeout_s: float, *,
                  check_peers: PeerCheck | None = None) -> dist.TCPStore:
    """Open the rendezvous store and wait until all WORLD_SIZE ranks have joined it.

    Rank 0 hosts the store, unless ``env.use_agent_store`` says a launcher (torchrun) already
    hosts it on that port: then every rank is a client, and no second store fights for the port.
    ``check_peers`` is called between polls of the join count and may raise to stop waiting.
    """
    is_master = env.rank == 0 and not env.use_agent_store
    try:
        store = open_store(env.master_addr, env.master_port, env.world_size, is_master,
                           timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError variants
        variable = "MASTER_PORT" if is_master else "MASTER_ADDR/MASTER_PORT"
        what = "cannot listen" if is_master else "master unreachable"
        raise InitError(env.rank, env.address, variable, f"{what}: {exc}") from exc
    _await_ranks(store, env, timeout_s, check_peers)
    return store


def _await_ranks(store: dist.TCPStore, env: RankEnv, timeout_s: float,
                 check_peers: PeerCheck | None) -> None:
    deadline = time.monotonic() + timeout_s
    joined = store.add(_JOIN_KEY, 1)
    while joined < env.world_size:
        if check_peers is not None:
            check_peers()
        if time.monotonic() > deadline:
            raise InitError(env.rank, env.address, "WORLD_SIZE",
                            f"only {joined} of {env.world_size} ranks joined within {timeout_s}s")
        time.sleep(0.02)
        joined = store.add(_JOIN_KEY, 0)


def _init_world(store: dist.TCPStore, env: RankEnv, backend: str, timeout_s: float) -> None:
    try:
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise InitError(env.rank, env.address, "RANK/WORLD_SIZE",
                        f"{backend} init failed: {exc}") from exc


def _build_kind(layout: Layout, kind: GroupKind, world: CommGroup) -> CommGroup:
    mine = _single(world, kind)
    for ranks in group_ranks(layout, kind):
        group = _new_group(ranks, world, kind)  # every rank must call new_group for every group
        if world.rank in ranks:
            mine = group
    return mine


def _new_group(ranks: tuple[Rank, ...], world: CommGroup, kind: str) -> CommGroup:
    if len(ranks) == 1:
        return CommGroup(kind, ranks, world.rank)
    if len(ranks) == world.size:
        return attrs.evolve(world, kind=kind)
    return CommGroup(kind, ranks, world.rank, dist.new_group(list(ranks)))


def _single(world: CommGroup, kind: str) -> CommGroup:
    return CommGroup(kind, (world.rank,), world.rank)
