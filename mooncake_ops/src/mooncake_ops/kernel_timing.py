"""Timing kernel candidates at a model's own shapes: the matmuls (`measure_linear`) and the
paged attention ops (`measure_attention`), each candidate's median time, for
`mooncake_ops.selection` to choose from.

Matmuls are timed on decode-sized calls (1 and 8 rows through the model's own weights in layer
order, up to `_SWEEP_BYTES` of them and then the LM head, so weights stream from memory as in a
decode step) and on a prefill-sized one (`PREFILL_ROWS` rows through the first layers'
matmuls). Paged decode attention (batch 8, 512 tokens of context) and prefill attention
(`PREFILL_ROWS` new tokens after as many cached) are timed per candidate of the dispatch table
(`op_candidates`). A candidate that raises is left out (logged).
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Callable, Sequence

import attrs
import torch

from kthena_core.discovery.host_probe import sample_times
from mooncake_ops.dispatch import op_candidates
from mooncake_ops.linear import LinearKernel

__all__ = ["ATTENTION_OPS", "PREFILL_ROWS", "AttentionShape", "MatmulWeight", "Timer",
           "measure_attention", "measure_linear", "median_time"]

_log = logging.getLogger("mooncake_ops")

PREFILL_ROWS = 256
ATTENTION_OPS = ("paged_decode_attention", "paged_prefill_attention")
_DECODE_ROWS = (1, 8)
_SWEEP_BYTES = 256 << 20  # decode sweeps read at most this much weight (then the LM head)
_PREFILL_LAYERS = 2
_REPS = 5


@attrs.frozen
class MatmulWeight:
    """One matmul weight of the model, dense [out_features, in_features]; ``gate_up``: the MLP's
    [gate; up] input, which a kernel with a fused SwiGLU input runs fused."""

    weight: torch.Tensor
    gate_up: bool = False


@attrs.frozen
class AttentionShape:
    """What the attention timings are run with: one rank's heads and the KV cache's layout."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def key(self) -> list:
        return [self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, str(self.dtype)]


# timer(label, fn) -> seconds; the label names what is timed ("matmul_decode:<kernel>:<rows>",
# "matmul_prefill:<kernel>:<rows>", "<attention op>:<candidate>"), so tests can inject timings.
Timer = Callable[[str, Callable[[], object]], float]


def median_time(label: str, fn: Callable[[], object], reps: int = _REPS) -> float:
    """Median wall seconds of ``reps`` calls of ``fn`` after one warm-up call (``label`` is
    for injected timers only)."""
    return statistics.median(sample_times(fn, reps))


def _packed(kernel: LinearKernel,
            weights: Sequence[MatmulWeight]) -> list[tuple[torch.Tensor, bool]]:
    out = []
    for w in weights:
        fused = None
        if w.gate_up and kernel.pack_gate_up is not None:
            fused = kernel.pack_gate_up(w.weight)
        out.append((fused, True) if fused is not None else (kernel.pack(w.weight), False))
    return out


def _time_matmuls(label: str, kernel: LinearKernel, weights: Sequence[MatmulWeight],
                  rows: int, timer: Timer) -> float:
    """Seconds for one pass of ``rows`` rows through ``weights`` with ``kernel``."""
    packed = _packed(kernel, weights)
    inputs: dict[int, torch.Tensor] = {}
    calls = []
    for w, (p, fused) in zip(weights, packed, strict=True):
        k = w.weight.shape[1]
        x = inputs.setdefault(k, torch.randn(rows, k, dtype=w.weight.dtype))
        calls.append((p, fused, x))

    def one_pass() -> None:
        for p, fused, x in calls:
            kernel.gate_up_silu(x, p) if fused else kernel.linear(x, p)

    return timer(f"{label}:{kernel.name}:{rows}", one_pass)


def _time_or_none(what: str, fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except Exception as exc:  # a candidate that cannot run here is left out, not fatal
        _log.warning("kernel selection: %s failed (%s: %s); left out", what,
                     type(exc).__name__, exc)
        return None


def measure_linear(layers: Sequence[Sequence[MatmulWeight]], lm_head: MatmulWeight | None,
                   candidates: Sequence[LinearKernel], timer: Timer = median_time,
                   ) -> dict[str, dict[str, float | None]]:
    """{"decode": {kernel: s}, "prefill": {kernel: s}} for each candidate: decode is the sum
    over `_DECODE_ROWS` of a pass through the layers' weights (up to `_SWEEP_BYTES`) and the
    LM head; prefill a pass of `PREFILL_ROWS` rows through the first `_PREFILL_LAYERS` layers."""
    sweep, total = [], 0
    for layer in layers:
        if sweep and total >= _SWEEP_BYTES:
            break
        sweep += list(layer)
        total += sum(w.weight.nbytes for w in layer)
    if lm_head is not None:
        sweep.append(lm_head)
    first = [w for layer in layers[:_PREFILL_LAYERS] for w in layer]
    decode: dict[str, float | None] = {}
    prefill: dict[str, float | None] = {}
    for kernel in candidates:
        decode[kernel.name] = _time_or_none(f"{kernel.name} (decode)", lambda k=kernel: sum(
            _time_matmuls("matmul_decode", k, sweep, rows, timer) for rows in _DECODE_ROWS))
        prefill[kernel.name] = _time_or_none(f"{kernel.name} (prefill)", lambda k=kernel:
                                             _time_matmuls("matmul_prefill", k, first,
                                                           PREFILL_ROWS, timer))
    return {"decode": decode, "prefill": prefill}


def _attention_inputs(shape: AttentionShape, op: str) -> tuple:
    """Arguments for one timing call of ``op``: decode, a batch of 8 over 512 tokens each;
    prefill, one sequence of `PREFILL_ROWS` new tokens after as many cached."""
    context = 512 if op == "paged_decode_attention" else 2 * PREFILL_ROWS
    batch = 8 if op == "paged_decode_attention" else 1
    per_seq = -(-context // shape.block_size)
    num_blocks = batch * per_seq
    cache = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache, dtype=shape.dtype)
    v_cache = torch.randn(cache, dtype=shape.dtype)
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(batch, per_seq)
    scale = shape.head_dim ** -0.5
    if op == "paged_decode_attention":
        q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype)
        lens = torch.full((batch,), context, dtype=torch.int32)
        return q, k_cache, v_cache, tables, lens, scale
    q = torch.randn(PREFILL_ROWS, shape.num_heads, shape.head_dim, dtype=shape.dtype)
    k = torch.randn(PREFILL_ROWS, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
    v = torch.randn_like(k)
    cached = torch.tensor([context - PREFILL_ROWS], dtype=torch.int32)
    new = torch.tensor([PREFILL_ROWS], dtype=torch.int32)
    return q, k, v, k_cache, v_cache, tables, cached, new, scale


def measure_attention(shape: AttentionShape, timer: Timer = median_time,
                      device_type: str = "cpu") -> dict[str, dict[str, float | None]]:
    """{op: {candidate: s}} for each attention op with more than one candidate here."""
    found: dict[str, dict[str, float | None]] = {}
    for op in ATTENTION_OPS:
        candidates = op_candidates(op, device_type)
        if len(candidates) < 2:
            continue
        args = _attention_inputs(shape, op)
        found[op] = {name: _time_or_none(f"{op} {name}", functools.partial(
            timer, f"{op}:{name}", functools.partial(impl.fn, *args)))
            for name, impl in candidates.items()}
    return found
