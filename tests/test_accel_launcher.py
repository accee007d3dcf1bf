"""kthena-run on Ascend: HCCL's launch variables are exported, checked, and a bad one explained.

Runs here for real (no NPU is needed to decide what to export or to refuse a launch); whether
HCCL then connects is a hardware check (docs/accelerators.md).
"""

from __future__ import annotations

import json

import pytest

from kthena_core.config import load_config
from kthena_core.hccl_env import (
    HcclEnvError,
    HcclSettings,
    check_hccl,
    hccl_environment,
    is_local_address,
)
from kthena_core.launcher import main, rank_environment

HCCL_VARS = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT", "RANK_TABLE_FILE")


@pytest.fixture(autouse=True)
def no_user_hccl(monkeypatch):
    for name in HCCL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_settings_validate_each_variable():
    with pytest.raises(HcclEnvError, match="HCCL_IF_IP='10.0.0.1,10.0.0.2' is not one"):
        HcclSettings(if_ip="10.0.0.1,10.0.0.2")
    with pytest.raises(HcclEnvError, match=r"HCCL_CONNECT_TIMEOUT=60: .*\[120, 7200\]"):
        HcclSettings(connect_timeout_s=60)
    with pytest.raises(HcclEnvError, match="HCCL_SOCKET_IFNAME='eth 0'"):
        HcclSettings(socket_ifname="eth 0")
    for spec in ("eth,enp", "=eth0", "^docker", "^=eth0,enp0"):
        assert HcclSettings(socket_ifname=spec).socket_ifname == spec
    assert HcclSettings(if_ip="fe80::1").if_ip == "fe80::1"
    with pytest.raises(HcclEnvError, match="integer number of seconds"):
        HcclSettings.from_environ({"HCCL_CONNECT_TIMEOUT": "10m"})


def test_environment_and_flags_combine_flags_winning():
    settings = HcclSettings.from_environ({"HCCL_IF_IP": "10.0.0.1", "HCCL_CONNECT_TIMEOUT": "300"},
                                         if_ip="10.0.0.2", socket_ifname=None)
    assert hccl_environment(settings) == {"HCCL_IF_IP": "10.0.0.2", "HCCL_CONNECT_TIMEOUT": "300"}


def test_multi_node_without_a_nic_variable_is_refused_with_the_reason():
    with pytest.raises(HcclEnvError) as info:
        check_hccl(HcclSettings(), nnodes=2, world_size=16)
    message = str(info.value)
    assert "HCCL_IF_IP and HCCL_SOCKET_IFNAME are both unset on a 2-node launch" in message
    assert "no route to the root node" in message and "--hccl-if-ip" in message
    check_hccl(HcclSettings(), nnodes=1, world_size=8)  # one node: HCCL's own choice is fine


def test_if_ip_must_belong_to_this_host():
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.1")  # TEST-NET-1
    check_hccl(HcclSettings(if_ip="127.0.0.1"), nnodes=2, world_size=2)
    with pytest.raises(HcclEnvError, match="HCCL_IF_IP=192.0.2.1 is not an address of this host"):
        check_hccl(HcclSettings(if_ip="192.0.2.1"), nnodes=2, world_size=2)


def test_socket_ifname_must_match_a_local_nic():
    nics = ["lo", "eth0", "enp3s0"]
    for spec in ("=eth0", "eth", "enp,ib", "^=eth0"):
        check_hccl(HcclSettings(socket_ifname=spec), nnodes=2, world_size=2, interfaces=nics)
    with pytest.raises(HcclEnvError, match="'=eth1' matches no NIC of this host \\(has: enp3s0"):
        check_hccl(HcclSettings(socket_ifname="=eth1"), nnodes=2, world_size=2, interfaces=nics)


def test_rank_table_is_read_and_counted(tmp_path):
    table = {"version": "1.0", "server_count": "1", "status": "completed", "server_list": [
        {"server_id": "10.0.0.1", "device": [
            {"device_id": "0", "device_ip": "192.168.100.1", "rank_id": "0"},
            {"device_id": "1", "device_ip": "192.168.100.2", "rank_id": "1"}]}]}
    path = tmp_path / "rank_table.json"
    path.write_text(json.dumps(table))
    check_hccl(HcclSettings(rank_table_file=str(path)), nnodes=1, world_size=2)
    with pytest.raises(HcclEnvError, match="lists 2 devices but the launch has 4 ranks"):
        check_hccl(HcclSettings(rank_table_file=str(path)), nnodes=1, world_size=4)
    with pytest.raises(HcclEnvError, match="does not exist"):
        check_hccl(HcclSettings(rank_table_file=str(tmp_path / "no.json")), nnodes=1,
                   world_size=2)
    path.write_text('{"servers": []}')
    with pytest.raises(HcclEnvError, match="is not a rank table"):
        check_hccl(HcclSettings(rank_table_file=str(path)), nnodes=1, world_size=2)


def test_dry_run_exports_the_hccl_variables(capsys):
    argv = ["--backend", "hccl", "--nproc_per_node", "2", "--hccl-if-ip", "127.0.0.1",
            "--hccl-connect-timeout", "900", "--dry-run", "serve.py"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "HCCL_IF_IP=127.0.0.1" in out and "HCCL_CONNECT_TIMEOUT=900" in out
    assert "KTHENA_DIST_BACKEND=hccl" in out


def test_launch_is_refused_with_the_explanation(capsys):
    argv = ["--backend", "hccl", "--nnodes", "2", "--nproc_per_node", "8", "--dry-run", "x.py"]
    assert main(argv) == 2
    assert "both unset on a 2-node launch" in capsys.readouterr().err


def test_a_users_environment_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("HCCL_IF_IP", "192.0.2.1")
    assert main(["--backend", "hccl", "--dry-run", "x.py"]) == 2
    assert "HCCL_IF_IP=192.0.2.1 is not an address of this host" in capsys.readouterr().err


def test_other_backends_and_manifests_keep_their_environment():
    cfg = load_config({"cluster": {"world_size": 2}, "parallelism": {"tensor_parallel_size": 2}})
    assert "HCCL_CONNECT_TIMEOUT" not in rank_environment(cfg, "gloo", 2)
    assert rank_environment(cfg, "hccl", 2)["HCCL_CONNECT_TIMEOUT"] == "600"
    assert "HCCL_IF_IP" not in rank_environment(cfg, "hccl", 2)
