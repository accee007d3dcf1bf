"""Physical limits of ``kthena bench serve``'s workloads on the machine they ran on.

Two figures are measured on the bench's own torch threads, each the best of a few runs, by the
probes CPU discovery uses (``kthena_core.discovery.host_probe``):

* memory bandwidth: a ``sum`` over a 256 MiB tensor (bytes read ÷ seconds), in bf16 and in
  float32; the larger counts, since the bf16 sum can be bound by its conversions, not memory;
* matmul peak: ``F.linear`` of 2048 rows by the model's largest decoder linear weight, in bf16
  and in float32; the larger counts, since a CPU without bf16 arithmetic (x86 without AVX-512)
  runs a bf16 ``F.linear`` ~8-10x below its fp32 one, and the engine's matmuls there run in fp32
  (``mooncake_ops.linear.FP32_COMPUTE_BF16``).

Each workload's ideal time is then a roofline over the work it must do (sizes from kthena_core's
`ModelShape`):

    prefill of tokens [start, end) of one sequence   FLOPs ÷ peak
        FLOPs = 2 × linear params × (end - start)            (every decoder linear)
              + 4 × heads × head_dim × layers × Σ (p + 1)    (QKᵀ and PV, token p sees p + 1)
              + 2 × vocab × hidden                           (LM head, last token only)
    one decode step of B sequences at contexts c_i   max(bytes ÷ bandwidth, FLOPs ÷ peak)
        bytes = 2 × (linear params + vocab × hidden)         (every bf16 weight, once per step)
              + Σ c_i × KV bytes per token                   (the cached keys and values)
        FLOPs = B × 2 × (linear params + vocab × hidden) + 4 × heads × head_dim × layers × Σ c_i

A batched step serves B tokens for one read of the weights, which is why (b) and (c) can be
compute-bound where (a) is bandwidth-bound. The achieved fraction is achieved ÷ limit for a rate
and limit ÷ achieved for a time, so 1.0 is the machine's limit for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kthena_core.discovery.host_probe import BANDWIDTH_BYTES, measure_bandwidth, measure_matmul_peak
from kthena_core.dtypes import dtype_bytes
from kthena_core.shape import ModelShape

__all__ = ["COMPARED", "MachineLimits", "achieved_fractions", "attention_flops", "decode_step_s",
           "kv_bytes_per_token", "largest_linear", "linear_params", "lm_head_params",
           "measure_limits", "peer_speedups", "prefill_s", "workload_limits"]

BF16_BYTES = int(dtype_bytes("bf16"))  # the bench serves bf16 weights and KV
# (label, workload, figure): what kthena bench serve's table, the speed-ups and the limit fractions compare
COMPARED = (("(a) decode, batch 1, tok/s", "a_batch1", "decode_tok_s"),
            ("(a) TTFT, 128-token prompt, s", "a_batch1", "ttft_s"),
            ("(b) 32 x (128 -> 64), output tok/s", "b_offline", "output_tok_s"),
            ("(c) shared prefix, reuse on, total s", "c_shared_prefix_reuse", "total_s"),
            ("(c) shared prefix, reuse off, total s", "c_shared_prefix_no_reuse", "total_s"))
MATMUL_ROWS = 2048


def linear_params(shape: ModelShape) -> int:
    """Weights of every decoder linear (q, k, v, o, gate, up, down) over all layers."""
    q_out, kv_out = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attention = shape.hidden_size * (2 * q_out + 2 * kv_out)
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return shape.num_layers * (attention + mlp)


def lm_head_params(shape: ModelShape) -> int:
    """Weights of the LM head (vocab x hidden)."""
    return shape.vocab_size * shape.hidden_size


def kv_bytes_per_token(shape: ModelShape) -> int:
    """K and V bytes of one token over all layers, in bf16 (what the bench serves)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * BF16_BYTES


def largest_linear(shape: ModelShape) -> tuple[int, int]:
    """(out, in) of the decoder linear with the most weights: the one the peak is measured on."""
    q_out = shape.num_attention_heads * shape.head_dim
    shapes = [(q_out, shape.hidden_size), (shape.hidden_size, q_out),
              (shape.intermediate_size, shape.hidden_size),
              (shape.hidden_size, shape.intermediate_size)]
    return max(shapes, key=lambda s: s[0] * s[1])


def attention_flops(shape: ModelShape, contexts: int) -> int:
    """QKᵀ and PV FLOPs over all layers for queries that see ``contexts`` keys in total."""
    return 4 * shape.num_attention_heads * shape.head_dim * shape.num_layers * contexts


@attrs.frozen
class MachineLimits:
    """What the machine can do on the bench's threads: bytes/s read and bf16 FLOP/s."""

    bandwidth_bytes_s: float = attrs.field(validator=attrs.validators.gt(0))
    peak_flop_s: float = attrs.field(validator=attrs.validators.gt(0))


def prefill_s(shape: ModelShape, limits: MachineLimits, start: int, end: int) -> float:
    """Ideal seconds to compute positions [start, end) of one sequence (compute-bound)."""
    if not 0 <= start < end:
        raise ValueError(f"prefill needs 0 <= start < end, got [{start}, {end})")
    seen = (end * (end + 1) - start * (start + 1)) // 2  # Σ (p + 1) for p in [start, end)
    flops = (2 * linear_params(shape) * (end - start) + attention_flops(shape, seen)
             + 2 * lm_head_params(shape))
    return flops / limits.peak_flop_s


