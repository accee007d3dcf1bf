"""PD roles: the candidates a disaggregated plan weighs, the sizes a user may pin per role, and
one role of a plan as judged (`RolePlan`).

A PD deployment has two kinds of instance, each its own engine: prefill instances (compute-bound:
a prompt's FLOPs set TTFT) and decode instances (bandwidth-bound: every step reads the weights
and the KV, which sets TPOT). So each role gets its own size, a `Layout` whose ``dp`` is the
role's instance count, and the two together are a `PDLayout`. `pd_layouts` enumerates every
such pair on ``n`` devices::

    for prefill (tp, pp) x count, decode (tp, pp) x count:
        tp dividing the heads (the planner's rule), pp <= layers, both roles' devices <= n

A config or deploy.yaml may pin any of a role's ``tp``, ``pp`` and ``count`` (`PDRoles`, the
YAML's ``pd: {prefill: {tp: 4, count: 1}, decode: {tp: 4}}``); the planner then weighs only
the candidates that match, and chooses the rest. A pinned tp may split the heads unevenly where
the engine runs that (SmolLM2's 3 KV heads over tp=2; the plan's ``tp`` line says so), as a
pinned colocated tp may. `role_refusals` names a pinned size the model cannot take (a tp its
heads cannot be split over, a pp above its layers), before anything is planned or started.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from kthena_core.cost_model import Memory
from kthena_core.layout import Layout, PDLayout
from kthena_core.model_spec import ModelSpec
from kthena_core.pipeline_split import PipelineSplit

__all__ = ["PD_ROLES", "PDRoles", "RolePin", "RolePlan", "pd_layouts", "pd_splits",
           "role_refusals"]

PD_ROLES = ("prefill", "decode")
ROLE_KEYS = ("tp", "pp", "count")


@attrs.frozen
class RolePin:
    """One role's sizes as a user pinned them; None: the planner chooses.

    Attributes:
        tp: tensor-parallel ranks of each instance of the role.
        pp: pipeline stages of each instance.
        count: instances of the role.
    """

    tp: int | None = None
    pp: int | None = None
    count: int | None = None

    def matches(self, layout: Layout) -> bool:
        """Whether `layout` (dp = instances) has every size this pin names."""
        return all(want is None or want == have for want, have in
                   ((self.tp, layout.tp), (self.pp, layout.pp), (self.count, layout.dp)))

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.tp, self.pp, self.count))


@attrs.frozen
class PDRoles:
    """The ``pd`` section of a config or deploy.yaml: what is pinned of each role."""

    prefill: RolePin = RolePin()
    decode: RolePin = RolePin()

    def matches(self, layout: PDLayout) -> bool:
        return self.prefill.matches(layout.prefill) and self.decode.matches(layout.decode)

    @property
    def is_set(self) -> bool:
        return self.prefill.is_set or self.decode.is_set

    def pin(self, role: str) -> RolePin:
        return self.prefill if role == "prefill" else self.decode

    def to_dict(self) -> dict[str, dict[str, int]]:
        """The pinned sizes only (``{"prefill": {"tp": 4}}``)."""
        return {role: {k: v for k, v in attrs.asdict(self.pin(role)).items() if v is not None}
                for role in PD_ROLES if self.pin(role).is_set}


def role_refusals(model: ModelSpec, roles: PDRoles, prefix: str = "pd") -> list[str]:
    """Why a pinned size cannot run `model`, one line per key (``pd.prefill.tp: got 5;
    allowed: ...``): a tp the heads cannot be split over (the engine's rule,
    `ModelSpec.check_tp`), a pp above the layers. Empty when every pin can run."""
    out = []
    allowed_tp = model.allowed_tp_sizes()
    shape = model.shape
    for role in PD_ROLES:
        pin = roles.pin(role)
        if pin.tp is not None and pin.tp not in allowed_tp:
            out.append(f"{prefix}.{role}.tp: got {pin.tp}; allowed: one of "
                       f"{', '.join(map(str, allowed_tp))} ({model.name} has "
                       f"{shape.num_attention_heads} attention heads, {shape.num_kv_heads} KV "
                       "heads: each rank holds whole heads)")
        if pin.pp is not None and pin.pp > shape.num_layers:
            out.append(f"{prefix}.{role}.pp: got {pin.pp}; allowed: at most {model.name}'s "
                       f"{shape.num_layers} layers (one per stage at least)")
    return out


def _role_sizes(model: ModelSpec, n: int, tp_sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(tp, pp) of one instance that leaves a device for the other role: tp one of
    `tp_sizes`, pp up to the layers."""
    return [(tp, pp) for tp in tp_sizes if tp < n
            for pp in range(1, min((n - 1) // tp, model.shape.num_layers) + 1)]


def pd_layouts(model: ModelSpec, n: int,
               tp_sizes: tuple[int, ...] | None = None) -> Iterator[PDLayout]:
    """Every prefill (tp, pp) x count + decode (tp, pp) x count on at most `n` devices, each
    role at least one instance, tp one of `tp_sizes` (default: those dividing the heads, the
    planner's rule): the PD candidates."""
    sizes = _role_sizes(model, n, tp_sizes or model.tp_sizes_dividing_heads())
    for tp_p, pp_p in sizes:
        for n_p in range(1, (n - 1) // (tp_p * pp_p) + 1):
            left = n - n_p * tp_p * pp_p
            for tp_d, pp_d in sizes:
                for n_d in range(1, left // (tp_d * pp_d) + 1):
                    yield PDLayout(Layout(tp_p, pp_p, n_p), Layout(tp_d, pp_d, n_d))


def pd_splits(layout: Layout) -> Iterator[PDLayout]:
    """Every split of `layout`'s ``dp`` instances into prefill + decode ones, each role
    keeping the layout's tp and pp: what a config that pins one layout in PD mode weighs."""
    for n_p in range(1, layout.dp):
        yield PDLayout(Layout(layout.tp, layout.pp, n_p),
                       Layout(layout.tp, layout.pp, layout.dp - n_p))


@attrs.frozen
class RolePlan:
    """One role of a PD candidate, judged.

    Attributes:
        name: ``"prefill"`` or ``"decode"``.
        layout: one instance's tp and pp, ``dp`` = the role's instances.
        first_rank: the rank its first instance starts at (prefill 0, decode after prefill).
        memory: per device of one instance.
        split: pp > 1: the stages' split (prefill: by its prompt's work; decode: by a step's).
        seconds: prefill: one prompt's time to first token alone on an instance; decode: one
            step of its batch (TPOT).
        rate: requests per second the role completes: prefill instances / seconds between
            the prompts an instance finishes (a pipelined one holds a prompt per stage,
            finishing one per slowest stage); decode: the running sequences / (step x output
            tokens), every sequence advancing at the fullest instance's step.
        max_num_seqs: sequences one instance is sized for (prefill: prompts it holds; decode:
            its share of the running sequences).
        compute_s, memory_s: the roofline's two sides of one instance's work (a prompt, a
            decode step): FLOPs over the device's rate and bytes read over its bandwidth.
        comm_fraction, bubble_fraction: decode: a step's share in collectives and idle stages.
    """

    name: str
    layout: Layout
    first_rank: int
    memory: Memory
    split: PipelineSplit | None
    seconds: float
    rate: float
    max_num_seqs: int
    compute_s: float
    memory_s: float
    comm_fraction: float = 0.0
    bubble_fraction: float = 0.0

    @property
    def bound(self) -> str:
        """``compute-bound`` or ``bandwidth-bound``: the larger side of the roofline."""
        return "compute-bound" if self.compute_s >= self.memory_s else "bandwidth-bound"

    @property
    def split_points(self) -> tuple[int, ...] | None:
        """Where stages 1.. start when not equal stages (the engine's
        ``pipeline_split_points``); None: equal stages or pp 1."""
        return self.split.points if self.split is not None and self.split.is_uneven else None

    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.layout.num_devices)

    def to_dict(self, num_layers: int) -> dict[str, Any]:
        mem = self.memory
        return {"tp": self.layout.tp, "pp": self.layout.pp, "count": self.layout.dp,
                "first_rank": self.first_rank,
                "pipeline_split_points": (list(self.split_points)
                                          if self.split_points is not None else None),
                "pipeline_split": self.split.to_dict(num_layers) if self.split else None,
                "memory_per_device": {"weights": mem.weights, "kv_cache": mem.kv_cache,
                                      "activations": mem.activations, "reserve": mem.reserve,
                                      "total": mem.total, "capacity": mem.capacity},
                "max_num_seqs": self.max_num_seqs, "seconds": self.seconds,
                "rate_per_s": self.rate, "bound": self.bound}
