"""A Kthena serving group as a launcher sees it: the entry pod's address, this pod's index and
the group's size, from the variables Kthena injects into every pod of a multi-node role.

A ``ModelServing`` role with ``workerTemplate`` x ``workerReplicas`` runs one entry pod and
``workerReplicas`` worker pods as one group; Kthena sets, in each of them::

    ENTRY_ADDRESS   the entry pod's address (its headless-service name)  -> torchrun master_addr
    WORKER_INDEX    0 in the entry pod, 1 .. GROUP_SIZE-1 in the workers  -> torchrun node_rank
    GROUP_SIZE      entry + workers                                        -> torchrun nnodes

``kthena-run --serving-group`` reads them through `ServingGroup.from_environ`, which refuses a
missing or malformed variable, and a group of another size than the engine's ``--nnodes``,
naming the variable and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kthena_core.config import ConfigError

__all__ = ["ENTRY_ADDRESS_ENV", "GROUP_SIZE_ENV", "ServingGroup", "WORKER_INDEX_ENV"]

ENTRY_ADDRESS_ENV = "ENTRY_ADDRESS"
WORKER_INDEX_ENV = "WORKER_INDEX"
GROUP_SIZE_ENV = "GROUP_SIZE"
_SET_BY = "set by Kthena in every pod of a serving group"


@attrs.frozen
class ServingGroup:
    """This pod's place in its serving group.

    Attributes:
        entry_address: the entry pod's address: the rendezvous (master) address.
        worker_index: this pod's node rank (0: the entry pod).
        group_size: pods in the group: the number of nodes.
    """

    entry_address: str
    worker_index: int
    group_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str],
                     expected_size: int | None = None) -> ServingGroup:
        """The group the environment describes.

        Args:
            expected_size: the number of nodes the engine was planned for (``--nnodes``);
                None accepts any GROUP_SIZE.

        Raises:
            ConfigError: a variable is missing or malformed, GROUP_SIZE is not
                ``expected_size``, or WORKER_INDEX is outside 0..GROUP_SIZE-1.
        """
        address = environ.get(ENTRY_ADDRESS_ENV, "").strip()
        if not address or any(c.isspace() for c in address):
            raise ConfigError(f"{_shown(environ, ENTRY_ADDRESS_ENV)}: allowed: "
                              f"the entry pod's address, a host name or IP ({_SET_BY}; "
                              "kthena-run --serving-group runs only inside one)")
        size = _count(environ, GROUP_SIZE_ENV, "an integer >= 1: the pods of the group")
        if size < 1:
            raise ConfigError(f"{GROUP_SIZE_ENV}={size}: allowed: an integer >= 1 ({_SET_BY})")
        if expected_size is not None and size != expected_size:
            raise ConfigError(f"{GROUP_SIZE_ENV}={size}, but this engine spans --nnodes "
                              f"{expected_size} pods; allowed: {expected_size} (the role's "
                              f"workerReplicas + 1: render the manifests again from the plan)")
        index = _count(environ, WORKER_INDEX_ENV,
                       f"0..{size - 1}: 0 in the entry pod, 1..{size - 1} in the workers")
        if not 0 <= index < size:
            raise ConfigError(f"{WORKER_INDEX_ENV}={index}: allowed: 0..{size - 1} (0: the entry "
                              f"pod, 1..GROUP_SIZE-1: the workers; {GROUP_SIZE_ENV}={size})")
        return cls(address, index, size)


def _count(environ: Mapping[str, str], name: str, allowed: str) -> int:
    text = environ.get(name)
    try:
        return int((text or "").strip())
    except ValueError:
        raise ConfigError(f"{_shown(environ, name)}: allowed: {allowed} ({_SET_BY})") from None


def _shown(environ: Mapping[str, str], name: str) -> str:
    """``NAME='value'``, or ``NAME missing``."""
    return f"{name}={environ[name]!r}" if name in environ else f"{name} missing"
