"""Roofline cost model: memory per device and predicted TTFT / TPOT / throughput of a layout.

Every time is ``max(compute, memory traffic)`` per pipeline stage plus the collectives that
cannot overlap it (two TP all-reduces per layer, a ring costing ``2(tp-1)/tp x bytes / bw``
plus ``2(tp-1)`` link latencies) and the pipeline's point-to-point hops. A decode stage is
priced with its own layers plus its ends (the final norm and LM head on the last stage), so
with a large vocabulary equal stages are unbalanced and the slowest one sets the pace
(`kthena_core.pipeline_split` moves the split points). Decode runs
``m = min(B, pp)`` micro-batches; with fewer micro-batches than stages the pipeline idles::

    step = max(m, pp) x t_micro         bubble = 1 - m / max(m, pp)

Co-located serving pays for prefills inside decode (each prompt stalls the batch), PD serving
pays a KV transfer from the prefill to the decode instance instead (`kv_handoff_time`; PD's
roles are priced one by one in `kthena_core.pd_plan`).

Sequence parallelism (sp = tp, the engine's Megatron-style SP over the TP group) changes a
prefill only: each of the two all-reduces per layer becomes a reduce-scatter plus an all-gather
(ring: ``(tp-1)/tp x bytes / bw + (tp-1)`` latencies each, the pair scaled by
``CostParams.sp_collective_factor``), and the token-wise work (RMSNorms and residual adds, priced
as memory traffic) runs on 1/sp of the tokens. The matmuls and attention keep TP's head split
over every token, so attention's quadratic term is not divided by sp: SP's saving is linear in
the prompt while attention grows with its square, and on a ring SP's collectives cost what the
all-reduce did.

A mixture-of-experts layer holds every routed expert (weights count them all) but a token runs
only its top-k (FLOPs count those), and a decode step reads the distinct experts its batch is
routed to: ``experts.expected_experts_read`` (k at batch 1, nearly all at a large batch). With
expert parallelism (``layout.ep`` instances share one copy of the experts, `kthena_core.experts`)
a device holds ``routed / (tp x ep)`` of them, reads its share of the experts the group's
``ep x batch`` tokens touch, and every MoE layer adds a dispatch and a combine: each instance
sends ``(ep-1)/ep`` of its tokens' top-k copies of the hidden state to the others and gets them
back, spread over its tp ranks (``all_to_all_time``, over the EP group's bottleneck link).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs

from kthena_core.experts import expected_experts_read
from kthena_core.layout import Layout
from kthena_core.model_spec import ModelSpec
from kthena_core.shape import stage_layer_ranges
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
    # SP's reduce-scatter + all-gather pair over the ring model's price (which equals one
    # all-reduce): 1 on a ring backend; `kthena bench layouts --sp-prompts` measures it (gloo's
    # reduce-scatter costs about a whole all-reduce, docs/bench_layouts.md)
    sp_collective_factor: float = 1.0


@attrs.frozen
class Links:
    """Effective bandwidths (bytes/s) and latencies (s) the mapped layout sees."""

    tp_bw: float
    tp_latency: float
    pp_bw: float
    pp_latency: float
    pd_bw: float
    ep_bw: float = math.inf  # between the instances of an expert-parallel group
    ep_latency: float = 0.0


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


def reduce_scatter_time(num_bytes: float, n: int, bw: float, latency: float) -> float:
    """Ring reduce-scatter of `num_bytes` (the whole tensor) over `n` ranks."""
    return 0.0 if n <= 1 else (n - 1) / n * num_bytes / bw + (n - 1) * latency


def all_gather_time(num_bytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather into `num_bytes` (the whole gathered tensor) over `n` ranks."""
    return reduce_scatter_time(num_bytes, n, bw, latency)


