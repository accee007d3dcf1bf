"""Names of shared KV pools in /dev/shm: the one a pool gets by default, and finding them again.

A `KVPool` created with ``shared=True`` and no name is called ``mooncake_kv.<pid>.<random>``, so
the files of a process that died without closing its pools can be found by its pid. Standard
library only: launchers and leak checks use it without importing torch (`pool` does).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["SHM_DIR", "default_pool_name", "shared_pool_paths"]

SHM_DIR = Path("/dev/shm")
_PREFIX = "mooncake_kv"


def default_pool_name() -> str:
    """A fresh name for a shared pool of this process: ``mooncake_kv.<pid>.<12 hex digits>``."""
    return f"{_PREFIX}.{os.getpid()}.{secrets.token_hex(6)}"


def shared_pool_paths(pid: int | None = None) -> list[Path]:
    """The /dev/shm files of shared pools that took the default name, sorted.

    Args:
        pid: only the pools that process created (e.g. a SIGKILLed worker's, to unlink them);
            None: every process's.

    Returns:
        Paths under `SHM_DIR`; pools created with an explicit name are not among them.
    """
    pattern = f"{_PREFIX}.*" if pid is None else f"{_PREFIX}.{int(pid)}.*"
    return sorted(SHM_DIR.glob(pattern))
