"""PD planned per role: a `PDLayout` judged, each role priced on the devices it gets.

Prefill is compute-bound, decode bandwidth-bound, so each role is priced on its own (the
roofline of `cost_model`, its collectives over its own TP group's links)::

    prefill instance   TTFT  = one prompt alone (prefill_time); a pipelined instance holds a
                       prompt per stage, so it finishes one every `slowest stage` seconds
    decode instance    TPOT  = one step of its batch, ceil(concurrency / decode instances)
    rate               prefill: instances / seconds between prompts; decode: instances x
                       batch / (TPOT x output tokens); the deployment serves the smaller
    TTFT               prefill's + the KV hand-off (`cost_model.kv_handoff_time`, re-sharded
                       between the roles' TP sizes)

Ranks are laid prefill instances first, then decode instances, onto the devices in the
planner's order (link domain by link domain), so on one 8-device node ``prefill 1 x TP4 +
decode 1 x TP4`` puts prefill on devices 0-3 and decode on 4-7. Memory is per role: a decode
instance holds its share of the running sequences at full context, a prefill instance the
prompts of its share of them (the prefix cache the router's KV-aware pick counts on).

`PDJudge` remembers what many candidates share (a role's layout and count priced on the same
links), so a plan over many devices stays fast.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from kthena_core.cost_model import (
    CostParams,
    DeviceFigures,
    Estimate,
    Links,
    StagePricer,
    decode_step,
    decode_work,
    kv_handoff_time,
    memory,
    objective_cost,
    prefill_parts,
    prefill_work,
    slo_reasons,
)
from kthena_core.layout import Layout, PDLayout
from kthena_core.model_spec import ModelSpec, human_bytes
from kthena_core.pd_roles import RolePlan
from kthena_core.pipeline_split import PipelineSplit, pinned_split, propose_split
from kthena_core.plan import Evaluation
from kthena_core.shape import HeadSplitError, LayerSplitError, check_num_stages
from kthena_core.workload import Workload

if TYPE_CHECKING:
    from kthena_core._plan_topology import _TopologyView

__all__ = ["PDJudge", "decode_split"]


class PDJudge:
    """Judges PD candidates of one model and workload on one topology view."""

    def __init__(self, model: ModelSpec, workload: Workload, ctx: _TopologyView,
                 params: CostParams) -> None:
        self.model, self.wl, self.ctx, self.params = model, workload, ctx, params
        self.dev: DeviceFigures = ctx.figures
        self._prefill: dict[Layout, RolePlan] = {}
        self._decode: dict[tuple[Layout, Links], RolePlan] = {}
        self._placed: dict[tuple[Layout, int], RolePlan] = {}
        self._structure: dict[tuple[str, int, int], tuple[str, ...]] = {}

    def evaluate(self, layout: PDLayout) -> Evaluation:
        """Structure, each role's memory, then the deployment's estimate and cost."""
        reasons = self.structural_reasons(layout)
        if reasons:
            return Evaluation(layout, tuple(reasons))
        prefill = self.prefill_role(layout.prefill)
        decode = self.decode_role(layout.decode, layout.prefill.num_devices)
        roles = (prefill, decode)
        loaded = max(roles, key=lambda r: r.memory.total)
        short = tuple(_short_of_memory(r) for r in roles if not r.memory.fits)
        if short:
            return Evaluation(layout, short, loaded.memory, split=decode.split, roles=roles)
        est = self._estimate(layout, prefill, decode)
        missed = slo_reasons(self.wl, est)
        cost = math.inf if missed else objective_cost(self.wl, est)
        return Evaluation(layout, tuple(missed), loaded.memory, est, cost, decode.split, roles)

    def structural_reasons(self, layout: PDLayout) -> list[str]:
        """Why a role's layout cannot shard the model (its heads over tp, its layers over
        pp), each line naming the role."""
        return [line for role, lay in layout.roles
                for line in self._role_structure(role, lay.tp, lay.pp)]

    def _role_structure(self, role: str, tp: int, pp: int) -> tuple[str, ...]:
        key = (role, tp, pp)
        if key not in self._structure:
            reasons = []
            try:
                self.model.check_tp(tp)
            except HeadSplitError as e:
                reasons.append(f"{role}: {e}")
            try:
                check_num_stages(self.model.shape.num_layers, pp)
            except LayerSplitError as e:
                reasons.append(f"{role}: {e}")
            self._structure[key] = tuple(reasons)
        return self._structure[key]

    # ---- the roles ---------------------------------------------------------------------------
    def prefill_role(self, lay: Layout) -> RolePlan:
        """The prefill role: its instances from rank 0 on, each priced on a prompt alone."""
        if lay not in self._prefill:
            self._prefill[lay] = self._price_prefill(lay)
        return self._prefill[lay]

    def _price_prefill(self, lay: Layout) -> RolePlan:
        model, wl, dev = self.model, self.wl, self.dev
        one = Layout(lay.tp, lay.pp)
        links = self.ctx.links(lay.tp, lay.pp, lay.dp)
        stage, hop = prefill_parts(model, wl, one, dev, links, self.params)
        ttft = lay.pp * stage + (lay.pp - 1) * hop
        split = None
        interval = ttft
        if lay.pp > 1:
            # a layer's share of a stage; the step overhead is paid once per stage
            per_layer = (stage - dev.step_overhead) * lay.pp / model.shape.num_layers
            split = propose_split(model.shape.num_layers, lay.pp,
                                  lambda r, _last: len(r) * per_layer + dev.step_overhead)
            interval = max(split.stage_seconds)
        seqs = math.ceil(wl.concurrency / lay.dp)
        points = split.points if split is not None and split.is_uneven else None
        mem = memory(model, wl, one, dev, self.params, seqs, points, tokens_per_seq=wl.prompt_len)
        flops, nbytes = prefill_work(model, wl, one)
        return RolePlan("prefill", lay, 0, mem, split, ttft, lay.dp / interval, seqs,
                        flops / dev.flops, nbytes / dev.memory_bw)

    def decode_role(self, lay: Layout, first_rank: int) -> RolePlan:
        """The decode role: its instances from `first_rank` on, each running its share of
        the sequences."""
        placed = (lay, first_rank)
        if placed not in self._placed:
            # the hop to another role is the hand-off's (priced apart): placements that
            # differ only there price the same
            links = attrs.evolve(self.ctx.links(lay.tp, lay.pp, lay.dp, 1, first_rank),
                                 pd_bw=math.inf)
            if (lay, links) not in self._decode:
                self._decode[(lay, links)] = self._price_decode(lay, links)
            self._placed[placed] = attrs.evolve(self._decode[(lay, links)],
                                                first_rank=first_rank)
        return self._placed[placed]

    def _price_decode(self, lay: Layout, links: Links) -> RolePlan:
        model, wl, dev = self.model, self.wl, self.dev
        one = Layout(lay.tp, lay.pp)
        batch = math.ceil(wl.concurrency / lay.dp)
        split = decode_split(model, wl, one, dev, links, batch)
        points = split.points if split is not None and split.is_uneven else None
        step, comm, bubble = decode_step(model, wl, one, dev, links, batch, points)
        mem = memory(model, wl, one, dev, self.params, batch, points)
        flops, nbytes = decode_work(model, wl, one, batch, points)
        # every running sequence advances at the pace of the fullest instance's step
        rate = wl.concurrency / (step * wl.output_len)
        return RolePlan("decode", lay, 0, mem, split, step, rate, batch, flops / dev.flops,
                        nbytes / dev.memory_bw, comm, bubble)

    # ---- the deployment ----------------------------------------------------------------------
    def _estimate(self, layout: PDLayout, prefill: RolePlan, decode: RolePlan) -> Estimate:
        """The deployment serves the slower role's rate; a prompt waits for its prefill and
        the KV hand-off to the farthest decode instance."""
        order, dec = self.ctx.order, layout.decode
        last_decode = order[decode.first_rank + (dec.dp - 1) * dec.tp * dec.pp]
        bw = self.ctx.bandwidth(order[0], last_decode) * self.ctx.eff
        transfer = kv_handoff_time(self.model, self.wl, layout.prefill, dec, bw)
        rate = min(prefill.rate, decode.rate)
        return Estimate(prefill.seconds + transfer, decode.seconds, rate * self.wl.output_len,
                        decode.comm_fraction, decode.bubble_fraction, transfer,
                        layout.prefill.dp, dec.dp)


def _short_of_memory(role: RolePlan) -> str:
    mem = role.memory
    return (f"{role.name}: needs {human_bytes(mem.total)} per device > "
            f"{human_bytes(mem.capacity)} usable (weights {human_bytes(mem.weights)}, "
            f"KV {human_bytes(mem.kv_cache)})")


def decode_split(model: ModelSpec, wl: Workload, layout: Layout, dev: DeviceFigures,
                 links: Links, batch: int,
                 points: tuple[int, ...] | None = None) -> PipelineSplit | None:
    """The stages' split of a decode engine (pp > 1), priced at its batch: equal, or moved
    where the last stage (with the LM head) is slower (`pipeline_split.propose_split`)."""
    if layout.pp == 1:
        return None
    pricer = StagePricer(model, wl, layout, dev, links, batch)
    if points is not None:
        return pinned_split(model.shape.num_layers, layout.pp, points, pricer.time)
    return propose_split(model.shape.num_layers, layout.pp, pricer.time)