def all_to_all_time(num_bytes: float, n: int, lanes: int, bw: float, latency: float) -> float:
    """An all-to-all over `n` instances, each holding `num_bytes` spread evenly over the others
    and itself: ``(n-1)/n`` of it leaves, over `lanes` links at `bw` each (an instance's tp
    ranks), in ``n - 1`` exchanges."""
    return 0.0 if n <= 1 else (n - 1) / n * num_bytes / (lanes * bw) + (n - 1) * latency


def ep_layer_comm(model: ModelSpec, tokens: float, layout: Layout, links: Links) -> float:
    """One MoE layer's dispatch and combine under expert parallelism, for `tokens` tokens per
    instance: each token's hidden state (bf16) goes to its top-k experts and comes back. Zero
    without EP."""
    if layout.ep <= 1 or not model.is_moe:
        return 0.0
    num_bytes = tokens * model.num_experts_per_tok * model.shape.hidden_size * 2.0
    return 2 * all_to_all_time(num_bytes, layout.ep, layout.tp, links.ep_bw, links.ep_latency)


def activation_element_bytes(wl: Workload) -> float:
    """Bytes of one activation element: int8 / int4 / fp8 weights are computed in bf16."""
    return 4.0 if wl.dtype == "fp32" else 2.0


def expert_params_read(model: ModelSpec, ep: int, tokens: float) -> float:
    """Routed-expert parameters one instance reads in a MoE layer when each of the ``ep``
    instances of its group runs `tokens` tokens: its share of the distinct experts the
    group's ``ep x tokens`` tokens are routed to."""
    if not model.is_moe:
        return 0.0
    touched = expected_experts_read(model.num_experts, model.num_experts_per_tok, ep * tokens)
    return touched / ep * model.expert_params()


# RMSNorm with its fused residual add reads x and the residual and writes both: four passes over
# [tokens, hidden] per norm, two norms per layer
TOKENWISE_PASSES_PER_LAYER = 8


def prefill_layer_comm(model: ModelSpec, tokens: int, layout: Layout, links: Links,
                       params: CostParams) -> float:
    """One layer's TP collectives in a prefill of `tokens` tokens: two all-reduces, or with SP
    two reduce-scatter + all-gather pairs (times ``params.sp_collective_factor``)."""
    act = tokens * model.shape.hidden_size * 2.0
    if layout.sp > 1:
        pair = (reduce_scatter_time(act, layout.tp, links.tp_bw, links.tp_latency)
                + all_gather_time(act, layout.tp, links.tp_bw, links.tp_latency))
        return 2 * params.sp_collective_factor * pair
    return 2 * allreduce_time(act, layout.tp, links.tp_bw, links.tp_latency)


def sp_tokenwise_saving(model: ModelSpec, tokens: int, layout: Layout, dev: DeviceFigures,
                        per_elem: float) -> float:
    """Seconds of token-wise work (norms, residual adds) SP takes off one stage's prefill: each
    rank does 1/sp of it. Zero without SP."""
    if layout.sp <= 1:
        return 0.0
    full = TOKENWISE_PASSES_PER_LAYER * tokens * model.shape.hidden_size * per_elem / dev.memory_bw
    return (1 - 1 / layout.sp) * full * model.shape.num_layers / layout.pp


@functools.lru_cache(maxsize=64)
def _weight_figures(model: ModelSpec, dtype: str) -> tuple[float, int]:
    """(bytes per parameter in `dtype`, parameters): what the planner asks of every layout,
    counted once per model (a PD plan prices thousands of role layouts)."""
    return model.weight_bytes(dtype) / model.num_params(), model.num_params()


def _unshared_routed(model: ModelSpec, ep: int, layer: int | None = None) -> float:
    """Routed-expert parameters (of `layer`, or all) an instance does not hold under EP."""
    return model.routed_params(layer) * (1 - 1 / ep)


def stage_weight_bytes(model: ModelSpec, dtype: str, tp: int, pp: int, ep: int = 1) -> float:
    """Weights on the most loaded device: its share of layers (of the routed experts, 1/ep of
    them) plus embedding and/or LM head."""
    per_param, num_params = _weight_figures(model, dtype)
    total = per_param * num_params
    embed = model.shape.vocab_size * model.shape.hidden_size * per_param
    head = 0.0 if model.tie_word_embeddings else embed
    layers = total - embed - head - _unshared_routed(model, ep) * per_param
    ends = embed + head if pp == 1 else max(embed, head) if head else embed
    return (layers / pp + ends) / tp


