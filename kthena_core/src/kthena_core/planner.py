"""Planner: choose TP x PP x SP x DP, EP for MoE models (in PD mode each role's layout and count)
for a model on a topology.

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

In PD mode a candidate is a `PDLayout`: a layout and an instance count per role
(`kthena_core.pd_roles.pd_layouts`), each role priced on its own devices
(`kthena_core.pd_plan`).

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
    estimate_colocated,
    memory,
    objective_cost,
    slo_reasons,
)
from kthena_core.experts import ExpertSplitError, allowed_ep_sizes, check_ep
from kthena_core.layout import Layout, LayoutError, PDLayout, with_ep
from kthena_core.model_spec import ModelSpec, human_bytes
from kthena_core.pd_plan import PDJudge, decode_split
from kthena_core.pd_roles import pd_layouts
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
           "Planner", "excluded_devices", "usable_device_ids", "why_lost"]


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

    def layouts(self, model: ModelSpec, topology: Topology,
                workload: Workload) -> Iterator[Layout | PDLayout]:
        """Every (tp, pp, dp, sp, ep) with tp*pp*dp <= usable devices and tp dividing the
        attention heads (sp > 1, ep > 1 only when weighed); in PD mode every `PDLayout` (a
        layout and a count per role, `pd_roles.pd_layouts`). The rest is judged later."""
        n = len(usable_device_ids(topology))
        if workload.mode == "pd":
            yield from pd_layouts(model, n, self.role_tp_sizes(model))
            return
        for tp in (t for t in model.tp_sizes_dividing_heads() if t <= n):
            for pp, dp in ((p, d) for p in range(1, n // tp + 1)
                           for d in range(1, n // (tp * p) + 1)):
                sps = (1, tp) if tp > 1 and self.sequence_parallel else (1,)
                for sp, ep in itertools.product(sps, self._ep_sizes(model, workload, dp)):
                    yield with_ep(Layout(tp, pp, dp, sp), ep)

    def role_tp_sizes(self, model: ModelSpec) -> tuple[int, ...]:
        """The tp a PD role may have: those dividing the heads (a pinned planner adds the
        pinned ones)."""
        return model.tp_sizes_dividing_heads()

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

    def evaluate(self, model: ModelSpec, topology: Topology, workload: Workload,
                 layout: Layout | PDLayout, ctx: _TopologyView | None = None,
                 split_points: Sequence[int] | None = None) -> Evaluation:
        """Judge one layout: structure, pipeline split, memory, SLOs, then cost.

        With pp > 1 the stages are cut at `split_points` when given; otherwise equal stages,
        or the balanced split when the cost model finds equal stages unbalanced by more than
        `UNEVEN_THRESHOLD` or pp does not divide the layers
        (`kthena_core.pipeline_split.propose_split`). A `PDLayout` is judged role by role
        (`kthena_core.pd_plan.PDJudge`).

        Raises:
            LayoutError: a plain Layout in PD mode, or a PDLayout in colocated mode.
        """
        ctx = ctx or _TopologyView(topology, self.params)
        if isinstance(layout, PDLayout) != (workload.mode == "pd"):
            wanted = "a PDLayout (a layout per role)" if workload.mode == "pd" else "a Layout"
            raise LayoutError(f"mode {workload.mode} judges {wanted}, got {layout!r}")
        if isinstance(layout, PDLayout):
            return PDJudge(model, workload, ctx, self.params).evaluate(layout)
        points = None if split_points is None else tuple(split_points)
        reasons = self.structural_reasons(model, layout, points)
        if reasons:
            return Evaluation(layout, tuple(reasons))
        dev = ctx.figures
        links = ctx.links(layout.tp, layout.pp, layout.dp, layout.ep)
        seqs = math.ceil(workload.concurrency / layout.dp)
        split = decode_split(model, workload, layout, dev, links, seqs, points)
        points = split.points if split is not None and split.is_uneven else None
        mem = memory(model, workload, layout, dev, self.params, seqs, points)
        if not mem.fits:
            reasons.append(
                f"needs {human_bytes(mem.total)} per device > {human_bytes(mem.capacity)} usable "
                f"(weights {human_bytes(mem.weights)}, KV {human_bytes(mem.kv_cache)})"
            )
            return Evaluation(layout, tuple(reasons), mem, split=split)
        est = estimate_colocated(model, workload, layout, dev, links, points, self.params)
        reasons += slo_reasons(workload, est)
        cost = math.inf if reasons else objective_cost(workload, est)
        return Evaluation(layout, tuple(reasons), mem, est, cost, split)

    def plan(self, model: ModelSpec, topology: Topology, workload: Workload | None = None) -> Plan:
        """Choose the best layout.

        Raises:
            NoFeasiblePlanError: nothing fits; the message summarises the reasons.
        """
        workload = workload or Workload()
        ctx = _TopologyView(topology, self.params)
        judge = PDJudge(model, workload, ctx, self.params)  # PD: remembers what roles share
        evals = [judge.evaluate(lay) if isinstance(lay, PDLayout) else
                 self.evaluate(model, topology, workload, lay, ctx, self.pipeline_split_points(lay))
                 for lay in self.layouts(model, topology, workload)]
        spans = {e.layout: _tp_spans(ctx, e.layout) for e in evals}
        evals = sorted(_keep_tp_in_nodes(evals, spans), key=Evaluation.sort_key)
        if not evals or not evals[0].feasible:
            raise NoFeasiblePlanError(_no_plan_message(model, topology, workload, evals))
        best = evals[0]
        notes = (_span_note(best, evals, spans), *_head_notes(model, best.layout))
        return Plan(model, topology.name or topology.source, workload, best,
                    tuple(ctx.order[: best.layout.num_devices]), tuple(evals), ctx.excluded,
                    tuple(n for n in notes if n))


Span = tuple[str, int, int]  # (the role whose TP groups span the most nodes, its tp, nodes)


def _tp_spans(ctx: _TopologyView, layout: Layout | PDLayout) -> Span:
    """The role whose TP groups span the most nodes, its tp and those nodes (``""`` for a
    colocated layout)."""
    if not isinstance(layout, PDLayout):
        return "", layout.tp, ctx.nodes_per_tp_group(layout.tp, layout.num_devices)
    first = layout.prefill.num_devices
    return max((("prefill", layout.prefill.tp, ctx.nodes_per_tp_group(layout.prefill.tp, first)),
                ("decode", layout.decode.tp,
                 ctx.nodes_per_tp_group(layout.decode.tp, layout.decode.num_devices, first))),
               key=lambda span: span[2])


def _spans_text(span: Span, its: str = "") -> str:
    """``TP16 groups span 2 nodes`` (PD: ``the decode role's TP16 groups ...``)."""
    role, tp, nodes = span
    whose = f"{its or 'the'} {role} role's " if role else its + " " * bool(its)
    return f"{whose}TP{tp} groups span {nodes} nodes"


def _keep_tp_in_nodes(evals: list[Evaluation],
                      spans: dict[Layout | PDLayout, Span]) -> list[Evaluation]:
    """`evals`, with every feasible layout whose TP groups span nodes refused when one whose
    TP groups each stay on one node is feasible."""
    inside = [e for e in evals if e.feasible and spans[e.layout][2] == 1]
    if not inside:
        return evals
    best = min(inside, key=Evaluation.sort_key).layout
    return [attrs.evolve(e, reasons=(
                f"{_spans_text(spans[e.layout], 'its')}, and a layout whose TP groups each "
                f"stay on one node fits ({best.label})",), cost=math.inf)
            if e.feasible and spans[e.layout][2] > 1 else e for e in evals]


def _span_note(best: Evaluation, evals: list[Evaluation],
               spans: dict[Layout | PDLayout, Span]) -> str | None:
    """Why the chosen layout's TP groups span nodes (None when they do not)."""
    if spans[best.layout][2] == 1:
        return None
    inside = [e for e in evals if spans[e.layout][2] == 1]
    head = _spans_text(spans[best.layout])
    head = head[0].upper() + head[1:] if head.startswith("the ") else head
    if not inside:
        return f"{head}: no layout whose TP groups each stay on one node was judged"
    sized = [e for e in inside if e.memory is not None]
    closest = (min(sized, key=lambda e: e.memory.total / e.memory.capacity)  # type: ignore[union-attr]
               if sized else inside[0])
    return (f"{head}: none of the {len(inside)} layouts whose TP groups each stay on one node "
            f"fits; the closest, {closest.layout.label}: {closest.reasons[0]}")


def _head_notes(model: ModelSpec, layout: Layout | PDLayout) -> list[str | None]:
    """Why a tp the planner would not propose (it does not divide the heads) runs unevenly;
    in PD mode per role."""
    if isinstance(layout, PDLayout):
        return [_head_note(model, lay.tp, f"{role}: ") for role, lay in layout.roles]
    return [_head_note(model, layout.tp)]


def _head_note(model: ModelSpec, tp: int, prefix: str = "") -> str | None:
    try:
        check_tp_divides_heads(model.shape.num_attention_heads, model.split_kv_heads, tp)
    except HeadSplitError as e:
        return f"{prefix}{e} (this tp was pinned, not proposed)"
    return None


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
    if not evals and wl.mode == "pd" and n < 2:
        # layouts() yields no PD candidate below two replicas: say so rather than "no candidates".
        return (f"no PD layout of {model.name} on {where}: a PD plan needs at least 2 devices "
                f"(1 prefill + 1 decode instance); this topology has {n}{' usable' * bool(excluded)} "
                f"device{'s' * (n != 1)}"
                f"{health}. Plan with mode colocated (--mode colocated), or on a topology with more devices")
    return (f"no layout of {model.name} fits {n} device(s) of {where}{health} for "
            f"{wl.concurrency} x {wl.context_len} tokens: " + "; ".join(parts or ["no candidate layouts"]))
