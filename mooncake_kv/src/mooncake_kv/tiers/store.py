"""Mooncake Store tier: block values in a Mooncake distributed store, shared across hosts.

Needs the optional extra `mooncake-kv[store]` (the `mooncake-transfer-engine-non-cuda` wheel,
which links the Debian package libibverbs1 even for TCP) and a running `mooncake_master`.
`MooncakeDistributedStore.setup` waits about 90 s when no master answers, so the master's
port is probed first and an unreachable store fails fast with `TierUnavailableError`.
Mooncake's integer return codes become `TierError`s here, once.

This client also contributes `global_segment_size` bytes of its own RAM to the store, served
to the store's other clients from two listeners (Mooncake's handshake RPC and TCP data ports).
Mooncake binds them to every interface whatever it is told; `mooncake_kv.listen` keeps them on
`local_hostname`, and a client that cannot be kept there is not opened. A store whose master
is on another host needs a `local_hostname` those hosts reach: loopback is refused for it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time
from typing import Any, ClassVar

import attrs

from mooncake_kv.listen import ListenConfinementError, confine_listeners
from mooncake_kv.tiers.base import TierError, TierUnavailableError, register_tier

__all__ = ["MooncakeStoreTier", "StoreTierConfig", "probe_master"]

_MiB = 1 << 20


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master_address must be 'host:port', got {address!r}")
    return host, int(port)


def _check_address(instance: object, attribute: attrs.Attribute, value: str) -> None:
    _host_port(value)


@attrs.frozen
class StoreTierConfig:
    """Open with `open_tier`. Only ever point it at addresses you mean to reach.

    Attributes:
        master_address: 'host:port' of mooncake_master's RPC port.
        local_hostname: the address this client listens on (its transfer engine and
            handshake RPC; never every interface) and advertises; loopback by default.
        metadata_server: 'P2PHANDSHAKE' (no metadata service) or an etcd/HTTP URL.
        global_segment_size: bytes of this process's RAM lent to the store.
        local_buffer_size: bytes of client-side transfer buffer.
        protocol: 'tcp' or 'rdma'.
        namespace: prefix of every key, so several caches can share one store.
        connect_timeout_s: how long to wait for the master's port before giving up.
    """

    kind: ClassVar[str] = "mooncake_store"
    master_address: str = attrs.field(default="127.0.0.1:50051", validator=_check_address)
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 64 * _MiB
    local_buffer_size: int = 16 * _MiB
    protocol: str = "tcp"
    rdma_devices: str = ""
    namespace: str = "mooncake_kv"
    connect_timeout_s: float = 2.0
    name: str = "mooncake_store"


def probe_master(address: str, timeout_s: float = 2.0) -> None:
    """Whether a ``mooncake_master`` RPC port answers at ``address`` ('host:port'): a TCP
    connect, no Mooncake client (whose setup waits ~90 s for a master that is not there).

    Raises:
        TierUnavailableError: nothing accepts a connection there within ``timeout_s``.
        ValueError: ``address`` is not 'host:port'.
    """
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise TierUnavailableError(
            f"Mooncake master at {address} does not answer ({exc}); start mooncake_master "
            "there or leave the store tier out"
        ) from None


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def _check_reachable(config: StoreTierConfig) -> None:
    """A remote master hands this client's segment address to clients on other hosts."""
    master = _host_port(config.master_address)[0]
    if _is_loopback(config.local_hostname) and not _is_loopback(master):
        raise TierUnavailableError(
            f"the Mooncake master at {config.master_address} is not on loopback, but this "
            f"client would serve its segment on {config.local_hostname}, which other hosts "
            "cannot reach; set local_hostname to this host's address on the master's network "
            "(kthena serve: --kv-offload ...,listen=ADDRESS)")


def _setup(client: Any, config: StoreTierConfig) -> int:
    """``client.setup`` with its listeners kept on ``local_hostname``."""
    try:
        with confine_listeners(config.local_hostname):
            return client.setup(
                config.local_hostname, config.metadata_server, config.global_segment_size,
                config.local_buffer_size, config.protocol, config.rdma_devices,
                config.master_address,
            )
    except ListenConfinementError as error:
        with contextlib.suppress(Exception):
            client.close()
        raise TierUnavailableError(
            f"the Mooncake Store client is not opened: it would listen on every interface "
            f"and serve this process's segment to anyone who reaches it ({error})") from None


def _new_client() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise TierUnavailableError(
            f"the Mooncake Store client cannot be imported ({exc}); install "
            "'mooncake-kv[store]' and the Debian package libibverbs1"
        ) from None
    return MooncakeDistributedStore()


def _open_client(config: StoreTierConfig, attempts: int = 3) -> Any:
    """A set-up client. A master that answered the probe but whose setup failed (a return
    code, or a listener that escaped confinement) is tried again with a new client, up to
    ``attempts`` times 1 s apart: on a loaded host a client's setup fails now and then (once
    in a test suite's run: a worker started without its store tier)."""
    errors: list[str] = []
    while True:
        client = _new_client()
        try:
            code = _setup(client, config)
            if code == 0:
                return client
            with contextlib.suppress(Exception):
                client.close()
            errors.append(f"Mooncake Store setup against {config.master_address} failed with "
                          f"code {code}")
        except TierUnavailableError as exc:
            errors.append(str(exc))
        if len(errors) == attempts:
            raise TierUnavailableError(
                "; ".join(f"attempt {i}: {e}" for i, e in enumerate(errors, 1))) from None
        time.sleep(1.0)


class MooncakeStoreTier:
    """A `KVTier` over `MooncakeDistributedStore` (put / get / is_exist / remove).

    The store evicts by itself; `put` never reports evictions.
    """

    def __init__(self, config: StoreTierConfig) -> None:
        _check_reachable(config)
        probe_master(config.master_address, config.connect_timeout_s)
        client = _open_client(config)
        self.name = config.name
        self.config = config
        self._client: Any = client

    def _key(self, key: str) -> str:
        return f"{self.config.namespace}/{key}"

    def _live(self) -> Any:
        if self._client is None:
            raise TierError(f"store tier {self.name!r} is closed")
        return self._client

    def contains(self, key: str) -> bool:
        code = self._live().is_exist(self._key(key))
        if code < 0:
            raise TierError(f"Mooncake Store is_exist({key!r}) failed with code {code}")
        return code == 1

    def get(self, key: str) -> bytes | None:
        value = self._live().get(self._key(key))
        if value:
            return value
        # Mooncake answers b"" both for a miss and for a failed query: tell them apart
        if self._live().is_exist(self._key(key)) < 0:
            raise TierError(f"Mooncake Store get({key!r}) failed: the master does not answer")
        return None

    def put(self, key: str, value: bytes) -> list[tuple[str, bytes]]:
        code = self._live().put(self._key(key), value)
        if code != 0:
            raise TierError(f"Mooncake Store put({key!r}, {len(value)} bytes) failed with code {code}")
        return []

    def remove(self, key: str) -> None:
        code = self._live().remove(self._key(key), True)
        if code < 0 and self._live().is_exist(self._key(key)) == 1:
            raise TierError(f"Mooncake Store remove({key!r}) failed with code {code}")

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


register_tier(StoreTierConfig.kind, MooncakeStoreTier)
