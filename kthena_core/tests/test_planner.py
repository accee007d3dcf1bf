"""Planner: brute-force properties on small spaces, and known answers."""

import itertools
import math
import time

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.hardware import cpu_host_spec, get_device
from kthena_core.known_models import load_model_spec
from kthena_core.layout import Layout
from kthena_core.model_spec import ModelSpec
from kthena_core.planner import NoFeasiblePlanError, Planner
from kthena_core.report import format_plan
from kthena_core.shape import ModelShape
from kthena_core.topology import Device, Topology, from_catalog
from kthena_core.workload import Workload

GiB = 1024**3


def small_topology(num_devices: int, device: str = "ascend-910b3", nodes: int = 1) -> Topology:
    spec = get_device(device)
    per = math.ceil(num_devices / nodes)
    devs = [Device(index=i, node=i // per, local_index=i % per, spec=spec) for i in range(num_devices)]
    return Topology(devices=tuple(devs), name=f"{num_devices}x{device}")


@st.composite
def models(draw):
    kv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([64, 128]))
    return ModelSpec(
        name="random", architecture="LlamaForCausalLM",
        shape=ModelShape(
            num_layers=draw(st.sampled_from([2, 3, 4, 6, 8, 12, 30])),
            hidden_size=heads * head_dim,
            intermediate_size=draw(st.sampled_from([2, 3, 4])) * heads * head_dim,
            num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            vocab_size=draw(st.sampled_from([1000, 32000]))),
        tie_word_embeddings=draw(st.booleans()),
    )


# colocated: a PD plan weighs a layout per role (test_planner_pd.py has its brute force)
workloads = st.builds(
    Workload,
    prompt_len=st.integers(1, 8192), output_len=st.integers(1, 2048), concurrency=st.integers(1, 512),
    objective=st.sampled_from(["throughput", "latency"]),
)


def brute_force_layouts(num_devices: int, mode: str, model: ModelSpec):
    """Every layout on at most `num_devices` whose tp gives every rank as many heads (a
    divisor of the KV heads, or a multiple of them dividing the query heads): what the
    planner proposes."""
    heads, kv = model.shape.num_attention_heads, model.shape.num_kv_heads
    for tp, pp, dp in itertools.product(range(1, num_devices + 1), repeat=3):
        proposed = heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
        if proposed and tp * pp * dp <= num_devices:
            for sp in sorted({1, tp}):
                yield Layout(tp, pp, dp, sp)


@given(model=models(), n=st.integers(1, 8), wl=workloads,
       device=st.sampled_from(["ascend-910b3", "nvidia-rtx-4090", "ascend-910b4"]))
def test_pick_is_argmin_of_own_cost_over_brute_force(model, n, wl, device):
    topo = small_topology(n, device)
    planner = Planner(sequence_parallel=True)  # the brute force has every sp too
    evals = [planner.evaluate(model, topo, wl, lay) for lay in brute_force_layouts(n, wl.mode, model)]
    assert {e.layout for e in evals} == set(planner.layouts(model, topo, wl))
    feasible = [e for e in evals if e.feasible]
    if not feasible:
        with pytest.raises(NoFeasiblePlanError):
            planner.plan(model, topo, wl)
        return
    plan = planner.plan(model, topo, wl)
    best = min(feasible, key=lambda e: e.sort_key())
    assert plan.chosen.layout == best.layout
    assert plan.chosen.cost == min(e.cost for e in feasible)
    # every plan fits memory, uses tp*pp*dp devices, gives every rank as many whole heads, and
    # cuts the layers into pp non-empty stages (at split points where pp does not divide them)
    lay = plan.chosen.layout
    assert plan.chosen.memory.total <= plan.chosen.memory.capacity
    assert len(plan.device_ids) == len(set(plan.device_ids)) == lay.tp * lay.pp * lay.dp == plan.world_size
    assert model.shape.num_attention_heads % lay.tp == 0
    assert model.shape.num_kv_heads % lay.tp == 0 or lay.tp % model.shape.num_kv_heads == 0
    assert lay.pp <= model.shape.num_layers
    if model.shape.num_layers % lay.pp:
        points = plan.pipeline_split_points
        assert points is not None and len(points) == lay.pp - 1
        assert list(points) == sorted(set(points)) and 0 < points[0] and points[-1] < model.shape.num_layers
    # independent memory check: at least the weight shard must fit
    assert model.weight_bytes(wl.dtype) / (lay.tp * lay.pp) <= get_device(device).memory_bytes
    # groups partition the ranks
    for groups in (plan.tp_groups(), plan.pp_groups(), plan.dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(plan.world_size))
    # rivals: every other device mapping once (SP twins are one plan), each its best-ranked twin
    rivals = plan.rivals()
    mappings = [e.layout.device_mapping for e in rivals]
    assert len(mappings) == len(set(mappings))
    assert set(mappings) == {e.layout.device_mapping for e in evals} - {lay.device_mapping}
    for rival in rivals:
        twins = [e for e in evals if e.layout.device_mapping == rival.layout.device_mapping]
        assert rival.sort_key() == min(e.sort_key() for e in twins)


def test_structural_check_is_the_engine_head_split_rule():
    for heads, kv in [(9, 3), (64, 8), (28, 4), (8, 8), (4, 1)]:
        model = ModelSpec(name="m", architecture="LlamaForCausalLM", shape=ModelShape(
            num_layers=1, hidden_size=heads * 4, intermediate_size=8, num_attention_heads=heads,
            num_kv_heads=kv, head_dim=4, vocab_size=8))
        for tp in range(1, heads + 3):
            engine_runs = tp <= heads and (tp <= kv or tp % kv == 0)
            assert (Planner().structural_reasons(model, Layout(tp, 1, 1, 1)) == []) == engine_runs


def test_default_model_accepts_tp2_and_sizes_kv_by_the_largest_share():
    model = load_model_spec("default")  # SmolLM2-135M: 9 heads, 3 KV heads, 30 layers, head_dim 64
    assert (model.shape.num_attention_heads, model.shape.num_kv_heads) == (9, 3)
    wl = Workload(concurrency=4, kv_dtype="bf16")
    ev = Planner().evaluate(model, small_topology(2, "nvidia-rtx-4090"), wl, Layout(2, 1, 1, 1))
    assert ev.feasible, ev.reasons
    largest_share = 2  # rank 0 holds KV heads 0-1, rank 1 holds head 2; pools match the larger
    per_token = 2 * 30 * largest_share * 64 * 2
    assert model.kv_bytes_per_token("bf16", tp=2) == per_token
    assert ev.memory.kv_cache == per_token * 4 * wl.context_len
    reasons = Planner().structural_reasons(model, Layout(4, 1, 1, 1))
    assert reasons and "allowed tp: 1, 2, 3, 6, 9" in reasons[0]


def test_llama2_70b_never_tp1_on_64gb_devices():
    model = load_model_spec("llama-2-70b")
    topo = from_catalog("atlas-800t-a2")  # 8 x 910B, 64 GB each
    plan = Planner().plan(model, topo, Workload(dtype="fp16"))
    for e in plan.evaluations:
        if e.layout.tp * e.layout.pp == 1:
            assert not e.feasible and "needs" in e.reasons[0]
    assert plan.layout.tp * plan.layout.pp >= 3
    # One device alone cannot hold it at all.
    with pytest.raises(NoFeasiblePlanError, match="needs"):
        Planner().plan(model, small_topology(1), Workload(dtype="fp16"))


def test_small_model_on_one_cpu_host_is_tp1():
    spec = cpu_host_spec(2, 24 * GiB, flags={"avx512f", "amx_bf16"}, arch="x86_64")
    topo = Topology(devices=(Device(0, 0, 0, spec),), name="this-host")
    plan = Planner().plan(load_model_spec("default"), topo, Workload(concurrency=8))
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp) == (1, 1, 1)


