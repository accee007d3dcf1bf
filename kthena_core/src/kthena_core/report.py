"""Human-readable rendering of a Plan: the choice, memory per device, predictions, rivals."""

from __future__ import annotations

import math

from kthena_core.calibrate import Calibration
from kthena_core.cost_model import Memory
from kthena_core.model_spec import human_bytes
from kthena_core.planner import Evaluation, Plan
from kthena_core.topology import Topology


def format_plan(plan: Plan, num_candidates: int = 8, prediction_note: str | None = None) -> str:
    """Multi-line explanation of `plan` for a terminal; ``prediction_note`` (e.g. that the
    factors are uncalibrated, `PlanFactors.prediction_note`) goes under the predictions."""
    wl, best = plan.workload, plan.chosen
    est = best.estimate
    assert best.memory is not None and est is not None
    lines = [
        f"model     {plan.model.name}: {_params_text(plan)}, "
        f"{plan.model.shape.num_layers} layers, {plan.model.shape.num_attention_heads} heads / "
        f"{plan.model.shape.num_kv_heads} KV heads, "
        f"KV {human_bytes(plan.model.kv_bytes_per_token(wl.kv_dtype))}/token ({wl.kv_dtype})",
        f"topology  {plan.topology_name}",
        f"workload  prompt {wl.prompt_len}, output {wl.output_len}, concurrency {wl.concurrency}, "
        f"{wl.dtype}, mode {wl.mode}, objective {wl.objective}",
        "",
        f"plan      {best.layout.label} on {plan.world_size} device(s): {list(plan.device_ids)}",
    ]
    lines += [f"{role.name:<9} {note}" for role, note in zip(plan.roles, plan.role_notes(),
                                                              strict=True)]
    lines += [f"tp        {note}" for note in plan.tp_notes]
    if (experts := plan.expert_note()) is not None:
        lines.append(f"experts   {experts}")
    if best.split is not None and not plan.roles:
        lines.append(f"pipeline  {best.split.reason(plan.model.shape.num_layers)}")
    lines += [f"pipeline  {role.name}: {role.split.reason(plan.model.shape.num_layers)}"
              for role in plan.roles if role.split is not None]
    if (sp := plan.sp_note()) is not None:
        lines.append(f"sp        {sp}")
    if plan.excluded:
        lines.append(f"excluded  {len(plan.excluded)} device(s) given no rank: "
                     + ", ".join(f"{x.device_id} ({x.reason})" for x in plan.excluded))
    if wl.mode == "pd":
        lines.append(f"          PD split: {est.prefill_replicas} prefill + {est.decode_replicas} decode instance(s), "
                     f"KV handoff {est.kv_transfer_s * 1e3:.2f} ms")
    lines += _memory_lines(plan)
    lines += [
        f"predicted TTFT {est.ttft_s * 1e3:.1f} ms, TPOT {est.tpot_s * 1e3:.2f} ms, "
        f"throughput {est.throughput_tok_s:.1f} tok/s, comm {est.comm_fraction:.0%} of a decode step, "
        f"pipeline bubble {est.bubble_fraction:.0%}",
        *([f"          {prediction_note}"] if prediction_note else []),
        "",
    ]
    return "\n".join(lines + _rivals_table(plan, num_candidates))


def _memory_lines(plan: Plan) -> list[str]:
    """``memory    per device: ...``; PD: a line per role."""
    assert plan.chosen.memory is not None
    if not plan.roles:
        return [f"memory    per device: {_memory_text(plan.chosen.memory)}"]
    return [f"{'memory' if i == 0 else '':<9} {role.name} per device: {_memory_text(role.memory)}"
            for i, role in enumerate(plan.roles)]


def _memory_text(mem: Memory) -> str:
    if not math.isfinite(mem.capacity):
        return f"{human_bytes(mem.total)} (host memory: no device limit)"
    return (f"weights {human_bytes(mem.weights)} + KV {human_bytes(mem.kv_cache)} + activations "
            f"{human_bytes(mem.activations)} + reserve {human_bytes(mem.reserve)} = "
            f"{human_bytes(mem.total)} of {human_bytes(mem.capacity)} usable")