def decode_step_s(shape: ModelShape, limits: MachineLimits, contexts: list[int]) -> float:
    """Ideal seconds of one decode step, one new token per sequence at these context lengths."""
    if not contexts or min(contexts) < 1:
        raise ValueError(f"a decode step needs one or more contexts >= 1, got {contexts}")
    weights = linear_params(shape) + lm_head_params(shape)
    read = BF16_BYTES * weights + sum(contexts) * kv_bytes_per_token(shape)
    flops = len(contexts) * 2 * weights + attention_flops(shape, sum(contexts))
    return max(read / limits.bandwidth_bytes_s, flops / limits.peak_flop_s)


def _decode_s(shape: ModelShape, limits: MachineLimits, prompts: list[int], steps: int) -> float:
    """Ideal seconds for ``steps`` decode steps after the prompts (the first token came from
    prefill, so step j extends each sequence from prompt + j tokens)."""
    return sum(decode_step_s(shape, limits, [p + j for p in prompts]) for j in range(1, steps))


def workload_limits(shape: ModelShape, limits: MachineLimits) -> dict[str, dict[str, float]]:
    """The ideal value of each workload's headline figure, keyed like the bench's JSON."""
    decode_a = _decode_s(shape, limits, [128], 64) / 63
    prefill_b = 32 * prefill_s(shape, limits, 0, 128)
    b_total = prefill_b + _decode_s(shape, limits, [128] * 32, 64)
    decode_c = _decode_s(shape, limits, [544] * 32, 16)
    # reuse on: the 512-token prefix once, then each request's own 32 tokens after it
    reuse = prefill_s(shape, limits, 0, 512) + 32 * prefill_s(shape, limits, 512, 544)
    no_reuse = 32 * prefill_s(shape, limits, 0, 544)
    return {"a_batch1": {"ttft_s": prefill_s(shape, limits, 0, 128), "decode_tok_s": 1 / decode_a},
            "b_offline": {"total_s": b_total, "output_tok_s": 32 * 64 / b_total},
            "c_shared_prefix_reuse": {"total_s": reuse + decode_c},
            "c_shared_prefix_no_reuse": {"total_s": no_reuse + decode_c}}


def _is_rate(metric: str) -> bool:
    return metric.endswith("_tok_s")


def achieved_fractions(achieved: Mapping[str, Mapping[str, float]],
                       limits: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per workload and figure present in both: the share of the limit reached (1.0 = limit).

    A rate (``*_tok_s``) gives achieved ÷ limit, a time (``*_s``) gives limit ÷ achieved.
    """
    out: dict[str, dict[str, float]] = {}
    for case, ideal in limits.items():
        for metric, value in ideal.items():
            got = achieved.get(case, {}).get(metric)
            if got:
                share = got / value if _is_rate(metric) else value / got
                out.setdefault(case, {})[metric] = round(share, 4)
    return out


def peer_speedups(ours: Mapping[str, Mapping[str, float]],
                  peer: Mapping[str, Mapping[str, float]],
                  metrics: Mapping[str, tuple[str, ...]]) -> dict[str, dict[str, float]]:
    """How many times faster we are than the peer per figure (> 1: ours is faster).

    A rate gives ours ÷ peer, a time gives peer ÷ ours. ``metrics`` names the figures compared
    per workload; one missing from either side is left out.
    """
    out: dict[str, dict[str, float]] = {}
    for case, names in metrics.items():
        for metric in names:
            a, b = ours.get(case, {}).get(metric), peer.get(case, {}).get(metric)
            if a and b:
                out.setdefault(case, {})[metric] = round(a / b if _is_rate(metric) else b / a, 4)
    return out


# ---- measurement -------------------------------------------------------------------------------
def measure_limits(shape: ModelShape, repeats: int = 5) -> tuple[MachineLimits, dict[str, Any]]:
    """Measure bandwidth and matmul peak on torch's current threads; (limits, JSON details).

    The probes are discovery's (``kthena_core.discovery.host_probe``), here at the model's own
    largest linear.
    """
    import torch

    reads = measure_bandwidth(BANDWIDTH_BYTES, repeats)
    out_features, in_features = largest_linear(shape)
    peaks = measure_matmul_peak(MATMUL_ROWS, in_features, out_features, repeats)
    limits = MachineLimits(max(reads.values()), max(peaks.values()))
    details = {"bandwidth_gb_s": round(limits.bandwidth_bytes_s / 1e9, 2),
               **{f"sum_{name}_gb_s": round(v / 1e9, 2) for name, v in reads.items()},
               "bandwidth_probe": f"sum over {BANDWIDTH_BYTES >> 20} MiB, best of {repeats}",
               "matmul_peak_gflop_s": round(limits.peak_flop_s / 1e9, 1),
               **{f"matmul_{name}_gflop_s": round(v / 1e9, 1) for name, v in peaks.items()},
               "matmul_probe": f"F.linear [{MATMUL_ROWS}, {in_features}] x "
                               f"[{out_features}, {in_features}]ᵀ in bf16 and float32, "
                               f"best of {repeats}",
               "torch_threads": torch.get_num_threads(),
               "weight_bytes_per_step": BF16_BYTES * (linear_params(shape) + lm_head_params(shape))}
    return limits, details
