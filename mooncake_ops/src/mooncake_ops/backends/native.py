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

from mooncake_ops.backends import reference as ref
from mooncake_ops.errors import BlockTableError

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
        _log.warning("mooncake_ops: native CPU kernels unavailable (%s); using the PyTorch "
                  "reference", _state["reason"])
    return _state["module"]


def is_available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state["reason"]


def ops() -> dict[str, Callable[..., Any]]:
    """The ops this build implements natively (adapters that fall back when a call doesn't fit)."""
    return {"paged_decode_attention": paged_decode_attention, "write_kv": write_kv,
            "rms_norm": rms_norm, "rotary_embedding": rotary_embedding,
            "silu_and_mul": silu_and_mul}


# The kernels return None / False for calls they do not cover (head_dim not 64/128/256, a
# hidden size not a multiple of 16, odd strides, GPT-J RoPE): those run the reference.
# They raise ValueError for bad values, which becomes the same error the reference raises.
def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=None, v_scale=None, out=None):
    try:
        result = _state["module"].paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, out)
    except ValueError as exc:
        raise BlockTableError(str(exc)) from None
    if result is None:
        return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          k_scale, v_scale, out)
    return result


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    try:
        done = _state["module"].write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale,
                                         v_scale)
    except ValueError as exc:
        raise BlockTableError(str(exc)) from None
    if not done:
        ref.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rms_norm(x, weight, eps, residual=None):
    out = _state["module"].rms_norm(x, weight, eps, residual)
    if out is None:
        return ref.rms_norm(x, weight, eps, residual)
    return out[0] if residual is None else (out[0], out[1])


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    out = None
    if is_neox:
        try:
            out = _state["module"].rotary_embedding(positions, q, k, cos_sin_cache)
        except ValueError as exc:
            raise BlockTableError(str(exc)) from None
    if out is None:
        return ref.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    return out[0], out[1]


def silu_and_mul(x):
    out = _state["module"].silu_and_mul(x)
    return ref.silu_and_mul(x) if out is None else out
