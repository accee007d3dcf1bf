"""Layout arithmetic, rank environment parsing, backend choice and bounded init failures."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch
from _support import free_port
from hypothesis import given
from hypothesis import strategies as st

from kthena_comm import device as device_module
from kthena_comm.device import (
    DeviceBackend,
    backend_for_device,
    device_backend,
    device_count,
    local_device,
)
from kthena_comm.env import RankEnv
from kthena_comm.errors import (
    DeviceUnavailableError,
    InitError,
    LayoutError,
    RankEnvError,
    UnknownBackendError,
)
from kthena_comm.groups import GroupConfig, connect_store, init_parallel_groups
from kthena_comm.layout import coords_of, global_rank, group_of, group_ranks
from kthena_comm.store import open_store
from kthena_core.layout import Layout

sizes = st.integers(1, 4)


@given(tp=sizes, pp=sizes, dp=sizes, use_sp=st.booleans())
def test_every_rank_is_in_exactly_one_group_of_each_kind(tp, pp, dp, use_sp):
    layout = Layout(tp, pp, dp, tp if use_sp else 1)
    world = layout.num_devices
    expected = {"tp": tp, "pp": pp, "dp": dp, "sp": tp if use_sp else 1}
    for kind, size in expected.items():
        groups = group_ranks(layout, kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        assert global_rank(layout, coords_of(layout, rank)) == rank
        c = coords_of(layout, rank)
        assert all(coords_of(layout, r).tp_idx == c.tp_idx for r in group_of(layout, "dp", rank))


def test_tp_is_innermost_in_rank_order():
    layout = Layout(tp=2, pp=2, dp=2)
    assert group_ranks(layout, "tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert group_ranks(layout, "pp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert group_ranks(layout, "dp") == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_layout_errors_are_comm_layout_errors():
    """kthena_core's Layout refuses impossible sizes (kthena_core/tests/test_layout.py), with
    the LayoutError kthena_comm raises for a layout that does not fit its world."""
    with pytest.raises(LayoutError, match="tp must be a positive int"):
        Layout(0)
    with pytest.raises(LayoutError, match="outside layout of 2 ranks"):
        coords_of(Layout(2), 2)
    with pytest.raises(LayoutError, match="unknown group kind 'ep'"):
        group_ranks(Layout(2), "ep")


def test_rank_env_from_env_reads_torchrun_variables():
    env = RankEnv.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert env == RankEnv(3, 4, 1, "10.0.0.1", 1234)
    assert env.address == "10.0.0.1:1234"
    assert not env.use_agent_store
    under_torchrun = RankEnv.from_env({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert under_torchrun.use_agent_store


def test_rank0_joins_a_store_the_launcher_already_hosts():
    """Under torchrun (use_agent_store) rank 0 is a client: no second store fights for the port."""
    port = free_port()
    agent = open_store("127.0.0.1", port, None, True, timedelta(seconds=5))  # torchrun's agent
    try:
        store = connect_store(RankEnv(0, 1, master_port=port, use_agent_store=True), timeout_s=5)
        store.set("probe", "1")
        assert agent.get("probe") == b"1"  # one store, shared
        del store
    finally:
        del agent


@pytest.mark.parametrize("environ, variable", [
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
])
def test_bad_rank_env_names_the_variable(environ, variable):
    with pytest.raises(RankEnvError, match=variable):
        RankEnv.from_env(environ)


def test_backend_follows_device_and_can_be_overridden():
    assert [backend_for_device(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    assert backend_for_device("cpu", override="mpi") == "mpi"
    with pytest.raises(UnknownBackendError, match="registered: cpu, cuda, npu"):
        device_backend("tpu")


def test_a_rank_binds_its_local_device_and_is_refused_one_the_host_lacks(monkeypatch):
    assert local_device("cpu", 3) == torch.device("cpu")  # CPU ranks share the host
    two = DeviceBackend("cuda", "nccl", lambda rank: None, lambda: 2, "two fake GPUs")
    monkeypatch.setitem(device_module._REGISTRY, "cuda", two)
    assert device_count("cuda") == 2
    assert local_device("cuda", 1) == torch.device("cuda", 1)
    with pytest.raises(DeviceUnavailableError, match=r"LOCAL_RANK=2 binds cuda:2, but this "
                       r"host has 2 cuda device\(s\) \(cuda needs two fake GPUs\)"):
        local_device("cuda", 2)


def test_devices_are_counted_without_importing_torch_npu():
    import importlib.util
    import sys

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    assert device_count("npu") == 0 and "torch_npu" not in sys.modules
    assert device_count("cuda") == torch.cuda.device_count()
    assert device_count("cpu") == 1


def test_layout_needing_another_world_size_is_rejected():
    env = RankEnv(0, 2, master_port=free_port())
    with pytest.raises(LayoutError, match="needs 4 ranks but WORLD_SIZE=2"):
        init_parallel_groups(Layout(tp=2, dp=2), env)


def test_unreachable_master_fails_in_bounded_time_naming_rank_and_address():
    env = RankEnv(1, 2, master_port=free_port())
    start = time.monotonic()
    with pytest.raises(InitError) as info:
        connect_store(env, timeout_s=2)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "rank 1" in message and env.address in message and "MASTER_ADDR" in message


def test_missing_ranks_fail_in_bounded_time_naming_world_size():
    env = RankEnv(0, 2, master_port=free_port())
    start = time.monotonic()
    with pytest.raises(InitError, match="only 1 of 2 ranks joined") as info:
        connect_store(env, timeout_s=1.5)
    assert time.monotonic() - start < 10
    assert "WORLD_SIZE" in str(info.value)


def test_taken_master_port_names_master_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        env = RankEnv(0, 1, master_port=s.getsockname()[1])
        with pytest.raises(InitError, match="MASTER_PORT"):
            init_parallel_groups(Layout(1), env, GroupConfig(timeout_s=2))


def test_master_store_listens_on_master_addr_only():
    """torch's own bind takes every interface; ours only MASTER_ADDR (127.0.0.2 is refused)."""
    env = RankEnv(0, 1, master_port=free_port())
    store = connect_store(env, timeout_s=5)
    try:
        with socket.create_connection(("127.0.0.1", env.master_port), timeout=2):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", env.master_port), timeout=2).close()
    finally:
        del store
