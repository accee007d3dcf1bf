"""Planner: choose TP x PP x SP x DP, EP for MoE models (and the PD split) for a model on a topology.

``Planner().plan(model, topology, workload) -> Plan`` is a pure function. It enumerates every
layout that uses at most the topology's devices with a tp that divides the attention heads
(`kthena_core.shape.tp_sizes_dividing_heads`), rejects those the engine cannot shard (a tp the
heads cannot be split over, by the one rule in `kthena_core.shape.check_tp`; more stages than
layers; an ep the experts or instances cannot take, `kthena_core.experts.check_ep`) or that do
not fit memory, scores the rest with the roofline model in `cost_model`, and keeps the whole
table so a plan can say why each rival lost. A pipeline's stages are equal unless the cost
model finds them unbalanced (the LM head on the last stage) or pp does not divide the layers;
then the plan cuts them where the slowest stage is fastest and says why
(`kthena_core.pipeline_split`). KV memory is sized for the rank holding the most KV heads
(3 KV heads over tp=2: 2).

A TP group never spans nodes unless nothing else fits: when some layout whose TP groups each
stay on one node fits, every layout whose TP groups span nodes is refused, saying so; when none
fits, the plan may span nodes and its ``tp_notes`` say why.

Devices that discovery marks unhealthy (``Device.health`` in `EXCLUDED_HEALTH`) get no rank:
the planner lays ranks only on the usable devices and the plan lists the others with a reason.

Ranks are numbered with TP innermost (Megatron order) and laid onto devices domain by domain, so
a TP group stays inside one fast link domain (an HCCS mesh, an NVLink island) whenever it fits;
an EP group is ``ep`` consecutive instances::

    rank = (dp_index x pp + pp_index) x tp + tp_index
    devices: [domain 0: d0 d1 ... d7][domain 1: d8 ... d15] ...
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import attrs

from kthena_core._plan_topology import (
    EXCLUDED_HEALTH,
    NoFeasiblePlanError,
    _TopologyView,
    excluded_devices,
    excluded_text,
    usable_device_ids,
)
from kthena_core.cost_model import (
    CostParams,
    DeviceFigures,
    Estimate,
    Links,
    StagePricer,
    estimate_colocated,
    estimate_pd,
    memory,
)
from kthena_core.experts import ExpertSplitError, allowed_ep_sizes, check_ep
from kthena_core.layout import Layout, with_ep
from kthena_core.model_spec import ModelSpec, human_bytes
from kthena_core.pipeline_split import PipelineSplit, pinned_split, propose_split
from kthena_core.plan import Evaluation, ExcludedDevice, Plan, why_lost
from kthena_core.shape import (
    HeadSplitError,
    LayerSplitError,
    check_num_stages,
    check_split_points,
    check_tp_divides_heads,
)
from kthena_core.topology import Topology
from kthena_core.workload import Workload

__all__ = ["EXCLUDED_HEALTH", "Evaluation", "ExcludedDevice", "NoFeasiblePlanError", "Plan",
           "Planner", "decode_replicas", "excluded_devices", "usable_device_ids", "why_lost"]


class Planner:
    """Enumerates, filters and scores layouts. Stateless apart from its cost parameters."""

    def __init__(self, params: CostParams | None = None, *, sequence_parallel: bool = False,
                 wide_ep: bool = False) -> None:
        """``sequence_parallel``: also weigh sp = tp for every tp > 1 layout (the cost model
        prices SP's collectives and its token-wise saving); off, every layout has sp = 1.
        ``wide_ep``: for a MoE model in colocated mode, also weigh every ep > 1 that divides
        both dp and the experts: EP groups of instances (`kthena_core.experts`); off, every
        layout has ep = 1."""
        self.params = params or CostParams()
        self.sequence_parallel = sequence_parallel
        self.wide_ep = wide_ep

    def device_figures(self, topology: Topology) -> DeviceFigures:
        """The per-device figures (peaks x efficiencies) this planner scores `topology` with."""
        return _TopologyView(topology, self.params).figures

    # ---- enumeration ---------------------------------------------------------------------

    def layouts(self, model: ModelSpec, topology: Topology, workload: Workload) -> Iterator[Layout]:
        """Every (tp, pp, dp, sp, ep) with tp*pp*dp <= usable devices and tp dividing the
        attention heads (sp > 1, ep > 1 only when weighed); the rest is judged later."""
        n = len(usable_device_ids(topology))
        for tp in (t for t in model.tp_sizes_dividing_heads() if t <= n):
            for pp, dp in ((p, d) for p in range(1, n // tp + 1)
                           for d in range(1, n // (tp * p) + 1)):
                if workload.mode == "pd" and dp < 2:
                    continue
                sps = (1, tp) if tp > 1 and self.sequence_parallel else (1,)
                for sp, ep in itertools.product(sps, self._ep_sizes(model, workload, dp)):
                    yield with_ep(Layout(tp, pp, dp, sp), ep)

    def _ep_sizes(self, model: ModelSpec, workload: Workload, dp: int) -> tuple[int, ...]:
        if not (self.wide_ep and model.is_moe and workload.mode == "colocated"):
            return (1,)
        return allowed_ep_sizes(model.num_experts, dp)

    def structural_reasons(self, model: ModelSpec, layout: Layout,
                           split_points: Sequence[int] | None = None) -> list[str]:
        """Why `layout` (cut at `split_points`, or where the planner chooses) cannot shard
        `model` at all (empty if it can)."""
        reasons = []
        try:
            model.check_tp(layout.tp)
        except HeadSplitError as e:
            reasons.append(str(e))
        try:
            if split_points is None:
                check_num_stages(model.shape.num_layers, layout.pp)
            else:
                check_split_points(model.shape.num_layers, layout.pp, split_points)
        except LayerSplitError as e:
            reasons.append(str(e))
        try:
            check_ep(model.num_experts, layout.ep, layout.dp)
        except ExpertSplitError as e:
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
        `UNEVEN_THRESHOLD` or pp does not divide the layers
        (`kthena_core.pipeline_split.propose_split`).
        """
        points = None if split_points is None else tuple(split_points)
        reasons = self.structural_reasons(model, layout, points)
        if reasons:
            return Evaluation(layout, tuple(reasons))
        ctx = ctx or _TopologyView(topology, self.params)
        dev = ctx.figures
        links = ctx.links(layout.tp, layout.pp, layout.dp, layout.ep)
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
        evals = [self.evaluate(model, topology, workload, lay, ctx, self.pipeline_split_points(lay))
                 for lay in self.layouts(model, topology, workload)]
        spans = {e.layout: ctx.nodes_per_tp_group(e.layout.tp, e.layout.num_devices)
                 for e in evals}
        evals = sorted(_keep_tp_in_nodes(evals, spans), key=Evaluation.sort_key)
        if not evals or not evals[0].feasible:
            raise NoFeasiblePlanError(_no_plan_message(model, topology, workload, evals))
        best = evals[0]
        notes = (_span_note(best, evals, spans), _head_note(model, best.layout))
        return Plan(model, topology.name or topology.source, workload, best,
                    tuple(ctx.order[: best.layout.num_devices]), tuple(evals), ctx.excluded,
                    tuple(n for n in notes if n))


def decode_replicas(workload: Workload, layout: Layout) -> int:
    """The replicas that hold running sequences: all of them, or in PD mode all but the
    prefill ones (at least one replica prefills)."""
    return max(1, layout.dp - 1) if workload.mode == "pd" else layout.dp


def _keep_tp_in_nodes(evals: list[Evaluation], spans: dict[Layout, int]) -> list[Evaluation]:
    """`evals`, with every feasible layout whose TP groups span nodes refused when one whose
    TP groups each stay on one node is feasible."""
    inside = [e for e in evals if e.feasible and spans[e.layout] == 1]
    if not inside:
        return evals
    best = min(inside, key=Evaluation.sort_key).layout
    return [attrs.evolve(e, reasons=(
                f"its TP{e.layout.tp} groups span {spans[e.layout]} nodes, and a layout whose "
                f"TP groups each stay on one node fits ({best.label})",), cost=math.inf)
            if e.feasible and spans[e.layout] > 1 else e for e in evals]


def _span_note(best: Evaluation, evals: list[Evaluation], spans: dict[Layout, int]) -> str | None:
    """Why the chosen layout's TP groups span nodes (None when they do not)."""
    if spans[best.layout] == 1:
        return None
    inside = [e for e in evals if spans[e.layout] == 1]
    head = f"TP{best.layout.tp} groups span {spans[best.layout]} nodes"
    if not inside:
        return f"{head}: no layout whose TP groups each stay on one node was judged"
    sized = [e for e in inside if e.memory is not None]
    closest = (min(sized, key=lambda e: e.memory.total / e.memory.capacity)  # type: ignore[union-attr]
               if sized else inside[0])
    return (f"{head}: none of the {len(inside)} layouts whose TP groups each stay on one node "
            f"fits; the closest, {closest.layout.label}: {closest.reasons[0]}")


def _head_note(model: ModelSpec, layout: Layout) -> str | None:
    """Why a tp the planner would not propose (it does not divide the heads) runs unevenly."""
    try:
        check_tp_divides_heads(model.shape.num_attention_heads, model.split_kv_heads, layout.tp)
    except HeadSplitError as e:
        return f"{e} (this tp was pinned, not proposed)"
    return None


def _slo_reasons(workload: Workload, est: Estimate) -> list[str]:
    reasons = []
    if workload.ttft_slo_s is not None and est.ttft_s > workload.ttft_slo_s:
        reasons.append(f"TTFT {est.ttft_s * 1e3:.1f} ms misses the {workload.ttft_slo_s * 1e3:.0f} ms SLO")
    if workload.tpot_slo_s is not None and est.tpot_s > workload.tpot_slo_s:
        reasons.append(f"TPOT {est.tpot_s * 1e3:.2f} ms misses the {workload.tpot_slo_s * 1e3:.0f} ms SLO")
    return reasons


def _no_plan_message(model: ModelSpec, topology: Topology, wl: Workload, evals: list[Evaluation]) -> str:
    """Summarise why nothing fits, by kind: SLO misses, memory, layouts that cannot shard the model."""
    slo = [e for e in evals if e.estimate is not None]
    mem = [e for e in evals if e.estimate is None and e.memory is not None]
    shape = [e for e in evals if e.memory is None]
    parts = []
    if slo:
        parts.append(f"{len(slo)} layout(s) miss an SLO, e.g. {slo[0].layout.label}: {slo[0].reasons[0]}")
    if mem:
        least = min(mem, key=lambda e: e.memory.total / e.memory.capacity if e.memory else math.inf)
        parts.append(f"{len(mem)} exceed device memory, the closest {least.layout.label}: {least.reasons[0]}")
    if shape:
        parts.append(f"{len(shape)} cannot shard the model, e.g. {shape[0].reasons[0]}")
    where = topology.name or topology.source
    n = len(usable_device_ids(topology))
    excluded = excluded_devices(topology)
    health = (f" ({n} of {topology.num_devices} devices healthy; excluded: {excluded_text(excluded)})"
              if excluded else "")
    if not evals and wl.mode == "pd":
        # layouts() yields no PD candidate below two replicas: say so rather than "no candidates".
        return (f"no PD layout of {model.name} on {where}: a PD plan needs at least 2 devices "
                f"(1 prefill + 1 decode instance); this topology has {n}{' usable' * bool(excluded)} "
                f"device{'s' * (n != 1)}"
                f"{health}. Plan with mode colocated (--mode colocated), or on a topology with more devices")
    return (f"no layout of {model.name} fits {n} device(s) of {where}{health} for "
            f"{wl.concurrency} x {wl.context_len} tokens: " + "; ".join(parts or ["no candidate layouts"]))
