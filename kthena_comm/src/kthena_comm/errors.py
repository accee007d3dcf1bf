"""Exceptions raised by kthena_comm.

Every failure that crosses the library boundary is one of these. Each subclasses the builtin that
fits it (``ValueError`` for misuse, ``ConnectionError`` for an unreachable peer, ``TimeoutError``
for a deadline) so callers can catch either the specific class or the builtin. Foreign return
codes (torch.distributed, Mooncake) become these exceptions once, where the foreign call is made.
"""

from __future__ import annotations

# A parallel layout that cannot exist (sizes, SP vs TP) or does not fit the world (WORLD_SIZE,
# a rank outside it): kthena_core's, the layer that defines `Layout`, so one class catches both.
from kthena_core.layout import LayoutError as LayoutError


class CommError(RuntimeError):
    """Base class of every kthena_comm runtime failure."""


class RankEnvError(ValueError):
    """A rank's environment (RANK, WORLD_SIZE, ...) is missing or malformed."""

    def __init__(self, variable: str, value: str | None, allowed: str) -> None:
        self.variable = variable
        self.value = value
        shown = "unset" if value is None else repr(value)
        super().__init__(f"{variable} is {shown}; expected {allowed}")


class UnknownBackendError(LookupError):
    """A backend name (collective or transfer) is not in its registry."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown {kind} backend {name!r}; registered: {', '.join(sorted(known))}")


class DeviceUnavailableError(ValueError):
    """A rank's LOCAL_RANK names a device this host does not have."""

    def __init__(self, device_type: str, local_rank: int, have: int, requirement: str) -> None:
        self.device_type = device_type
        self.local_rank = local_rank
        super().__init__(f"LOCAL_RANK={local_rank} binds {device_type}:{local_rank}, but this "
                         f"host has {have} {device_type} device(s) ({device_type} needs "
                         f"{requirement}); start at most {have} ranks on this host "
                         "(--nproc_per_node)")


class InitError(CommError):
    """Process-group initialisation failed; names the rank, the address and the variable."""

    def __init__(self, rank: int, address: str, variable: str, reason: str) -> None:
        self.rank = rank
        self.address = address
        self.variable = variable
        super().__init__(f"rank {rank}: cannot initialise process group at {address} "
                         f"(check {variable}): {reason}")


class TransferError(CommError):
    """A one-sided transfer failed; names the backend, the peer and the operation."""

    def __init__(self, backend: str, peer: str, op: str, reason: str) -> None:
        self.backend = backend
        self.peer = peer
        self.op = op
        super().__init__(f"{backend}: {op} with peer {peer} failed: {reason}")


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its deadline."""


class PeerUnreachableError(TransferError, ConnectionError):
    """The peer process is dead or cannot be reached."""


class UnregisteredRangeError(TransferError, ValueError):
    """A local or remote byte range is not inside memory registered for transfer."""


class TransportUnavailableError(CommError, ValueError):
    """A backend cannot move this memory (or run this transport) as installed; says what is missing.

    Raised at registration (device memory on a host-only backend, cuda / npu memory on a Mooncake
    wheel built without that transport) and when an engine is configured for a transport the
    installed library lacks, before anything is initialised.
    """

    def __init__(self, backend: str, what: str, reason: str) -> None:
        self.backend = backend
        self.what = what
        super().__init__(f"{backend}: cannot use {what}: {reason}")


class EngineClosedError(CommError, ValueError):
    """An operation was attempted on a closed transfer engine."""

    def __init__(self, backend: str, op: str) -> None:
        super().__init__(f"{backend}: {op} called after close(); create a new engine")
