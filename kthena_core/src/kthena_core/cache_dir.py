"""The cache folder the command lines share: converted checkpoints, kernel timings, host
measurements and this machine's calibration.

Only command-line shells call `default_cache_dir` (``kthena``'s subcommands, ``kthena serve``);
the library functions below them take the folder as an argument.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "default_cache_dir"]

CACHE_ENV = "KTHENA_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$KTHENA_CACHE_DIR`` if set, else ``~/.cache/kthena``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kthena")
