"""Byte sizes as people write them: ``parse_bytes("2GiB")`` (config values, flags).

The reader is kthena_core's (`kthena_core.sizes`), which ``kthena deploy k8s`` reads sizes with
too: one grammar for every layer.
"""

from __future__ import annotations

from kthena_core.sizes import parse_bytes

__all__ = ["parse_bytes"]