def test_tp_stays_inside_a_node_on_two_nodes():
    topo = from_catalog("atlas-800t-a2", 2)
    plan = Planner().plan(load_model_spec("llama-2-70b"), topo, Workload(concurrency=64))
    nodes = {d.index: d.node for d in topo.devices}
    for group in plan.tp_groups():
        assert len({nodes[plan.device_ids[r]] for r in group}) == 1


def test_pd_mode_splits_replicas():
    topo = from_catalog("atlas-800t-a2", 2)
    plan = Planner().plan(load_model_spec("llama-2-70b"), topo, Workload(mode="pd", concurrency=64))
    est = plan.chosen.estimate
    assert est.prefill_replicas >= 1 and est.decode_replicas >= 1
    assert est.prefill_replicas + est.decode_replicas == plan.layout.dp
    assert est.kv_transfer_s > 0


def test_plan_explains_itself():
    plan = Planner().plan(load_model_spec("llama-2-70b"), from_catalog("atlas-800t-a2"), Workload())
    ups = plan.runner_ups(5)
    assert len(ups) == 5 and all(why for _, why in ups)
    d = plan.to_dict()
    assert d["memory_per_device"]["total"] <= d["memory_per_device"]["capacity"]
    assert d["estimate"]["tpot_s"] > 0 and d["candidates"]
    infeasible = [e for e in plan.evaluations if not e.feasible]
    assert any(r.startswith("needs ") for e in infeasible for r in e.reasons)
    # 64 heads: only tp that divide them are candidates (no TP3, TP5, TP6, TP7 on 8 devices)
    assert {e.layout.tp for e in plan.evaluations} == {1, 2, 4, 8}


