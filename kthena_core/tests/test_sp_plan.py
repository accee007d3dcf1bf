"""Sequence parallelism in the config and its plan: the YAML's ``sequence_parallel_enabled`` /
``sequence_parallel_group_size`` are honoured (a pinned plan carries sp = tp; auto may weigh
sp = tp at pp = 1). Rendering SP plans is in test_deploy_k8s.py, refusals in
test_config_keys.py."""

from __future__ import annotations

import pytest

from kthena_core.config import load_config
from kthena_core.config_plan import plan_config, resolve_topology
from kthena_core.layout import Layout

TP2_SP2 = {"parallelism": {"strategy": "tp", "tensor_parallel_size": 2,
                           "sequence_parallel_enabled": True,
                           "sequence_parallel_group_size": 2},
           "cluster": {"world_size": 2}}


def test_a_pinned_sp_config_plans_sp_over_the_tp_group():
    plan = plan_config(load_config(TP2_SP2), resolve_topology("auto:cores", measure=False))
    assert plan.layout == Layout(2, 1, 1, 2)


def test_without_the_key_no_layout_has_sp():
    config = load_config({"parallelism": {"strategy": "auto"}})
    plan = plan_config(config, resolve_topology("auto:cores", measure=False))
    assert all(c.layout.sp == 1 for c in plan.evaluations)


def test_with_the_key_auto_weighs_sp_only_where_pp_is_1():
    # 8 devices: SmolLM2's 9 heads give the planner tp 1 and 3 (tp must divide the heads)
    config = load_config({"parallelism": {"strategy": "auto", "sequence_parallel_enabled": True}})
    plan = plan_config(config, resolve_topology("atlas-800t-a2"))
    with_sp = [c.layout for c in plan.evaluations if c.layout.sp > 1]
    assert with_sp and all(lay.pp == 1 and lay.sp == lay.tp == 3 for lay in with_sp)


def _tp2_on_cores(factor: float, prompt_len: int = 8192):
    from kthena_core.cost_model import CostParams
    from kthena_core.known_models import load_model_spec
    from kthena_core.planner import Planner
    from kthena_core.workload import Workload

    model, cores = load_model_spec("default"), resolve_topology("auto:cores", measure=False)
    wl = Workload(prompt_len, 1, 1, objective="latency")
    planner = Planner(CostParams(sp_collective_factor=factor))
    return [planner.evaluate(model, cores, wl, Layout(2, sp=sp)) for sp in (1, 2)]


def test_on_a_ring_sp_collectives_cost_what_the_all_reduce_did():
    from kthena_core.cost_model import (
        all_gather_time,
        allreduce_time,
        reduce_scatter_time,
    )

    for n, nbytes, bw, lat in [(2, 9e6, 1e9, 1e-5), (4, 3e6, 2e10, 2e-6), (8, 1e8, 5e10, 0.0)]:
        pair = reduce_scatter_time(nbytes, n, bw, lat) + all_gather_time(nbytes, n, bw, lat)
        assert pair == pytest.approx(allreduce_time(nbytes, n, bw, lat), rel=1e-12)
    assert reduce_scatter_time(1e9, 1, 1.0, 1.0) == 0.0


def test_sp_wins_ttft_only_while_its_collectives_are_priced_as_a_ring():
    """Factor 1 (a ring): SP saves the norms' share of the tokens at equal collectives; the
    factor gloo measures (> 1.5, docs/bench_layouts.md) makes its collectives cost more than
    that saving. Activations per device shrink either way."""
    ring_tp, ring_sp = _tp2_on_cores(1.0)
    gloo_tp, gloo_sp = _tp2_on_cores(1.65)
    assert ring_sp.estimate.ttft_s < ring_tp.estimate.ttft_s
    assert gloo_sp.estimate.ttft_s > gloo_tp.estimate.ttft_s
    assert gloo_tp.estimate.ttft_s == pytest.approx(ring_tp.estimate.ttft_s)  # no SP: no factor
    assert ring_sp.memory.activations < ring_tp.memory.activations


@pytest.mark.parametrize(("factor", "chosen_sp", "verdict"), [(1.0, 2, "chosen"),
                                                                (1.65, 1, "not chosen")])
def test_the_plan_says_why_it_runs_with_or_without_sp(factor, chosen_sp, verdict):
    from kthena_core.cost_model import CostParams
    from kthena_core.known_models import load_model_spec
    from kthena_core.planner import Planner
    from kthena_core.report import format_plan
    from kthena_core.workload import Workload

    class Tp2(Planner):
        def layouts(self, model, topology, workload):  # noqa: ANN001, ANN202
            yield from (Layout(2), Layout(2, sp=2))

    plan = Tp2(CostParams(sp_collective_factor=factor)).plan(
        load_model_spec("default"), resolve_topology("auto:cores", measure=False),
        Workload(8192, 1, 1, objective="latency"))
    assert plan.layout.sp == chosen_sp
    note = plan.sp_note()
    assert note.startswith(f"SP2 {verdict}: predicted TTFT ")
    assert f"sp        {note}" in format_plan(plan)
    assert plan.to_dict()["sequence_parallel"] == note


def test_a_plan_without_an_sp_twin_has_no_note():
    plan = plan_config(load_config(TP2_SP2), resolve_topology("auto:cores", measure=False))
    assert plan.sp_note() is None


@pytest.mark.parametrize(("flags", "sp", "verdict"), [
    ([], 8, "SP8 chosen"),  # a ring: the collectives cost what the all-reduce did
    (["--sp-collective-factor", "2"], 1, "SP8 not chosen"),
])
def test_kthena_plan_sp_weighs_sp_and_says_why(capsys, flags, sp, verdict):
    import json

    from kthena_core.cli import main

    code = main(["plan", "--model", "llama-2-70b", "--topology", "atlas-800t-a2",
                 "--calibration", "none", "--json", "--sp", *flags])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (out["layout"]["tp"], out["layout"]["sp"]) == (8, sp)
    assert out["sequence_parallel"].startswith(verdict)


def test_kthena_plan_without_sp_weighs_no_sp_layout(capsys):
    import json

    from kthena_core.cli import main

    assert main(["plan", "--model", "llama-2-70b", "--topology", "atlas-800t-a2",
                 "--calibration", "none", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["sp"] == 1 and out["sequence_parallel"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--sp", "--sp-collective-factor", "0"], "--sp-collective-factor must be > 0"),
    (["--config", "docs/examples/cpu-smollm2.yaml", "--sp"], "drop --sp"),
])
def test_kthena_plan_refuses_bad_sp_flags(capsys, argv, message):
    from kthena_core.cli import main

    assert main(["plan", "--topology", "atlas-800t-a2", "--calibration", "none", *argv]
                if "--config" not in argv else ["plan", *argv]) == 2
    assert message in capsys.readouterr().err
