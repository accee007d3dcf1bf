"""HCCL's launch variables, as one validated value, and the checks a launcher runs on them.

HCCL reads these from each rank's environment (CANN environment-variable reference):

    HCCL_IF_IP            the host IP HCCL uses to reach the root node while creating a
                          communicator; one IPv4/IPv6 address; wins over HCCL_SOCKET_IFNAME
    HCCL_SOCKET_IFNAME    NIC names instead: "eth,enp" (prefixes), "=eth0" (exact),
                          "^eth" / "^=eth0" (excluded)
    HCCL_CONNECT_TIMEOUT  link set-up deadline, integer seconds in [120, 7200] (default 120)
    RANK_TABLE_FILE       a rank table (JSON: server_list[].device[] with device_id, device_ip,
                          rank_id); only needed by rank-table launches, torchrun does not need it

Without HCCL_IF_IP or HCCL_SOCKET_IFNAME, HCCL picks the first NIC by name that is not docker or
lo; CANN warns that on several nodes this can be a NIC with no route to the root node, and link
set-up then fails, so a multi-node launch without either is refused here, with that reason.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Callable, Collection, Mapping

import attrs

from kthena_core.config import ConfigError

__all__ = ["CONNECT_TIMEOUT_RANGE", "HcclEnvError", "HcclSettings", "check_hccl",
           "hccl_environment", "is_local_address", "local_interfaces"]

CONNECT_TIMEOUT_RANGE = (120, 7200)
_IFNAME = re.compile(r"^\^?=?[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*$")


class HcclEnvError(ConfigError):
    """An HCCL launch variable is missing, malformed or does not fit this host."""


def _ip(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None:
        return
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise HcclEnvError(f"HCCL_IF_IP={value!r} is not one IPv4 or IPv6 address; HCCL takes "
                           "exactly one host address (e.g. 10.10.10.1)") from None


def _ifname(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not _IFNAME.match(value):
        raise HcclEnvError(f"HCCL_SOCKET_IFNAME={value!r}: expected comma-separated NIC names "
                           "or prefixes, optionally starting with ^ (exclude) and/or = (exact), "
                           "e.g. 'eth,enp', '=eth0', '^=docker0'")


def _timeout(instance: object, attribute: attrs.Attribute, value: int) -> None:
    low, high = CONNECT_TIMEOUT_RANGE
    if not isinstance(value, int) or not low <= value <= high:
        raise HcclEnvError(f"HCCL_CONNECT_TIMEOUT={value!r}: HCCL takes an integer number of "
                           f"seconds in [{low}, {high}]")


@attrs.frozen
class HcclSettings:
    """What a launcher exports for HCCL (None: leave HCCL's own default)."""

    if_ip: str | None = attrs.field(default=None, validator=_ip)
    socket_ifname: str | None = attrs.field(default=None, validator=_ifname)
    connect_timeout_s: int = attrs.field(default=600, validator=_timeout)
    rank_table_file: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], **overrides: object) -> HcclSettings:
        """Values from ``environ`` (a user's exports), then ``overrides`` (flags) on top.

        Raises:
            HcclEnvError: a value is malformed; the message names the variable.
        """
        timeout = environ.get("HCCL_CONNECT_TIMEOUT")
        values: dict[str, object] = {
            "if_ip": environ.get("HCCL_IF_IP") or None,
            "socket_ifname": environ.get("HCCL_SOCKET_IFNAME") or None,
            "rank_table_file": environ.get("RANK_TABLE_FILE") or None,
        }
        if timeout:
            if not timeout.strip().isdigit():
                raise HcclEnvError(f"HCCL_CONNECT_TIMEOUT={timeout!r}: HCCL takes an integer "
                                   "number of seconds")
            values["connect_timeout_s"] = int(timeout)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def hccl_environment(settings: HcclSettings) -> dict[str, str]:
    """The variables to export for every rank (a pure function)."""
    env = {"HCCL_CONNECT_TIMEOUT": str(settings.connect_timeout_s)}
    if settings.if_ip is not None:
        env["HCCL_IF_IP"] = settings.if_ip
    if settings.socket_ifname is not None:
        env["HCCL_SOCKET_IFNAME"] = settings.socket_ifname
    if settings.rank_table_file is not None:
        env["RANK_TABLE_FILE"] = settings.rank_table_file
    return env


def check_hccl(settings: HcclSettings, *, nnodes: int, world_size: int,
               is_local: Callable[[str], bool] | None = None,
               interfaces: Collection[str] | None = None) -> None:
    """Check ``settings`` against this launch and this host.

    Args:
        nnodes: nodes in the launch (more than one needs HCCL_IF_IP or HCCL_SOCKET_IFNAME).
        world_size: ranks in the launch (a rank table must list exactly that many devices).
        is_local: whether an IP is assigned on this host (default: ``is_local_address``).
        interfaces: this host's NIC names (default: ``local_interfaces()``).

    Raises:
        HcclEnvError: the first problem found, with what HCCL would do and what to set.
    """
    if nnodes > 1 and settings.if_ip is None and settings.socket_ifname is None:
        raise HcclEnvError(
            f"HCCL_IF_IP and HCCL_SOCKET_IFNAME are both unset on a {nnodes}-node launch: HCCL "
            "would pick this host's first non-docker, non-lo NIC by name, which may have no "
            "route to the root node, and communicator set-up then fails. Set HCCL_IF_IP to "
            "this node's address on the network the nodes share (or HCCL_SOCKET_IFNAME to that "
            "NIC), e.g. --hccl-if-ip 10.0.0.2")
    if settings.if_ip is not None and not (is_local or is_local_address)(settings.if_ip):
        raise HcclEnvError(f"HCCL_IF_IP={settings.if_ip} is not an address of this host; set "
                           "it per node to that node's own address")
    if settings.socket_ifname is not None:
        _check_ifname(settings.socket_ifname,
                      local_interfaces() if interfaces is None else interfaces)
    if settings.rank_table_file is not None:
        _check_rank_table(settings.rank_table_file, world_size)


def _check_ifname(spec: str, interfaces: Collection[str]) -> None:
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    names = (body[1:] if exact else body).split(",")
    if exclude:
        return  # an exclusion list leaves HCCL its own choice among the rest
    found = [n for n in interfaces if (n in names if exact else n.startswith(tuple(names)))]
    if not found:
        raise HcclEnvError(f"HCCL_SOCKET_IFNAME={spec!r} matches no NIC of this host "
                           f"(has: {', '.join(sorted(interfaces)) or 'none'})")


def _check_rank_table(path: str, world_size: int) -> None:
    if not os.path.isfile(path):
        raise HcclEnvError(f"RANK_TABLE_FILE={path!r} does not exist on this node")
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        devices = sum(len(server["device"]) for server in table["server_list"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HcclEnvError(f"RANK_TABLE_FILE={path!r} is not a rank table (JSON with "
                           f"server_list[].device[]): {exc}") from exc
    if devices != world_size:
        raise HcclEnvError(f"RANK_TABLE_FILE={path!r} lists {devices} devices but the launch "
                           f"has {world_size} ranks; make them agree")


def is_local_address(ip: str) -> bool:
    """True when ``ip`` is assigned on this host (a socket can bind to it; nothing is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            return False
    return True


def local_interfaces() -> list[str]:
    """This host's NIC names."""
    return [name for _, name in socket.if_nameindex()]
