"""Byte sizes as people write them: ``parse_bytes("2GiB")`` (config values, flags, deploy files).

One reader for every layer: ``kthena serve --kv-cache-memory`` / ``--kv-offload`` (through
``kthena_serve.engine.sizes``) and ``kthena deploy k8s``'s ``kv_offload`` read sizes here.
"""

from __future__ import annotations

import re

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"2G"`` -> bytes.

    Raises:
        ValueError: an unknown unit or a non-positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size; write e.g. 1GiB, 512MiB or 2G")
        number, unit = float(match.group(1)), match.group(2).lower()
    num_bytes = int(number * _UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return num_bytes