def _rivals_table(plan: Plan, num_candidates: int) -> list[str]:
    """The runner-ups, one row each, the layout column as wide as the longest label."""
    ups = plan.runner_ups(num_candidates)
    considered = len(plan.evaluations)
    if not ups:  # no empty table: say why there is no row
        why = ("the chosen layout is the only one" if not plan.rivals() else
               f"{len(plan.rivals())} hidden, --candidates {num_candidates}")
        return [f"runner-ups none ({considered} layout(s) considered: {why})"]
    width = max([22, *(len(e.layout.label) for e, _ in ups)])
    return [f"runner-up candidates ({considered} considered):",
            f"  {'layout':<{width}} {'dev':>4} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>10}  why it lost",
            *(_row(e, why, width) for e, why in ups)]


def _params_text(plan: Plan) -> str:
    """``70.0 B params``; a MoE model adds its active parameters and its experts' share."""
    model = plan.model
    text = f"{model.num_params() / 1e9:.2f} B params"
    if not model.is_moe:
        return text
    return (f"{text} ({model.num_params(active=True) / 1e9:.2f} B active per token; "
            f"{model.num_experts} routed experts, top-{model.num_experts_per_tok}, in "
            f"{model.num_moe_layers} layers: {model.routed_params() / 1e9:.2f} B)")


def _row(e: Evaluation, why: str, width: int = 22) -> str:
    est = e.estimate
    if est is None:
        nums = f"{'-':>9} {'-':>9} {'-':>10}"
    else:
        nums = f"{est.ttft_s * 1e3:>9.1f} {est.tpot_s * 1e3:>9.2f} {est.throughput_tok_s:>10.1f}"
    return f"  {e.layout.label:<{width}} {e.layout.num_devices:>4} {nums}  {why}"


def format_calibration(cal: Calibration) -> str:
    """The fitted factors and a predicted-vs-measured table, before and after calibration."""
    f = cal.params
    lines = [
        f"calibration from {cal.source}: compute_efficiency {f.compute_efficiency:.3g}, "
        f"memory_efficiency {f.memory_efficiency:.3g}, step_overhead {f.step_overhead_s * 1e3:.2f} ms"
        + (f", sp_collective_factor {f.sp_collective_factor:.3g} (the bench's collectives)"
           if f.sp_collective_factor != 1.0 else ""),
        f"  {'case':<26} {'quantity':<17} {'measured':>10} {'uncalibrated':>13} {'calibrated':>11}",
    ]
    for p, u, c in zip(cal.points, cal.uncalibrated, cal.calibrated, strict=True):
        lines.append(f"  {p.case:<26} {p.quantity:<17} {p.measured:>10.4g} {u:>7.4g} {u / p.measured - 1:>+5.0%} "
                     f"{c:>6.4g} {c / p.measured - 1:>+4.0%}")
    return "\n".join(lines)


def figures_dict(topology: Topology) -> dict[str, object]:
    """The device figures a plan on ``topology`` was scored with, and where they came from
    (a host probe's line says when it was measured and at what load)."""
    spec = topology.devices[0].spec
    return {"device": spec.name, "num_devices": topology.num_devices,
            "memory_bw": spec.memory_bw, "peak_flops": dict(spec.peak_flops),
            "source": spec.source}


def format_figures(topology: Topology) -> str:
    """``figures   per device ...`` for a terminal (`figures_dict`)."""
    import time

    from kthena_core.discovery.host_probe import age_text

    spec = topology.devices[0].spec
    peaks = ", ".join(f"{v / 1e9:.0f} GFLOP/s {k}" for k, v in sorted(spec.peak_flops.items()))
    measured = (topology.probe or {}).get("measured_at") or 0
    age = f" ({age_text(max(0.0, time.time() - measured))} ago)" if measured else ""
    return (f"figures   per device ({spec.name}, {topology.num_devices} device(s)): "
            f"{spec.memory_bw / 1e9:.1f} GB/s memory, {peaks}{age}\n"
            f"          from {spec.source or 'unknown'}")
