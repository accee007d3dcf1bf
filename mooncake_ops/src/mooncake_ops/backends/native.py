"""Adapter over the native C++ CPU kernels (native/), loaded on first use.

Two builds: ``mooncake_ops_native`` (every kernel, AVX-512) where torch runs at AVX512, else
``mooncake_ops_native_avx2`` (all but the packed bf16 matmul, which needs AVX512_BF16) where it
runs at AVX2. When neither loads, one log line says why (on the ``mooncake_ops.native``
logger: a deployment of several processes on one host sets it to ERROR in all but one, so the
line is printed once) and the reference runs for everything. Each adapter falls back to the reference for calls the kernels do not
cover (e.g. a head_dim that is not 64, 128 or 256).

Prefill over a cache of q's dtype or int8: the native kernel, with bf16 q/k/v on a CPU with
AVX512_BF16 (``native/csrc/attention_bf16.cpp``; decode over a bf16 cache uses the same
instructions, from the decode entry point), or with fp32 / bf16 / fp16 ones in fp32 arithmetic
in the AVX2 build (``native/csrc_avx2/prefill_attention_avx2.cpp``). Other prefill calls run
the CPU prefill path
(``sdpa.paged_prefill_attention_cpu``); over an int8 cache its cached half is run by the decode
kernel, which reads the int8 blocks and their scales in place (every new token's query rows of
a KV head form that kernel's GQA group) and returns the log-sum-exp the path merges by; no
dequantised copy of the cached tokens is made.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from mooncake_ops.backends import reference as ref
from mooncake_ops.backends import sdpa
from mooncake_ops.errors import BlockTableError, OpsShapeError

_log = logging.getLogger("mooncake_ops.native")
_state: dict[str, Any] = {"module": None, "reason": None, "loaded": False}

BUILD_HINT = "pip install --no-build-isolation ./native"


# torch's CPU capability -> the build that runs at it (each is compiled for its ISA throughout:
# importing the AVX-512 one on a CPU without it dies of SIGILL, so the check comes first)
_BUILDS = {"AVX512": "mooncake_ops_native", "AVX2": "mooncake_ops_native_avx2"}


def _load() -> Any:
    if _state["loaded"]:
        return _state["module"]
    _state["loaded"] = True
    capability = torch.backends.cpu.get_cpu_capability()
    name = _BUILDS.get("AVX512" if "AVX512" in capability else capability)
    if name is None:
        _state["reason"] = (f"this CPU runs torch at {capability}; the kernels need AVX512 "
                            "or AVX2")
    else:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            _state["reason"] = f"extension not built ({exc}); build it with `{BUILD_HINT}`"
        else:
            _state["module"] = module
    if _state["module"] is None:
        _log.warning("mooncake_ops: native CPU kernels unavailable (%s); using the PyTorch "
                     "reference", _state["reason"])
    return _state["module"]


def isa() -> str | None:
    """The ISA of the loaded build (``"avx512"`` or ``"avx2"``); None when none loaded."""
    module = _load()
    # a build from before the attribute existed can only be the AVX-512 one
    return None if module is None else getattr(module, "isa", "avx512")


def has(entry: str) -> bool:
    """Whether the loaded build has this entry point (the AVX2 build has no packed bf16
    matmul, the AVX-512 one no ``dense_linear``); False when none loaded."""
    module = _load()
    return module is not None and hasattr(module, entry)


def is_available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state["reason"]


def ops() -> dict[str, Callable[..., Any]]:
    """The ops this build implements natively (adapters that fall back when a call doesn't fit).

    `paged_prefill_attention` is not among them: it is the native bf16 kernel where it fits,
    else the SDPA CPU path with the native kernel for an int8 prefix (the CPU backend names it
    so)."""
    table = {"paged_decode_attention": paged_decode_attention, "write_kv": write_kv,
             "rms_norm": rms_norm, "rotary_embedding": rotary_embedding,
             "silu_and_mul": silu_and_mul, "int8_linear": int8_linear}
    return {op: fn for op, fn in table.items() if has(op)}


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


# The q dtypes each build's prefill kernel takes (the AVX-512 one also needs AVX512_BF16 at run
# time, and declines without it).
_PREFILL_DTYPES = {"avx512": (torch.bfloat16,),
                   "avx2": (torch.float32, torch.bfloat16, torch.float16)}


def paged_prefill_attention(q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens,
                            scale, k_scale=None, v_scale=None, out=None):
    if q.dtype in _PREFILL_DTYPES.get(isa(), ()) and has("paged_prefill_attention"):
        ref.prefill_lens(q, block_tables, cached_lens, query_lens, k_cache)  # value checks
        try:
            result = _state["module"].paged_prefill_attention(
                q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens, scale,
                k_scale=k_scale, v_scale=v_scale, out=out)
        except ValueError as exc:
            raise BlockTableError(str(exc)) from None
        if result is not None:
            return result
    cached = _cached_in_place if k_scale is not None else None  # bf16 etc.: flash over a gather
    return sdpa.paged_prefill_attention_cpu(q, k, v, k_cache, v_cache, block_tables, cached_lens,
                                            query_lens, scale, k_scale, v_scale, out,
                                            cached_attention=cached)


def _cached_in_place(queries, k_cache, v_cache, k_scale, v_scale, ids, num_cached, scale):
    """`sdpa.flash_cached`'s contract, by the decode kernel over the paged (int8) blocks."""
    rows, num_kv_heads, group, head_dim = queries.shape
    flat = queries.reshape(rows, num_kv_heads * group, head_dim)
    lens = torch.full((rows,), num_cached, dtype=torch.int32)
    lse = torch.empty(rows, num_kv_heads * group, dtype=torch.float32)
    result = _state["module"].paged_decode_attention(
        flat, k_cache, v_cache, ids.to(torch.int32), lens, scale, k_scale, v_scale, None, lse)
    if result is None:
        return sdpa.flash_cached(queries, k_cache, v_cache, k_scale, v_scale, ids, num_cached,
                                 scale)
    return result.view(queries.shape), lse.view(rows, num_kv_heads, group)


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


def int8_linear(x, weight, bias=None):
    try:
        out = _state["module"].int8_linear(x, weight, bias)
    except ValueError as exc:
        raise OpsShapeError(str(exc)) from None
    return ref.int8_linear(x, weight, bias) if out is None else out
