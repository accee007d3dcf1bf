"""Roofline cost model: memory per device and predicted TTFT / TPOT / throughput of a layout.

Every time is ``max(compute, memory traffic)`` per pipeline stage plus the collectives that
cannot overlap it (two TP all-reduces per layer, a ring costing ``2(tp-1)/tp x bytes / bw``
plus ``2(tp-1)`` link latencies) and the pipeline's point-to-point hops. Decode runs
``m = min(B, pp)`` micro-batches; with fewer micro-batches than stages the pipeline idles::

    step = max(m, pp) x t_micro         bubble = 1 - m / max(m, pp)

Co-located serving pays for prefills inside decode (each prompt stalls the batch), PD serving
pays a KV transfer from the prefill to the decode instance instead.
"""

from __future__ import annotations

import math

import attrs

from kthena_core.layout import Layout
from kthena_core.model_spec import ModelSpec
from kthena_core.workload import Workload

GiB = 1024**3


@attrs.frozen
class CostParams:
    """Efficiency factors applied to the catalog's peak figures (documented guesses, tunable).

    ``kthena_core.calibrate`` fits compute_efficiency, memory_efficiency and step_overhead_s
    to a ``kthena bench serve`` run; the defaults are guesses for a fused accelerator runtime.
    """

    compute_efficiency: float = 0.5   # achieved / peak matmul FLOP/s
    memory_efficiency: float = 0.8    # achieved / peak memory bandwidth
    link_efficiency: float = 0.8      # achieved / peak link bandwidth
    memory_utilization: float = 0.9   # share of device memory the runtime may use
    runtime_reserve_bytes: float = 1 * GiB  # workspace, comm buffers, allocator slack (capped at 5%)
    step_overhead_s: float = 0.0      # fixed cost per forward pass per stage (launches, Python)


@attrs.frozen
class Links:
    """Effective bandwidths (bytes/s) and latencies (s) the mapped layout sees."""

    tp_bw: float
    tp_latency: float
    pp_bw: float
    pp_latency: float
    pd_bw: float


@attrs.frozen
class DeviceFigures:
    """The per-device figures the model reads (from a DeviceSpec, after efficiencies)."""

    flops: float
    memory_bw: float
    capacity: float
    step_overhead: float = 0.0  # seconds per forward pass per stage


@attrs.frozen
class Memory:
    """Bytes per device (the most loaded device) and the usable capacity."""

    weights: float
    kv_cache: float
    activations: float
    reserve: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@attrs.frozen
class Estimate:
    """Predicted service figures of a layout under the workload."""

    ttft_s: float
    tpot_s: float
    throughput_tok_s: float
    comm_fraction: float    # share of a decode step spent in collectives
    bubble_fraction: float  # share of a decode step the pipeline idles
    kv_transfer_s: float = 0.0
    prefill_replicas: int = 0
    decode_replicas: int = 0


