"""mooncake_kv.listen: reading a process's listeners from /proc, and keeping Mooncake's on one
address (the store tier's own test, test_tiers_store.py, runs it against a real master)."""

import ctypes
import mmap
import socket
import subprocess
import sys

import pytest

from mooncake_kv.listen import (
    ListenConfinementError,
    confine_listeners,
    listening_sockets,
    wildcard_listeners,
)


@pytest.mark.parametrize(("family", "host", "shown", "is_wildcard"), [
    (socket.AF_INET, "127.0.0.1", "127.0.0.1", False),
    (socket.AF_INET, "0.0.0.0", "0.0.0.0", True),
    (socket.AF_INET6, "::", "::", True),
    (socket.AF_INET6, "::1", "::1", False),
])
def test_listeners_are_read_from_proc(family, host, shown, is_wildcard):
    with socket.socket(family) as sock:
        try:
            sock.bind((host, 0))
        except OSError as error:
            pytest.skip(f"cannot bind {host} here: {error}")
        port = sock.getsockname()[1]
        assert (shown, port) not in listening_sockets()  # bound, not listening yet
        sock.listen()
        assert (shown, port) in listening_sockets()
        assert ((shown, port) in wildcard_listeners()) == is_wildcard
    assert (shown, port) not in listening_sockets()


def test_another_process_is_read_by_pid():
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        assert listening_sockets(child.pid) == [("127.0.0.1", port)]
        assert ("127.0.0.1", port) not in listening_sockets()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()


@pytest.mark.parametrize("host", ["::1", "no-such-host.invalid"])
def test_only_ipv4_addresses_can_be_kept_to(host):
    with pytest.raises(ListenConfinementError, match="IPv4"), confine_listeners(host):
        pass


@pytest.mark.mooncake
def test_every_mooncake_object_that_binds_is_redirected():
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    pytest.importorskip("mooncake.engine", reason="Mooncake wheel (or libibverbs1) missing")
    from mooncake_kv import listen

    with confine_listeners("127.0.0.1"):
        pass
    maps = listen._mappings()
    objects = listen._mooncake_objects(maps)
    names = {path.rsplit("/", 1)[1] for path in objects}
    assert {"store.so", "engine.so", "libasio.so"} <= names
    for path, start in objects.items():  # each slot bound to bind() now holds the redirection
        slots, first_load = listen._bind_slots(path)
        assert slots or not path.endswith(("store.so", "engine.so", "libasio.so")), path
        bias = start - (first_load & ~(mmap.PAGESIZE - 1))
        for slot in slots:
            assert ctypes.c_void_p.from_address(bias + slot).value == listen._BIND_ADDRESS
