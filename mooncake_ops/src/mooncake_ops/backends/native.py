"""Adapter over the native C++ CPU kernels (the ``mooncake_ops_native`` extension, native/).

Loaded on first use. When the extension is absent (or the CPU lacks AVX-512), one log line
says so and the PyTorch reference runs instead. Each adapter falls back to the reference for
calls the kernels do not cover (e.g. a head_dim that is not a multiple of 16).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

_log = logging.getLogger("mooncake_ops")
_state: dict[str, Any] = {"module": None, "reason": None, "loaded": False}

BUILD_HINT = "pip install --no-build-isolation ./native"


def _load() -> Any:
    if _state["loaded"]:
        return _state["module"]
    _state["loaded"] = True
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        import mooncake_ops_native as module  # type: ignore[import-not-found]
    except ImportError as exc:
        _state["reason"] = f"extension not built ({exc}); build it with `{BUILD_HINT}`"
    else:
        if "AVX512" not in capability:
            _state["reason"] = f"this CPU runs torch at {capability}; the kernels need AVX512"
        else:
            _state["module"] = module
    if _state["module"] is None:
        _log.info("mooncake_ops: native CPU kernels unavailable (%s); using the PyTorch "
                  "reference", _state["reason"])
    return _state["module"]


def is_available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state["reason"]


def ops() -> dict[str, Callable[..., Any]]:
    """The ops this build implements natively (adapters that fall back when a call doesn't fit)."""
    return {}
