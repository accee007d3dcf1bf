"""The rendezvous ``TCPStore``, its master listening on the master address only.

torch's ``TCPStore`` master binds every interface (``[::]``, dual stack, port ``MASTER_PORT``)
whatever host it is given; the host is only where clients connect. Anyone who can reach that
port can read and write the store (there is no authentication). So the master here binds a
socket to ``master_addr`` itself and hands torch the listening descriptor
(``master_listen_fd``): a store for 127.0.0.1 is reachable from this host only, a store for
10.0.0.1 from that network only.

If ``master_addr`` is not an address of this host (a NAT or service address that forwards
here), binding it fails with ``EADDRNOTAVAIL``; the master then falls back to torch's own
bind on every interface and logs a warning saying so.
"""

from __future__ import annotations

import errno
import logging
import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["open_store"]

_log = logging.getLogger(__name__)


def open_store(host: str, port: int, world_size: int | None, is_master: bool,
               timeout: timedelta) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port``; the master listens on ``host`` only (see module docs).

    Raises:
        OSError: the master cannot bind ``host:port`` (port taken, unknown host).
        torch.distributed.DistError (and other torch errors): the store did not come up.
    """
    listening = _listen(host, port) if is_master else None
    listen_fd = None
    if listening is not None:
        listen_fd, port = listening  # port 0 asked for any free port: this is the one bound
    # torch owns the descriptor from here on, and closes it even when the constructor fails.
    return dist.TCPStore(host, port, world_size, is_master, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=listen_fd)


def _listen(host: str, port: int) -> tuple[int, int] | None:
    """(descriptor, port) listening on ``host:port``; None if ``host`` is not on this machine."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch does
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as error:
        sock.close()
        if error.errno != errno.EADDRNOTAVAIL:
            raise
        _log.warning("TCPStore master: %s is not an address of this host; listening on every "
                     "interface instead", host)
        return None
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port
