"""What the command lines share from the environment: the cache folder (converted checkpoints,
kernel timings, host measurements and this machine's calibration) and a recorded host probe
that stands in for measuring this one.

Only command-line shells call `default_cache_dir` and `host_probe_file` (``kthena``'s
subcommands, ``kthena serve``, ``kthena doctor``); the library functions below them take the
folder and the file as arguments.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "HOST_PROBE_ENV", "default_cache_dir", "host_probe_file"]

CACHE_ENV = "KTHENA_CACHE_DIR"
HOST_PROBE_ENV = "KTHENA_HOST_PROBE"


def default_cache_dir() -> Path:
    """``$KTHENA_CACHE_DIR`` if set, else ``~/.cache/kthena``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kthena")


def host_probe_file() -> str | None:
    """``$KTHENA_HOST_PROBE``: a host probe's JSON (the cache's form) used instead of measuring
    this machine; None when unset or empty."""
    return os.environ.get(HOST_PROBE_ENV) or None