def allreduce_time(num_bytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of `num_bytes` over `n` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / bw + 2 * (n - 1) * latency


def stage_weight_bytes(model: ModelSpec, dtype: str, tp: int, pp: int) -> float:
    """Weights on the most loaded device: its share of layers plus embedding and/or LM head."""
    total = model.weight_bytes(dtype)
    per_param = total / model.num_params()
    embed = model.vocab_size * model.hidden_size * per_param
    head = 0.0 if model.tie_word_embeddings else embed
    layers = total - embed - head
    ends = embed + head if pp == 1 else max(embed, head) if head else embed
    return (layers / pp + ends) / tp


def activation_bytes(model: ModelSpec, wl: Workload, layout: Layout) -> float:
    """Peak live activations of one prefill step of a whole prompt, one layer at a time."""
    per_elem = 2.0 if wl.dtype in ("bf16", "fp16") else 4.0
    hidden_parts = 4 * model.hidden_size / max(layout.sp, 1)
    sharded = (2 * model.intermediate_size + 3 * model.num_attention_heads * model.head_dim) / layout.tp
    return wl.prompt_len * per_elem * (hidden_parts + sharded)


def memory(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, params: CostParams,
           seqs_per_replica: int) -> Memory:
    """Per-device memory of `layout` holding `seqs_per_replica` full-context sequences."""
    kv = model.kv_bytes_per_token(wl.kv_dtype, layout.tp) / layout.pp * seqs_per_replica * wl.context_len
    return Memory(
        weights=stage_weight_bytes(model, wl.dtype, layout.tp, layout.pp),
        kv_cache=kv,
        activations=activation_bytes(model, wl, layout),
        reserve=min(params.runtime_reserve_bytes, 0.05 * dev.capacity),
        capacity=dev.capacity,
    )


def prefill_work(model: ModelSpec, wl: Workload, layout: Layout) -> tuple[float, float]:
    """(FLOPs, bytes read) of one device for one request's uncached prompt on a stage."""
    new = max(1, round(wl.prompt_len * (1 - wl.prefix_hit_rate)))
    cached = wl.prompt_len - new
    flops = model.prefill_flops(new, cached) / (layout.tp * layout.pp)
    return flops, model.weight_bytes(wl.dtype) / (layout.tp * layout.pp)


def decode_work(model: ModelSpec, wl: Workload, layout: Layout, batch: int) -> tuple[float, float]:
    """(FLOPs, bytes read) of one device for one micro-batch of `batch` sequences to advance a token."""
    micro = max(1, min(batch, layout.pp))
    b = batch / micro
    ctx = wl.prompt_len + wl.output_len / 2
    flops = b * model.decode_flops(int(ctx)) / (layout.tp * layout.pp)
    weights = model.weight_bytes(wl.dtype) / (layout.tp * layout.pp)
    kv_read = model.kv_bytes_per_token(wl.kv_dtype, layout.tp) / layout.pp * b * ctx
    return flops, weights + kv_read


def prefill_time(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, links: Links) -> float:
    """Time to first token of one request alone on a replica (its uncached part only)."""
    new = max(1, round(wl.prompt_len * (1 - wl.prefix_hit_rate)))
    flops, nbytes = prefill_work(model, wl, layout)
    act = new * model.hidden_size * 2.0
    comm = 2 * model.num_layers / layout.pp * allreduce_time(act, layout.tp, links.tp_bw, links.tp_latency)
    hop = act / links.pp_bw + links.pp_latency if layout.pp > 1 else 0.0
    stage = max(flops / dev.flops, nbytes / dev.memory_bw) + dev.step_overhead
    return layout.pp * (stage + comm) + (layout.pp - 1) * hop


def decode_step(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, links: Links,
                batch: int) -> tuple[float, float, float]:
    """(step time, comm fraction, bubble fraction) for `batch` sequences to advance one token."""
    micro = max(1, min(batch, layout.pp))
    b = batch / micro
    flops, nbytes = decode_work(model, wl, layout, batch)
    act = b * model.hidden_size * 2.0
    comm = 2 * model.num_layers / layout.pp * allreduce_time(act, layout.tp, links.tp_bw, links.tp_latency)
    hop = act / links.pp_bw + links.pp_latency if layout.pp > 1 else 0.0
    t_micro = max(flops / dev.flops, nbytes / dev.memory_bw) + dev.step_overhead + comm + hop
    slots = max(micro, layout.pp)
    step = slots * t_micro
    return step, (comm + hop) / t_micro, 1 - micro / slots


def estimate_colocated(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures,
                       links: Links) -> Estimate:
    """Prefill and decode time-share each replica; prompts stall the running batch."""
    batch = math.ceil(wl.concurrency / layout.dp)
    ttft = prefill_time(model, wl, layout, dev, links)
    step, comm, bubble = decode_step(model, wl, layout, dev, links, batch)
    # Over one request lifetime the batch absorbs `batch` prefills spread over output_len steps.
    tpot = step + batch * ttft / wl.output_len
    throughput = layout.dp * batch / tpot
    return Estimate(ttft, tpot, throughput, comm, bubble)


def estimate_pd(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, links: Links) -> Estimate:
    """Best split of the dp replicas into prefill and decode instances (needs dp >= 2)."""
    ttft = prefill_time(model, wl, layout, dev, links)
    kv_bytes = model.kv_bytes_per_token(wl.kv_dtype, layout.tp) / layout.pp * wl.prompt_len
    transfer = kv_bytes / links.pd_bw
    best: Estimate | None = None
    for n_p in range(1, layout.dp):
        n_d = layout.dp - n_p
        batch = math.ceil(wl.concurrency / n_d)
        step, comm, bubble = decode_step(model, wl, layout, dev, links, batch)
        rate = min(n_p / ttft, n_d * batch / (step * wl.output_len))  # requests/s
        est = Estimate(ttft + transfer, step, rate * wl.output_len, comm, bubble, transfer, n_p, n_d)
        if best is None or est.throughput_tok_s > best.throughput_tok_s:
            best = est
    assert best is not None
    return best
