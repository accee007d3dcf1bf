"""The TP rendezvous store listens on loopback only (read back from /proc/net/tcp{,6})."""

from __future__ import annotations

from pathlib import Path

import pytest

from kthena_comm.groups import connect_store
from kthena_core.ports import free_port
from kthena_serve.engine.parallel_runner import _rank_env

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel prints them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == _LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_tp_store_master_listens_on_loopback_only() -> None:
    env = _rank_env(0, 1, free_port())  # rank 0 of a TP engine, as TPModelRunner builds it
    assert env.master_addr == "127.0.0.1"
    store = connect_store(env, timeout_s=10)
    try:
        store.set("probe", "1")
        # 127.0.0.1 in /proc/net/tcp is 0100007F (little-endian); all interfaces would be
        # 00000000 (tcp) or 000...000 (tcp6, dual stack), as torch's own bind gives.
        assert listening_addresses(env.master_port) == ["0100007F"]
    finally:
        del store
