"""Plan: the planner's answer. The chosen `Evaluation` among every candidate it judged, where
each rank runs, and how the plan explains itself (runner-ups, the SP, EP and TP notes, a line
per PD role, JSON).

`kthena_core.planner` makes these; `kthena_core.report` prints them.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from kthena_core.cost_model import Estimate, Memory
from kthena_core.layout import Layout, PDLayout
from kthena_core.model_spec import ModelSpec, human_bytes
from kthena_core.pd_roles import RolePlan
from kthena_core.pipeline_split import PipelineSplit
from kthena_core.workload import Workload

__all__ = ["Evaluation", "ExcludedDevice", "Plan", "why_lost"]


@attrs.frozen
class ExcludedDevice:
    """A device the planner left out, and why (e.g. "unhealthy (discovered:npu-smi)")."""

    device_id: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.device_id, "reason": self.reason}


@attrs.frozen
class Evaluation:
    """One candidate layout, judged: feasible or not (with reasons), its memory and estimate.

    Attributes:
        layout: a `Layout`, or in PD mode a `PDLayout` (each role's).
        memory: per device; PD: of the role whose devices hold the most.
        split: pp > 1: the stages' split, and why (pipeline_split); PD: the decode role's.
        roles: PD: the prefill and the decode role, each judged (`RolePlan`); else empty.
    """

    layout: Layout | PDLayout
    reasons: tuple[str, ...] = ()
    memory: Memory | None = None
    estimate: Estimate | None = None
    cost: float = math.inf
    split: PipelineSplit | None = None
    roles: tuple[RolePlan, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.reasons

    def sort_key(self) -> tuple[float, ...]:
        """Cost, then (PD) the lower TTFT, then fewer devices, smaller TP, smaller PP, no SP,
        no EP: the tie-break order. In PD a prefill layout faster than the decode role needs
        ties on throughput; it still serves each prompt sooner."""
        lay = self.layout
        ttft = self.estimate.ttft_s if self.roles and self.estimate is not None else 0.0
        return (self.cost, ttft, lay.num_devices, *lay.order_key)


def _twin_key(layout: Layout | PDLayout) -> tuple[object, int]:
    """What two layouts that differ only by SP share: their devices, groups and EP."""
    return layout.device_mapping, layout.ep


@attrs.frozen
class Plan:
    """The chosen layout, where each rank runs, and every candidate considered.

    Attributes:
        tp_notes: what a reader must know of the chosen TP groups: that they span nodes
            because nothing else fits, or that tp does not divide the heads (a pinned layout).
    """

    model: ModelSpec
    topology_name: str
    workload: Workload
    chosen: Evaluation
    device_ids: tuple[int, ...]        # rank -> global device index
    evaluations: tuple[Evaluation, ...]  # all candidates, best first
    excluded: tuple[ExcludedDevice, ...] = ()  # devices given no rank (unhealthy)
    tp_notes: tuple[str, ...] = ()

    @property
    def layout(self) -> Layout:
        """The chosen layout (``plan.layout.tp`` ...): what kthena_comm builds groups from. In
        PD mode one `Layout` standing for both roles (`PDLayout.as_layout`: the larger role's
        tp and pp, every instance as dp; exact when the roles have one size): a PD reader
        takes each role's from `prefill_layout` and `decode_layout`."""
        lay = self.chosen.layout
        return lay.as_layout() if isinstance(lay, PDLayout) else lay

    @property
    def pd_layout(self) -> PDLayout | None:
        """PD mode: both roles' layouts; None when colocated."""
        lay = self.chosen.layout
        return lay if isinstance(lay, PDLayout) else None

    @property
    def prefill_layout(self) -> Layout | None:
        """PD mode: one prefill instance's tp and pp, ``dp`` = prefill instances."""
        return self.pd_layout.prefill if self.pd_layout else None

    @property
    def decode_layout(self) -> Layout | None:
        """PD mode: one decode instance's tp and pp, ``dp`` = decode instances."""
        return self.pd_layout.decode if self.pd_layout else None

    @property
    def roles(self) -> tuple[RolePlan, ...]:
        """PD mode: the prefill and the decode role as judged (memory, split, seconds ...)."""
        return self.chosen.roles

    @property
    def world_size(self) -> int:
        return self.chosen.layout.num_devices

    @property
    def pipeline_split_points(self) -> tuple[int, ...] | None:
        """Where the chosen layout's stages 1.. start when they are not equal stages (moved by
        the planner, cut where pp does not divide the layers, or pinned by the config); None:
        equal stages (``--pp`` alone). PD: the decode role's (each role's own:
        ``RolePlan.split_points``)."""
        split = self.chosen.split
        return split.points if split is not None and split.is_uneven else None

    def tp_groups(self) -> list[list[int]]:
        """Ranks of each TP group (consecutive ranks), instance by instance."""
        return [list(range(i.first_rank + p * i.tp, i.first_rank + (p + 1) * i.tp))
                for i in self.chosen.layout.instances() for p in range(i.pp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks of each pipeline (one per instance and TP index), stage order."""
        return [[i.first_rank + p * i.tp + t for p in range(i.pp)]
                for i in self.chosen.layout.instances() for t in range(i.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard in each replica (PD: in each instance of a role)."""
        lay = self.chosen.layout
        if isinstance(lay, PDLayout):
            groups, start = [], 0
            for _, role in lay.roles:
                size = role.tp * role.pp
                groups += [[start + d * size + r for d in range(role.dp)] for r in range(size)]
                start += role.num_devices
            return groups
        tp, pp, dp = lay.device_mapping
        return [[(d * pp + p) * tp + t for d in range(dp)] for p in range(pp) for t in range(tp)]

    def ep_groups(self) -> list[list[int]]:
        """Ranks sharing one copy of the routed experts (an EP group's instances, rank by rank:
        the same TP index and stage); each its own group when ep = 1."""
        lay = self.chosen.layout
        if isinstance(lay, PDLayout):
            return [[r] for r in range(self.world_size)]
        tp, pp, dp = lay.device_mapping
        ep = lay.ep
        return [[((g * ep + e) * pp + p) * tp + t for e in range(ep)]
                for g in range(dp // ep) for p in range(pp) for t in range(tp)]

    def role_notes(self) -> tuple[str, ...]:
        """PD: one line per role on why it got its layout: what bounds it (compute or
        bandwidth), its figures, which role sets the deployment's rate, and the best rival
        that differs in this role only. Empty when colocated."""
        return tuple(_role_note(self, role) for role in self.roles)

    def rivals(self) -> list[Evaluation]:
        """The other candidates, best first, one per device mapping and EP.

        Two layouts with the same tp, pp, dp and ep put the same ranks on the same devices in
        the same groups; SP only changes how activations are split inside a TP group. Such
        twins are one plan to a reader, so only the best-ranked of each is kept, and none with
        the chosen layout's mapping (which would otherwise come back as "the same, with SP").
        """
        seen = {_twin_key(self.chosen.layout)}
        rivals = []
        for e in self.evaluations:
            if _twin_key(e.layout) not in seen:
                seen.add(_twin_key(e.layout))
                rivals.append(e)
        return rivals

    def sp_note(self) -> str | None:
        """Why the chosen layout runs with or without sequence parallelism: its SP twin (same
        devices and groups, the other sp) compared on cost, TTFT and activation memory; None
        when the chosen layout has no twin (tp = 1, or SP not weighed)."""
        lay = self.chosen.layout
        twin = next((e for e in self.evaluations if _twin_key(e.layout) == _twin_key(lay)
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

    def expert_note(self) -> str | None:
        """Where a MoE model's routed experts live under the chosen layout (None: dense; PD:
        the decode role's instances)."""
        model, lay = self.model, self.chosen.layout
        if not model.is_moe:
            return None
        if isinstance(lay, PDLayout):
            lay = lay.decode
        per_param = model.weight_bytes(self.workload.dtype) / model.num_params()
        held = model.routed_params() * per_param / (lay.tp * lay.pp * lay.ep)
        experts, top_k, layers = model.num_experts, model.num_experts_per_tok, model.num_moe_layers
        share = (f"{human_bytes(held)} of routed experts per device"
                 + (f", {lay.pp} stages" if lay.pp > 1 else ""))
        if lay.ep == 1:
            return (f"no EP: every instance holds all {experts} routed experts of each of the "
                    f"{layers} MoE layers, TP{lay.tp}-sharded ({share}); a token runs {top_k}")
        return (f"EP{lay.ep}: each group of {lay.ep} instances shares one copy of the routed "
                f"experts: an instance holds {experts // lay.ep} of the {experts} of each of the "
                f"{layers} MoE layers, TP{lay.tp}-sharded ({share}); a token's hidden state goes "
                f"to the instances of its {top_k} experts and back (all-to-all)")

    def runner_ups(self, k: int = 5) -> list[tuple[Evaluation, str]]:
        """The next `k` rivals with one line each on why they lost to the chosen one."""
        return [(e, why_lost(e, self.chosen, self.workload)) for e in self.rivals()[:k]]

    def to_dict(self, num_candidates: int = 10) -> dict[str, Any]:
        return {
            "model": _model_dict(self.model, self.workload),
            "topology": self.topology_name,
            "workload": self.workload.to_dict(),
            "layout": attrs.asdict(self.layout),
            "pd": self._pd_dict(),
            "world_size": self.world_size,
            "device_ids": list(self.device_ids),
            "excluded_devices": [x.to_dict() for x in self.excluded],
            "memory_per_device": _memory_dict(self.chosen.memory),
            "estimate": attrs.asdict(self.chosen.estimate) if self.chosen.estimate else None,
            "pipeline_split": (self.chosen.split.to_dict(self.model.shape.num_layers)
                               if self.chosen.split else None),
            "candidates": [
                {"layout": _layout_dict(e.layout), "feasible": e.feasible, "cost": _finite(e.cost),
                 "estimate": attrs.asdict(e.estimate) if e.estimate else None,
                 "why_lost": why_lost(e, self.chosen, self.workload)}
                for e in self.rivals()[:num_candidates]
            ],
            "num_candidates_considered": len(self.evaluations),
            "sequence_parallel": self.sp_note(),
            "experts": self.expert_note(),
            "tp_notes": list(self.tp_notes),
        }


    def _pd_dict(self) -> dict[str, Any] | None:
        """PD: each role's layout, devices, memory, split, figures and reason line."""
        if not self.roles:
            return None
        layers = self.model.shape.num_layers
        return {role.name: {**role.to_dict(layers),
                            "device_ids": [self.device_ids[r] for r in role.ranks()],
                            "reason": note}
                for role, note in zip(self.roles, self.role_notes(), strict=True)}


def _layout_dict(layout: Layout | PDLayout) -> dict[str, Any]:
    """A layout's sizes by name; a PD one's per role (``dp`` its instances)."""
    if isinstance(layout, PDLayout):
        return {role: attrs.asdict(lay) for role, lay in layout.roles}
    return attrs.asdict(layout)


def _ranges_text(ids: list[int]) -> str:
    """``0-3`` for a run of consecutive device ids, else them all."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ", ".join(map(str, ids))


def _role_note(plan: Plan, role: RolePlan) -> str:
    """One role's line (`Plan.role_notes`)."""
    wl, est = plan.workload, plan.chosen.estimate
    assert est is not None
    other = next(r for r in plan.roles if r is not role)
    lay = role.layout
    devices = _ranges_text([plan.device_ids[r] for r in role.ranks()])
    work = ("a prompt" if role.name == "prefill" else "a decode step")
    bound = (f"{role.bound} ({work}: {role.compute_s * 1e3:.1f} ms of FLOPs vs "
             f"{role.memory_s * 1e3:.1f} ms of memory reads per device)")
    if role.name == "prefill":
        figures = (f"a {wl.prompt_len}-token prompt alone in {role.seconds * 1e3:.1f} ms, "
                   f"{role.rate:.2f} prompts/s")
    else:
        figures = (f"TPOT {role.seconds * 1e3:.2f} ms for {role.max_num_seqs} sequences an "
                   f"instance, {role.rate:.2f} requests/s")
    pace = ("sets the deployment's rate" if role.rate <= other.rate else
            f"{role.rate / other.rate:.2f}x the {other.rate:.2f}/s the {other.name} role serves")
    return (f"{lay.dp} x {PDLayout.role_label(lay)} on device(s) {devices}: {bound}; {figures}, "
            f"{pace}; {_role_rival(plan, role, other)}")


def _role_rival(plan: Plan, role: RolePlan, other: RolePlan) -> str:
    """How the best candidate that differs in this role only (the other role as chosen) lost."""
    def same_other(e: Evaluation) -> bool:
        assert isinstance(e.layout, PDLayout)
        mine, theirs = dict(e.layout.roles)[role.name], dict(e.layout.roles)[other.name]
        return theirs == other.layout and mine != role.layout

    rival = next((e for e in plan.evaluations if same_other(e)), None)
    if rival is None:
        return f"no other {role.name} layout was judged beside this {other.name} role"
    lay = dict(rival.layout.roles)[role.name]  # type: ignore[union-attr]
    return (f"beats {lay.dp} x {PDLayout.role_label(lay)} beside it: "
            f"{why_lost(rival, plan.chosen, plan.workload)}")


def _model_dict(model: ModelSpec, wl: Workload) -> dict[str, Any]:
    """The model's figures the text report prints, plus the sizes they come from."""
    per_param = model.weight_bytes(wl.dtype) / model.num_params()
    return {
        "name": model.name, "architecture": model.architecture,
        "num_params": model.num_params(), "num_active_params": model.num_params(active=True),
        "num_layers": model.shape.num_layers, "hidden_size": model.shape.hidden_size,
        "num_attention_heads": model.shape.num_attention_heads,
        "num_key_value_heads": model.shape.num_kv_heads, "head_dim": model.shape.head_dim,
        "vocab_size": model.shape.vocab_size,
        "num_experts": model.num_experts, "num_experts_per_tok": model.num_experts_per_tok,
        "num_moe_layers": model.num_moe_layers,
        "routed_expert_bytes": model.routed_params() * per_param,
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
            if e.roles and not math.isclose(a.ttft_s, b.ttft_s, rel_tol=1e-9):
                return (f"ties on throughput ({a.throughput_tok_s:.1f} tok/s: the slower role "
                        f"sets it); TTFT {a.ttft_s * 1e3:.1f} vs {b.ttft_s * 1e3:.1f} ms")
            return "ties on throughput; loses the tie-break (more devices, larger tp/pp, sp or ep)"
        head = f"throughput {a.throughput_tok_s:.1f} vs {b.throughput_tok_s:.1f} tok/s"
    else:
        head = f"latency {e.cost * 1e3:.1f} vs {best.cost * 1e3:.1f} ms"
    detail = [f"TPOT {a.tpot_s * 1e3:.2f} ms", f"TTFT {a.ttft_s * 1e3:.1f} ms"]
    if a.comm_fraction > 0.05:
        detail.append(f"comm {a.comm_fraction:.0%} of step")
    if a.bubble_fraction > 0.05:
        detail.append(f"pipeline bubble {a.bubble_fraction:.0%}")
    return f"{head} ({', '.join(detail)})"
