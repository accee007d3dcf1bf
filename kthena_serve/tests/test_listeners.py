"""No serve mode opens a wildcard listener: `ss -ltnp`, read from /proc, over the server's whole
process tree (router, workers, replicas), with the default --host.

What each mode listens on is docs/security.md's table; the test prints it (``-s``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _serve_process import stop

from mooncake_kv.listen import listening_sockets

pytestmark = pytest.mark.slow

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _tree(root: int) -> list[int]:
    """``root`` and its descendants."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [root], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def _role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    text = b" ".join(argv).decode(errors="replace")
    if b"from multiprocessing.spawn import spawn_main" in text.encode():
        return "engine process"  # kthena serve's (kthena_serve.engine_core)
    for marker in ("kthena_serve.pd.worker", "kthena_serve.dp.replica", "kthena serve"):
        if marker in text:
            role = next((a.decode() for a in argv if a in (b"prefill", b"decode")), "")
            return f"{marker} {role}".strip()
    return text[:80]


def _serve_and_read_listeners(*flags: str) -> dict[str, list[tuple[str, int]]]:
    """Start ``kthena serve --port 0 FLAGS``, wait for its ready line, and read what every
    process of its tree listens on; stops it (and waits) whatever happens."""
    kthena = Path(sys.executable).with_name("kthena")
    proc = subprocess.Popen([str(kthena), "serve", "--port", "0", "--kv-cache-memory", "32MiB",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"kthena serve {flags} exited"
            if re.search(r"on http://\S+", line):
                break
        else:
            pytest.fail(f"kthena serve {flags}: no ready line")
        return {f"{pid} {_role(pid)}": listening_sockets(pid) for pid in _tree(proc.pid)}
    finally:
        stop(proc)


def _check(listeners: dict[str, list[tuple[str, int]]], expected_listening: int) -> None:
    print()
    for who, sockets in listeners.items():
        print(f"  {who}: {sockets}")
    every = [(who, host, port) for who, sockets in listeners.items() for host, port in sockets]
    assert [x for x in every if x[1] not in LOOPBACK] == []
    assert sum(1 for sockets in listeners.values() if sockets) == expected_listening


@pytest.fixture(scope="module")
def master():
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    from mooncake_kv.tiers.master import master_binary, start_local_master, stop_master

    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}")
    proc, address = start_local_master()
    yield address
    stop_master(proc)


def test_colocated_with_the_mooncake_store_tier(master):
    listeners = _serve_and_read_listeners("--kv-offload", f"host=16MiB,store=mooncake@{master}")
    _check(listeners, expected_listening=2)
    by_role = {who.split(" ", 1)[1]: sockets for who, sockets in listeners.items() if sockets}
    assert len(by_role["kthena serve"]) == 1  # the API
    # the store client's handshake RPC and TCP data ports, where the engine runs
    assert len(by_role["engine process"]) == 2


def test_pd():
    _check(_serve_and_read_listeners("--mode", "pd"), expected_listening=3)


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="no Mooncake wheel")
def test_pd_over_the_mooncake_transport():
    listeners = _serve_and_read_listeners("--mode", "pd", "--pd-transport", "mooncake")
    _check(listeners, expected_listening=3)
    for who, sockets in listeners.items():
        if "worker" in who:  # the control API, and Mooncake's handshake RPC and data ports
            assert len(sockets) == 3, (who, sockets)


def test_dp():
    _check(_serve_and_read_listeners("--dp", "2"), expected_listening=3)