def test_runner_ups_never_repeat_the_chosen_plan_with_sp():
    # 70B on 8 x 910B with SP weighed: TP8 wins, with SP8 (on a ring its collectives cost what
    # the all-reduce did, and the norms run on 1/8 of the tokens); its twin without SP is close.
    plan = Planner(sequence_parallel=True).plan(load_model_spec("llama-2-70b"),
                                                from_catalog("atlas-800t-a2"), Workload())
    assert plan.chosen.layout == Layout(8, 1, 1, 8)
    assert Layout(8, 1, 1, 1) in {e.layout for e in plan.evaluations}
    shown = [e.layout for e, _ in plan.runner_ups(8)]
    assert all(lay.device_mapping != (8, 1, 1) for lay in shown)
    assert len({lay.device_mapping for lay in shown}) == len(shown) == 8
    rows = format_plan(plan, 3).split("runner-up candidates")[1].splitlines()[2:]
    assert len(rows) == 3 and not any(row.split()[:5] == ["TP8", "x", "PP1", "x", "DP1"] for row in rows)
    assert [c["layout"] for c in plan.to_dict(3)["candidates"]] == [attrs.asdict(lay) for lay in shown[:3]]


def test_pd_on_one_device_says_how_many_devices_a_pd_plan_needs():
    topo = small_topology(1)
    with pytest.raises(NoFeasiblePlanError) as info:
        Planner().plan(load_model_spec("default"), topo, Workload(mode="pd"))
    message = str(info.value)
    assert "a PD plan needs at least 2 devices (1 prefill + 1 decode instance)" in message
    assert "this topology has 1 device." in message and "colocated" in message


def test_slo_makes_candidates_infeasible():
    model, topo = load_model_spec("llama-2-70b"), from_catalog("atlas-800t-a2")
    with pytest.raises(NoFeasiblePlanError, match="SLO"):
        Planner().plan(model, topo, Workload(tpot_slo_s=1e-6))


def test_70b_on_64_devices_is_fast():
    # Not a timed assertion on the machine's speed: a generous bound against accidental blow-up.
    topo = from_catalog("atlas-800t-a2", 8)
    start = time.process_time()
    plan = Planner().plan(load_model_spec("llama-2-70b"), topo, Workload(concurrency=256))
    assert plan.world_size <= 64
    assert time.process_time() - start < 10
