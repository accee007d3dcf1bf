"""Planner: choose TP x PP x SP x DP (and the PD split) for a model on a topology.

``Planner().plan(model, topology, workload) -> Plan`` is a pure function. It enumerates every
layout that uses at most the topology's devices, rejects those the engine cannot shard (a tp the
heads cannot be split over, by the one rule in `kthena_core.shape.check_tp`; a pp that does not
divide the layers) or that do not fit memory, scores the rest with the roofline model in
`cost_model`, and keeps the whole table so a plan can say why each rival lost. A pipeline's
stages are equal unless the cost model finds them unbalanced (the LM head on the last stage),
when the plan moves the split points and says why (`kthena_core.pipeline_split`). KV memory is
sized for the rank holding the most KV heads (3 KV heads over tp=2: 2).

Devices that discovery marks unhealthy (``Device.health`` in `EXCLUDED_HEALTH`) get no rank:
the planner lays ranks only on the usable devices and the plan lists the others with a reason.

Ranks are numbered with TP innermost (Megatron order) and laid onto devices domain by domain, so
a TP group stays inside one fast link domain (an HCCS mesh, an NVLink island) whenever it fits::

    rank = (dp_index x pp + pp_index) x tp + tp_index
    devices: [domain 0: d0 d1 ... d7][domain 1: d8 ... d15] ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from kthena_core.cost_model import (
    CostParams,
    DeviceFigures,
    Estimate,
    Links,
    Memory,
    StagePricer,
    estimate_colocated,
    estimate_pd,
    memory,
)
from kthena_core.hardware import DeviceSpec
from kthena_core.layout import Layout
from kthena_core.model_spec import ModelSpec, human_bytes
from kthena_core.pipeline_split import PipelineSplit, pinned_split, propose_split
from kthena_core.shape import HeadSplitError, LayerSplitError, check_pp, check_split_points
from kthena_core.topology import Topology
from kthena_core.workload import Workload

# Health states whose devices never get a rank. "busy" (another process holds the device) stays
# usable: memory is still checked, and the operator may have started that process on purpose.
EXCLUDED_HEALTH = ("unhealthy",)


class NoFeasiblePlanError(ValueError):
    """No layout fits; the message lists the most common reasons."""


@attrs.frozen
class ExcludedDevice:
    """A device the planner left out, and why (e.g. "unhealthy (discovered:npu-smi)")."""

    device_id: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.device_id, "reason": self.reason}


def excluded_devices(topology: Topology) -> tuple[ExcludedDevice, ...]:
    """The devices of `topology` that get no rank, in device order."""
    where = topology.source or topology.name or "topology"
    return tuple(ExcludedDevice(d.index, f"{d.health} ({where})")
                 for d in topology.devices if d.health in EXCLUDED_HEALTH)


def usable_device_ids(topology: Topology) -> tuple[int, ...]:
    """The devices a plan may place ranks on, in device order."""
    return tuple(d.index for d in topology.devices if d.health not in EXCLUDED_HEALTH)


@attrs.frozen
class Evaluation:
    """One candidate layout, judged: feasible or not (with reasons), its memory and estimate."""

    layout: Layout
    reasons: tuple[str, ...] = ()
    memory: Memory | None = None
    estimate: Estimate | None = None
    cost: float = math.inf
    split: PipelineSplit | None = None  # pp > 1: the stages' split, and why (pipeline_split)

    @property
    def feasible(self) -> bool:
        return not self.reasons

    def sort_key(self) -> tuple[float, int, int, int, int]:
        """Cost, then fewer devices, smaller TP, smaller PP, no SP: the tie-break order."""
        lay = self.layout
        return (self.cost, lay.num_devices, lay.tp, lay.pp, lay.sp)


@attrs.frozen
class Plan:
    """The chosen layout, where each rank runs, and every candidate considered."""

    model: ModelSpec
    topology_name: str
    workload: Workload
    chosen: Evaluation
    device_ids: tuple[int, ...]        # rank -> global device index
    evaluations: tuple[Evaluation, ...]  # all candidates, best first
    excluded: tuple[ExcludedDevice, ...] = ()  # devices given no rank (unhealthy)

    @property
    def layout(self) -> Layout:
        """The chosen layout (``plan.layout.tp`` ...): what kthena_comm builds groups from."""
        return self.chosen.layout

    @property
    def world_size(self) -> int:
        return self.chosen.layout.num_devices

    @property
    def pipeline_split_points(self) -> tuple[int, ...] | None:
        """Where the chosen layout's stages 1.. start when they are not equal stages (moved by
        the planner, or pinned by the config); None: equal stages (``--pp`` alone)."""
        split = self.chosen.split
        return split.points if split is not None and split.is_uneven else None

    def tp_groups(self) -> list[list[int]]:
        """Ranks of each TP group (consecutive ranks)."""
        tp = self.layout.tp
        return [list(range(s, s + tp)) for s in range(0, self.world_size, tp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks of each pipeline (one per replica and TP index), stage order."""
        tp, pp, dp = self.layout.device_mapping
        return [[(d * pp + p) * tp + t for p in range(pp)] for d in range(dp) for t in range(tp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard in each replica."""
        tp, pp, dp = self.layout.device_mapping
        return [[(d * pp + p) * tp + t for d in range(dp)] for p in range(pp) for t in range(tp)]

    def rivals(self) -> list[Evaluation]:
        """The other candidates, best first, one per device mapping.

        Two layouts with the same tp, pp and dp put the same ranks on the same devices in the
        same groups; SP only changes how activations are split inside a TP group. Such twins
        are one plan to a reader, so only the best-ranked of each is kept, and none with the
        chosen layout's mapping (which would otherwise come back as "the same, with SP").
        """
        seen = {self.chosen.layout.device_mapping}
        rivals = []
        for e in self.evaluations:
            if e.layout.device_mapping not in seen:
                seen.add(e.layout.device_mapping)
                rivals.append(e)
        return rivals

    def sp_note(self) -> str | None:
        """Why the chosen layout runs with or without sequence parallelism: its SP twin (same
        devices and groups, the other sp) compared on cost, TTFT and activation memory; None
        when the chosen layout has no twin (tp = 1, or SP not weighed)."""
        lay = self.chosen.layout
        twin = next((e for e in self.evaluations if e.layout.device_mapping == lay.device_mapping
                     and e.layout.sp != lay.sp), None)
        if twin is None:
            return None
        if not twin.feasible:
            return f"{'without' if lay.sp > 1 else 'with'} SP: " + "; ".join(twin.reasons)
        on, off = (self.chosen, twin) if lay.sp > 1 else (twin, self.chosen)
        assert on.estimate and off.estimate and on.memory and off.memory
        verdict = "chosen" if lay.sp > 1 else "not chosen"
        return (f"SP{lay.tp} {verdict}: predicted TTFT {on.estimate.ttft_s * 1e3:.1f} ms "
                f"with SP vs {off.estimate.ttft_s * 1e3:.1f} ms without (SP's reduce-scatter + "
                "all-gather against TP's all-reduce, the norms on 1/sp of the tokens); "
                f"activations {human_bytes(on.memory.activations)} vs "
                f"{human_bytes(off.memory.activations)} per device")

    def runner_ups(self, k: int = 5) -> list[tuple[Evaluation, str]]:
        """The next `k` rivals with one line each on why they lost to the chosen one."""
        return [(e, why_lost(e, self.chosen, self.workload)) for e in self.rivals()[:k]]

    def to_dict(self, num_candidates: int = 10) -> dict[str, Any]:
        return {
            "model": _model_dict(self.model, self.workload),
            "topology": self.topology_name,
            "workload": self.workload.to_dict(),
            "layout": attrs.asdict(self.chosen.layout),
            "world_size": self.world_size,
            "device_ids": list(self.device_ids),
            "excluded_devices": [x.to_dict() for x in self.excluded],
            "memory_per_device": _memory_dict(self.chosen.memory),
            "estimate": attrs.asdict(self.chosen.estimate) if self.chosen.estimate else None,
            "pipeline_split": (self.chosen.split.to_dict(self.model.shape.num_layers)
                               if self.chosen.split else None),
            "candidates": [
                {"layout": attrs.asdict(e.layout), "feasible": e.feasible, "cost": _finite(e.cost),
                 "estimate": attrs.asdict(e.estimate) if e.estimate else None,
                 "why_lost": why_lost(e, self.chosen, self.workload)}
                for e in self.rivals()[:num_candidates]
            ],
            "num_candidates_considered": len(self.evaluations),
            "sequence_parallel": self.sp_note(),
        }


def _model_dict(model: ModelSpec, wl: Workload) -> dict[str, Any]:
    """The model's figures the text report prints, plus the sizes they come from."""
    return {
        "name": model.name, "architecture": model.architecture,
        "num_params": model.num_params(), "num_active_params": model.num_params(active=True),
        "num_layers": model.shape.num_layers, "hidden_size": model.shape.hidden_size,
        "num_attention_heads": model.shape.num_attention_heads,
        "num_key_value_heads": model.shape.num_kv_heads, "head_dim": model.shape.head_dim,
        "vocab_size": model.shape.vocab_size,
        "dtype": wl.dtype, "weight_bytes": model.weight_bytes(wl.dtype),
        "kv_dtype": wl.kv_dtype, "kv_bytes_per_token": model.kv_bytes_per_token(wl.kv_dtype),
    }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def _memory_dict(mem: Memory | None) -> dict[str, float] | None:
    if mem is None:
        return None
    return {"weights": mem.weights, "kv_cache": mem.kv_cache, "activations": mem.activations,
            "reserve": mem.reserve, "total": mem.total, "capacity": mem.capacity}


def why_lost(e: Evaluation, best: Evaluation, wl: Workload) -> str:
    """One line on why `e` ranks below `best`."""
    if not e.feasible:
        return "; ".join(e.reasons)
    assert e.estimate is not None and best.estimate is not None
    a, b = e.estimate, best.estimate
    if wl.objective == "throughput":
        if math.isclose(a.throughput_tok_s, b.throughput_tok_s, rel_tol=1e-9):
            return "ties on throughput; loses the tie-break (more devices, larger tp/pp, or sp)"
        head = f"throughput {a.throughput_tok_s:.1f} vs {b.throughput_tok_s:.1f} tok/s"
    else:
        head = f"latency {e.cost * 1e3:.1f} vs {best.cost * 1e3:.1f} ms"
    detail = [f"TPOT {a.tpot_s * 1e3:.2f} ms", f"TTFT {a.ttft_s * 1e3:.1f} ms"]
    if a.comm_fraction > 0.05:
        detail.append(f"comm {a.comm_fraction:.0%} of step")
    if a.bubble_fraction > 0.05:
        detail.append(f"pipeline bubble {a.bubble_fraction:.0%}")
    return f"{head} ({', '.join(detail)})"


class Planner:
    """Enumerates, filters and scores layouts. Stateless apart from its cost parameters."""

    def __init__(self, params: CostParams | None = None, *,
                 sequence_parallel: bool = False) -> None:
        """``sequence_parallel``: also weigh sp = tp for every tp > 1 layout (the cost model
        prices SP's collectives and its token-wise saving); off, every layout has sp = 1."""
        self.params = params or CostParams()
        self.sequence_parallel = sequence_parallel

    def device_figures(self, topology: Topology) -> DeviceFigures:
        """The per-device figures (peaks x efficiencies) this planner scores `topology` with."""
        return _TopologyView(topology, self.params).figures

    # ---- enumeration ---------------------------------------------------------------------

    def layouts(self, model: ModelSpec, topology: Topology, workload: Workload) -> Iterator[Layout]:
        """Every (tp, pp, dp, sp) with tp*pp*dp <= usable devices (sp > 1 only when weighed);
        divisibility is judged later."""
        n = len(usable_device_ids(topology))
        for tp in range(1, n + 1):
            for pp in range(1, n // tp + 1):
                for dp in range(1, n // (tp * pp) + 1):
                    if workload.mode == "pd" and dp < 2:
                        continue
                    for sp in (1, tp) if tp > 1 and self.sequence_parallel else (1,):
                        yield Layout(tp, pp, dp, sp)

    def structural_reasons(self, model: ModelSpec, layout: Layout,
                           split_points: Sequence[int] | None = None) -> list[str]:
        """Why `layout` (cut at `split_points`, or into equal stages) cannot shard `model` at
        all (empty if it can)."""
        reasons = []
        try:
            model.check_tp(layout.tp)
        except HeadSplitError as e:
            reasons.append(str(e))
        try:
            if split_points is None:
                check_pp(model.shape.num_layers, layout.pp)
            else:
                check_split_points(model.shape.num_layers, layout.pp, split_points)
        except LayerSplitError as e:
            reasons.append(str(e))
        return reasons

    def pipeline_split_points(self, layout: Layout) -> tuple[int, ...] | None:
        """Split points this planner must use for `layout` (None: its own choice, see
        `evaluate`); a pinned config overrides it."""
        return None

    # ---- scoring -------------------------------------------------------------------------

    def evaluate(self, model: ModelSpec, topology: Topology, workload: Workload, layout: Layout,
                 ctx: _TopologyView | None = None,
                 split_points: Sequence[int] | None = None) -> Evaluation:
        """Judge one layout: structure, pipeline split, memory, SLOs, then cost.

        With pp > 1 the stages are cut at `split_points` when given; otherwise equal stages,
        or the balanced split when the cost model finds equal stages unbalanced by more than
        `UNEVEN_THRESHOLD` (`kthena_core.pipeline_split.propose_split`).
        """
        points = None if split_points is None else tuple(split_points)
        reasons = self.structural_reasons(model, layout, points)
        if reasons:
            return Evaluation(layout, tuple(reasons))
        ctx = ctx or _TopologyView(topology, self.params)
        dev = ctx.figures
        links = ctx.links(layout.tp, layout.pp, layout.dp)
        split = self._split(model, workload, layout, dev, links, points)
        points = split.points if split is not None and split.is_uneven else None
        seqs = math.ceil(workload.concurrency / decode_replicas(workload, layout))
        mem = memory(model, workload, layout, dev, self.params, seqs, points)
        if not mem.fits:
            reasons.append(
                f"needs {human_bytes(mem.total)} per device > {human_bytes(mem.capacity)} usable "
                f"(weights {human_bytes(mem.weights)}, KV {human_bytes(mem.kv_cache)})"
            )
            return Evaluation(layout, tuple(reasons), mem, split=split)
        estimate = estimate_pd if workload.mode == "pd" else estimate_colocated
        est = estimate(model, workload, layout, dev, links, points, self.params)
        reasons += _slo_reasons(workload, est)
        if workload.objective == "throughput":
            cost = -est.throughput_tok_s
        else:
            cost = est.ttft_s + workload.output_len * est.tpot_s
        return Evaluation(layout, tuple(reasons), mem, est, math.inf if reasons else cost, split)

    @staticmethod
    def _split(model: ModelSpec, workload: Workload, layout: Layout, dev: DeviceFigures,
               links: Links, points: tuple[int, ...] | None) -> PipelineSplit | None:
        """The stages' split (pp > 1), priced at the decode batch of one replica."""
        if layout.pp == 1:
            return None
        batch = math.ceil(workload.concurrency / decode_replicas(workload, layout))
        pricer = StagePricer(model, workload, layout, dev, links, batch)
        if points is not None:
            return pinned_split(model.shape.num_layers, layout.pp, points, pricer.time)
        return propose_split(model.shape.num_layers, layout.pp, pricer.time)

    def plan(self, model: ModelSpec, topology: Topology, workload: Workload | None = None) -> Plan:
        """Choose the best layout.

        Raises:
            NoFeasiblePlanError: nothing fits; the message summarises the reasons.
        """
        workload = workload or Workload()
        ctx = _TopologyView(topology, self.params)
        evals = sorted(
            (self.evaluate(model, topology, workload, lay, ctx, self.pipeline_split_points(lay))
             for lay in self.layouts(model, topology, workload)),
            key=Evaluation.sort_key,
        )
        if not evals or not evals[0].feasible:
            raise NoFeasiblePlanError(_no_plan_message(model, topology, workload, evals))
        best = evals[0]
        return Plan(model, topology.name or topology.source, workload, best,
                    tuple(ctx.order[: best.layout.num_devices]), tuple(evals), ctx.excluded)


def decode_replicas(workload: Workload, layout: Layout) -> int:
    """The replicas that hold running sequences: all of them, or in PD mode all but the
    prefill ones (at least one replica prefills)."""
    return max(1, layout.dp - 1) if workload.mode == "pd" else layout.dp


def _slo_reasons(workload: Workload, est: Estimate) -> list[str]:
    reasons = []
    if workload.ttft_slo_s is not None and est.ttft_s > workload.ttft_slo_s:
        reasons.append(f"TTFT {est.ttft_s * 1e3:.1f} ms misses the {workload.ttft_slo_s * 1e3:.0f} ms SLO")
    if workload.tpot_slo_s is not None and est.tpot_s > workload.tpot_slo_s:
        reasons.append(f"TPOT {est.tpot_s * 1e3:.2f} ms misses the {workload.tpot_slo_s * 1e3:.0f} ms SLO")
    return reasons


class _TopologyView:
    """What the cost model reads from a topology, computed once per plan() call."""

    def __init__(self, topology: Topology, params: CostParams) -> None:
        self.topology = topology
        self.eff = params.link_efficiency
        self.excluded = excluded_devices(topology)
        usable = set(usable_device_ids(topology))
        if not usable:
            raise NoFeasiblePlanError(
                f"topology {topology.name or topology.source!r}: 0 of {topology.num_devices} devices "
                f"are healthy; excluded: {_excluded_text(self.excluded)}")
        # Homogeneous devices are assumed; otherwise the slowest device sets the pace.
        specs = [topology.devices[i].spec for i in sorted(usable)]
        self.figures = DeviceFigures(
            flops=min(_dense_flops(s) for s in specs) * params.compute_efficiency,
            memory_bw=min(s.memory_bw for s in specs) * params.memory_efficiency,
            # memory_bytes == 0 means "the host's RAM, size unknown": no memory limit is applied.
            capacity=min(s.memory_bytes or math.inf for s in specs) * params.memory_utilization,
            step_overhead=params.step_overhead_s,
        )
        self.order = [i for i in _device_order(topology) if i in usable]
        self._links: dict[tuple[int, int, int], Links] = {}

    def links(self, tp: int, pp: int, dp: int) -> Links:
        key = (tp, pp, dp)
        if key not in self._links:
            self._links[key] = self._compute_links(tp, pp, dp)
        return self._links[key]

    def _compute_links(self, tp: int, pp: int, dp: int) -> Links:
        """Bottleneck bandwidths of the TP groups, the first replica's pipeline, and the PD hop.

        Every TP group is checked, not only the first: with devices excluded, a later group may
        straddle two link domains, and the slowest group sets the pace of the collective.
        """
        topo, order = self.topology, self.order
        groups = [order[s:s + tp] for s in range(0, tp * pp * dp, tp)]
        tp_bw = min(topo.group_bandwidth(g) for g in groups) if tp > 1 else math.inf
        tp_lat = max((topo.latency(g[0], b) for g in groups for b in g[1:]), default=0.0)
        hops = [(order[p * tp], order[(p + 1) * tp]) for p in range(pp - 1)]
        pp_bw = min((topo.bandwidth(a, b) for a, b in hops), default=math.inf)
        pp_lat = max((topo.latency(a, b) for a, b in hops), default=0.0)
        last = order[(dp - 1) * tp * pp]
        pd_bw = topo.bandwidth(order[0], last) if last != order[0] else math.inf
        return Links(tp_bw * self.eff, tp_lat, pp_bw * self.eff, pp_lat, pd_bw * self.eff)


def _dense_flops(spec: DeviceSpec) -> float:
    for key in ("bf16", "fp16", "fp32"):
        if spec.peak_flops.get(key):
            return float(spec.peak_flops[key])
    raise NoFeasiblePlanError(f"device {spec.name} lists no bf16/fp16/fp32 peak FLOP/s")


def _device_order(topology: Topology) -> list[int]:
    """Devices listed link domain by link domain, so consecutive ranks share the fastest fabric."""
    order: list[int] = []
    seen: set[int] = set()
    for domain in topology.link_domains():
        for i in sorted(domain):
            if i not in seen:
                order.append(i)
                seen.add(i)
    order.extend(d.index for d in topology.devices if d.index not in seen)
    return order


def _no_plan_message(model: ModelSpec, topology: Topology, wl: Workload, evals: list[Evaluation]) -> str:
    """Summarise why nothing fits, by kind: SLO misses, memory, layouts that cannot shard the model."""
    slo = [e for e in evals if e.estimate is not None]
    mem = [e for e in evals if e.estimate is None and e.memory is not None]
    shape = [e for e in evals if e.memory is None]
    parts = []
    if slo:
        parts.append(f"{len(slo)} layout(s) miss an SLO, e.g. {_layout_name(slo[0])}: {slo[0].reasons[0]}")
    if mem:
        least = min(mem, key=lambda e: e.memory.total / e.memory.capacity if e.memory else math.inf)
        parts.append(f"{len(mem)} exceed device memory, the closest {_layout_name(least)}: {least.reasons[0]}")
    if shape:
        parts.append(f"{len(shape)} cannot shard the model, e.g. {shape[0].reasons[0]}")
    where = topology.name or topology.source
    n = len(usable_device_ids(topology))
    excluded = excluded_devices(topology)
    health = (f" ({n} of {topology.num_devices} devices healthy; excluded: {_excluded_text(excluded)})"
              if excluded else "")
    if not evals and wl.mode == "pd":
        # layouts() yields no PD candidate below two replicas: say so rather than "no candidates".
        return (f"no PD layout of {model.name} on {where}: a PD plan needs at least 2 devices "
                f"(1 prefill + 1 decode instance); this topology has {n}{' usable' * bool(excluded)} "
                f"device{'s' * (n != 1)}"
                f"{health}. Plan with mode colocated (--mode colocated), or on a topology with more devices")
    return (f"no layout of {model.name} fits {n} device(s) of {where}{health} for "
            f"{wl.concurrency} x {wl.context_len} tokens: " + "; ".join(parts or ["no candidate layouts"]))


def _excluded_text(excluded: tuple[ExcludedDevice, ...]) -> str:
    return ", ".join(f"device {x.device_id} {x.reason}" for x in excluded) or "none"


def _layout_name(e: Evaluation) -> str:
    lay = e.layout
    return f"TP{lay.tp}xPP{lay.pp}xDP{lay.dp}" + (f"(SP{lay.sp})" if lay.sp > 1 else "")
