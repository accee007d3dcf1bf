"""A free TCP port on this host, for a process about to listen on it (a rendezvous store, a
Mooncake handshake, a child server). Another process may take it between this call and the
bind: callers that can, bind port 0 themselves and read the port back."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` listens on right now (the kernel's pick for port 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