def activation_bytes(model: ModelSpec, wl: Workload, layout: Layout) -> float:
    """Peak live activations of one prefill step of a whole prompt, one layer at a time."""
    per_elem = activation_element_bytes(wl)
    hidden_parts = 4 * model.shape.hidden_size / max(layout.sp, 1)
    if layout.sp > 1:  # SP's all-gather materialises the whole [tokens, hidden] matmul input
        hidden_parts += model.shape.hidden_size
    shape = model.shape
    sharded = (2 * shape.intermediate_size
               + 3 * shape.num_attention_heads * shape.head_dim) / layout.tp
    return wl.prompt_len * per_elem * (hidden_parts + sharded)


def memory(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, params: CostParams,
           seqs_per_replica: int, split_points: Sequence[int] | None = None,
           tokens_per_seq: int | None = None) -> Memory:
    """Per-device memory of `layout` holding `seqs_per_replica` sequences of `tokens_per_seq`
    tokens (default: full context); with `split_points`, of the stage holding the most weights
    (and the one with the most layers' KV: every stage's pool has as many blocks)."""
    tokens = wl.context_len if tokens_per_seq is None else tokens_per_seq
    kv = model.kv_bytes_per_token(wl.kv_dtype, layout.tp) / layout.pp * seqs_per_replica * tokens
    weights = stage_weight_bytes(model, wl.dtype, layout.tp, layout.pp, layout.ep)
    if split_points is not None:
        ranges = stage_layer_ranges(model.shape.num_layers, layout.pp, split_points)
        kv *= layout.pp * max(map(len, ranges)) / model.shape.num_layers
        weights = max(_held_weight_bytes(model, wl.dtype, layout, r, s == 0, s == layout.pp - 1)
                      for s, r in enumerate(ranges))
    return Memory(
        weights=weights,
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
    per_param, num_params = _weight_figures(model, wl.dtype)
    held = per_param * (num_params - _unshared_routed(model, layout.ep))
    return flops, held / (layout.tp * layout.pp)


def _held_weight_bytes(model: ModelSpec, dtype: str, layout: Layout, layers: range, first: bool,
                       last: bool) -> float:
    """Weights one device of a stage holds: its layers (1/ep of their routed experts), the
    embedding on the first stage, the final norm and LM head on the last (a tied head is a
    second copy of the embedding there)."""
    per = _weight_figures(model, dtype)[0]
    embed = model.shape.vocab_size * model.shape.hidden_size
    head = 0 if model.tie_word_embeddings and first else embed if last else 0
    params = sum(model.layer_params(i) - _unshared_routed(model, layout.ep, i) for i in layers)
    params += (embed if first else 0) + head + (model.shape.hidden_size if last else 0)
    return params * per / layout.tp


class StagePricer:
    """One decode micro-step of any contiguous run of layers as a pipeline stage, on one device.

    A stage's work is its layers' (weights, attention over the context, KV read), plus the final
    norm and LM head on the last stage; the first stage's embedding lookup reads a few rows and
    is not counted. A MoE layer reads its dense part and the experts its micro-batch is routed
    to (`expert_params_read`), and under EP adds a dispatch and a combine. Per-layer sums are
    prefix sums, so pricing a run is O(1): the split balancer prices many of them.
    """

    def __init__(self, model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures | None,
                 links: Links | None, batch: int) -> None:
        micro = max(1, min(batch, layout.pp))
        self.b = b = batch / micro
        ctx = wl.prompt_len + wl.output_len / 2
        tp, per = layout.tp, _weight_figures(model, wl.dtype)[0]
        attn = model.attention_flops(1, int(ctx) + 1) / model.shape.num_layers
        kv = model.kv_bytes_per_token(wl.kv_dtype, tp) / model.shape.num_layers * b * ctx
        experts = expert_params_read(model, layout.ep, b)
        self._flops, self._bytes, self._moe = [0.0], [0.0], [0]
        for i in range(model.shape.num_layers):
            moe = model.is_moe_layer(i)
            read = model.layer_params(i) - model.routed_params(i) + (experts if moe else 0.0)
            self._flops.append(self._flops[-1] + b * (2.0 * model.layer_params(i, active=True) + attn) / tp)
            self._bytes.append(self._bytes[-1] + read * per / tp + kv)
            self._moe.append(self._moe[-1] + moe)
        hidden = model.shape.hidden_size
        end = model.shape.vocab_size * hidden + hidden  # LM head + final norm
        self._last = (b * 2.0 * end / tp, end * per / tp)
        self.dev, self.num_layers = dev, model.shape.num_layers
        act = b * model.shape.hidden_size * 2.0
        links = links or Links(math.inf, 0.0, math.inf, 0.0, math.inf)  # work() needs none
        self._layer_comm = 2 * allreduce_time(act, tp, links.tp_bw, links.tp_latency)
        self._moe_comm = ep_layer_comm(model, b, layout, links)
        self.hop = act / links.pp_bw + links.pp_latency if layout.pp > 1 else 0.0

    def work(self, layers: range, last: bool) -> tuple[float, float]:
        """(FLOPs, bytes read) of the stage running `layers` (and the LM head if `last`)."""
        flops = self._flops[layers.stop] - self._flops[layers.start]
        nbytes = self._bytes[layers.stop] - self._bytes[layers.start]
        return (flops + self._last[0], nbytes + self._last[1]) if last else (flops, nbytes)

    def comm(self, layers: range) -> float:
        """The stage's TP all-reduces (two per layer), its MoE layers' EP dispatch and combine,
        and its hop to the next stage."""
        moe = self._moe[layers.stop] - self._moe[layers.start]
        return len(layers) * self._layer_comm + moe * self._moe_comm + self.hop

    def time(self, layers: range, last: bool) -> float:
        """Seconds of one micro-batch through the stage: roofline, overhead, collectives."""
        flops, nbytes = self.work(layers, last)
        assert self.dev is not None, "StagePricer.time needs the device figures"
        return (max(flops / self.dev.flops, nbytes / self.dev.memory_bw) + self.dev.step_overhead
                + self.comm(layers))


def prefill_parts(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures,
                  links: Links, params: CostParams | None = None) -> tuple[float, float]:
    """(seconds of one stage of ``layers / pp`` layers of a prompt, its collectives included;
    the hop of its activations to the next stage): the parts `prefill_time` sums."""
    new = max(1, round(wl.prompt_len * (1 - wl.prefix_hit_rate)))
    flops, nbytes = prefill_work(model, wl, layout)
    act = new * model.shape.hidden_size * 2.0
    comm = model.shape.num_layers / layout.pp * prefill_layer_comm(model, new, layout, links,
                                                             params or CostParams())
    comm += model.num_moe_layers / layout.pp * ep_layer_comm(model, new, layout, links)
    hop = act / links.pp_bw + links.pp_latency if layout.pp > 1 else 0.0
    per_elem = activation_element_bytes(wl)
    stage = (max(flops / dev.flops, nbytes / dev.memory_bw) + dev.step_overhead
             - sp_tokenwise_saving(model, new, layout, dev, per_elem))
    return stage + comm, hop


def prefill_time(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, links: Links,
                 params: CostParams | None = None) -> float:
    """Time to first token of one request alone on a replica (its uncached part only); with
    sp > 1, SP's collectives (scaled by ``params.sp_collective_factor``) and its token-wise
    saving (see the module docs)."""
    stage, hop = prefill_parts(model, wl, layout, dev, links, params)
    return layout.pp * stage + (layout.pp - 1) * hop


def decode_work(model: ModelSpec, wl: Workload, layout: Layout, batch: int,
                split_points: Sequence[int] | None = None) -> tuple[float, float]:
    """(FLOPs, bytes read) of one device of the last stage (the whole model when pp = 1) for one
    micro-batch of `batch` sequences to advance a token."""
    last = stage_layer_ranges(model.shape.num_layers, layout.pp, split_points)[-1]
    return StagePricer(model, wl, layout, None, None, batch).work(last, True)


def decode_step(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures, links: Links,
                batch: int, split_points: Sequence[int] | None = None) -> tuple[float, float, float]:
    """(step time, comm fraction, bubble fraction) for `batch` sequences to advance one token.

    Each stage is priced with its own layers and ends (`StagePricer`); the slowest stage sets
    the pipeline's pace. `split_points`: where stages 1.. start (None: equal stages).
    """
    micro = max(1, min(batch, layout.pp))
    pricer = StagePricer(model, wl, layout, dev, links, batch)
    ranges = stage_layer_ranges(model.shape.num_layers, layout.pp, split_points)
    times = [pricer.time(r, s == layout.pp - 1) for s, r in enumerate(ranges)]
    slowest = max(range(layout.pp), key=times.__getitem__)
    t_micro = times[slowest]
    slots = max(micro, layout.pp)
    step = slots * t_micro
    return step, pricer.comm(ranges[slowest]) / t_micro, 1 - micro / slots


def estimate_colocated(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures,
                       links: Links, split_points: Sequence[int] | None = None,
                       params: CostParams | None = None) -> Estimate:
    """Prefill and decode time-share each replica; prompts stall the running batch."""
    batch = math.ceil(wl.concurrency / layout.dp)
    ttft = prefill_time(model, wl, layout, dev, links, params)
    step, comm, bubble = decode_step(model, wl, layout, dev, links, batch, split_points)
    # Over one request lifetime the batch absorbs `batch` prefills spread over output_len steps.
    tpot = step + batch * ttft / wl.output_len
    throughput = layout.dp * batch / tpot
    return Estimate(ttft, tpot, throughput, comm, bubble)


def kv_handoff_time(model: ModelSpec, wl: Workload, prefill: Layout, decode: Layout,
                    bw: float) -> float:
    """A prompt's KV from a prefill instance to a decode instance. Every rank moves its own
    share (its KV heads of its stage's layers) over its own link at `bw`, all at once: a
    prefill rank sends ``kv_bytes_per_token(tp_p) / pp_p`` per token, a decode rank receives
    ``kv_bytes_per_token(tp_d) / pp_d``, and the busier side sets the time. With the same TP
    the heads go rank to rank; with another they are re-sharded on the way, each byte still
    sent once and received once."""
    send = model.kv_bytes_per_token(wl.kv_dtype, prefill.tp) / prefill.pp
    receive = model.kv_bytes_per_token(wl.kv_dtype, decode.tp) / decode.pp
    return max(send, receive) * wl.prompt_len / bw


def objective_cost(wl: Workload, est: Estimate) -> float:
    """What the planner minimises: −tokens/s (objective throughput) or TTFT + output × TPOT
    (latency)."""
    if wl.objective == "throughput":
        return -est.throughput_tok_s
    return est.ttft_s + wl.output_len * est.tpot_s


def slo_reasons(wl: Workload, est: Estimate) -> list[str]:
    """The workload's SLOs that `est` misses, one line each."""
    reasons = []
    if wl.ttft_slo_s is not None and est.ttft_s > wl.ttft_slo_s:
        reasons.append(f"TTFT {est.ttft_s * 1e3:.1f} ms misses the {wl.ttft_slo_s * 1e3:.0f} ms SLO")
    if wl.tpot_slo_s is not None and est.tpot_s > wl.tpot_slo_s:
        reasons.append(f"TPOT {est.tpot_s * 1e3:.2f} ms misses the {wl.tpot_slo_s * 1e3:.0f} ms SLO")
    return reasons
