"""Planning MoE models: expert memory and reads, expert parallelism (EP), stages that pp does
not divide evenly, the head and node rules, and the known answers for DeepSeek-V3 and
Mixtral-8x7B on Atlas 800T A2 nodes (their reasoning: docs/kthena_core.md, "Planning MoE")."""

from __future__ import annotations

import functools
import itertools
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.config import load_config
from kthena_core.config_plan import _PinnedPlanner, plan_config
from kthena_core.cost_model import CostParams, StagePricer, memory
from kthena_core.experts import (
    ExpertSplitError,
    allowed_ep_sizes,
    check_ep,
    expected_experts_read,
)
from kthena_core.hardware import get_device
from kthena_core.known_models import load_model_spec
from kthena_core.layout import ExpertLayout, Layout, LayoutError, with_ep
from kthena_core.model_spec import ModelSpec
from kthena_core.planner import NoFeasiblePlanError, Planner, _TopologyView
from kthena_core.report import format_plan
from kthena_core.shape import ModelShape, stage_layer_ranges
from kthena_core.topology import Device, Topology, from_catalog
from kthena_core.workload import Workload

GiB = 1024**3
DSV3 = load_model_spec("deepseek-v3")
MIXTRAL = load_model_spec("mixtral-8x7b")
# what one 910B2 of an Atlas 800T A2 lets a plan use: 64 GiB x memory_utilization
USABLE = get_device("ascend-910b2").memory_bytes * CostParams().memory_utilization


def atlas(num_nodes: int) -> Topology:
    return from_catalog("atlas-800t-a2", num_nodes)


# ---- the model's figures ------------------------------------------------------------------------
def test_moe_parameters_split_into_routed_experts_and_the_rest():
    expert = 3 * 7168 * 2048  # gate, up and down of one DeepSeek-V3 expert
    assert DSV3.expert_params() == expert
    assert DSV3.num_moe_layers == 58  # 61 layers, the first 3 dense
    assert (DSV3.routed_params(2), DSV3.routed_params(3)) == (0, 256 * expert)
    assert DSV3.routed_params() == 58 * 256 * expert
    # weights count all 256 routed experts, compute the 8 a token is routed to
    assert DSV3.num_params() - DSV3.num_params(active=True) == 58 * (256 - 8) * expert
    mixtral_expert = 3 * 4096 * 14336
    assert MIXTRAL.routed_params() == 32 * 8 * mixtral_expert
    assert MIXTRAL.num_params() - MIXTRAL.num_params(active=True) == 32 * (8 - 2) * mixtral_expert


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(4, 1, 3), (4, 2, 2), (5, 2, 3), (6, 3, 2)])
def test_expected_experts_read_is_the_mean_over_every_routing(experts, top_k, tokens):
    """Every way of routing each token to top_k distinct experts, equally likely."""
    subsets = list(itertools.combinations(range(experts), top_k))
    mean = statistics.fmean(len(set().union(*routing))
                            for routing in itertools.product(subsets, repeat=tokens))
    assert expected_experts_read(experts, top_k, tokens) == pytest.approx(mean, rel=1e-12)
    assert expected_experts_read(experts, top_k, 1) == top_k


def test_a_decode_step_reads_the_experts_its_batch_is_routed_to():
    """Batch 1 reads Mixtral's 2 active experts per layer; a batch of 32 nearly all 8."""
    wl = Workload(prompt_len=128, output_len=64, concurrency=1)
    context = wl.prompt_len + wl.output_len / 2  # the decode's mean context (cost_model)
    rest = MIXTRAL.layer_params(0) - MIXTRAL.routed_params(0)  # attention, router, norms
    for batch, experts in ((1, 2.0), (32, 8 * (1 - (6 / 8) ** 32))):
        kv = MIXTRAL.kv_bytes_per_token("bf16", 8) / 32 * batch * context
        _, nbytes = StagePricer(MIXTRAL, wl, Layout(8), None, None, batch).work(range(1), False)
        assert nbytes == pytest.approx((rest + experts * MIXTRAL.expert_params()) * 2 / 8 + kv,
                                       rel=1e-12)


def test_int8_kv_counts_the_scale_the_engines_pool_keeps():
    """int8 K and V with a float32 scale per token per KV head: head_dim + 4 bytes each."""
    assert MIXTRAL.kv_bytes_per_token("int8") == 2 * 32 * 8 * (128 + 4)
    assert MIXTRAL.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2


# ---- expert parallelism -----------------------------------------------------------------------
def test_ep_needs_routed_experts_whole_instances_and_an_equal_share_of_experts():
    assert allowed_ep_sizes(8, 4) == (1, 2, 4)
    assert allowed_ep_sizes(8, 6) == (1, 2) and allowed_ep_sizes(0, 4) == (1,)
    with pytest.raises(ExpertSplitError, match=r"ep=3 does not divide the 8 experts: .*allowed ep: 1, 2$"):
        check_ep(8, 3, 6)
    with pytest.raises(ExpertSplitError, match=r"ep=4 does not divide dp=6: .*allowed ep: 1, 2$"):
        check_ep(8, 4, 6)
    with pytest.raises(ExpertSplitError, match=r"ep=2 needs routed experts, and the model is dense"):
        check_ep(0, 2, 2)
    with pytest.raises(LayoutError, match="ep=3 must divide dp=4"):
        ExpertLayout(8, 1, 4, ep=3)
    with pytest.raises(LayoutError, match="a plain Layout is ep 1"):
        ExpertLayout(8, 1, 4, ep=1)
    dense = load_model_spec("llama-2-70b")
    assert Planner().structural_reasons(dense, ExpertLayout(8, 1, 2, ep=2)) == [
        "ep=2 needs routed experts, and the model is dense; allowed ep: 1"]


def test_only_moe_models_in_colocated_mode_get_ep_candidates():
    planner = Planner(wide_ep=True)
    llama = load_model_spec("llama-2-70b")
    assert {lay.ep for lay in planner.layouts(llama, atlas(1), Workload())} == {1}
    assert {lay.ep for lay in planner.layouts(MIXTRAL, atlas(1), Workload(mode="pd"))} == {1}
    assert {lay.ep for lay in planner.layouts(MIXTRAL, atlas(1), Workload())} == {1, 2, 4, 8}
    assert {lay.ep for lay in Planner().layouts(MIXTRAL, atlas(1), Workload())} == {1}


def test_ep_splits_only_the_routed_experts_over_the_group():
    dev = Planner().device_figures(atlas(4))
    wl = Workload()
    plain = memory(DSV3, wl, Layout(8, 1, 4), dev, CostParams(), 8)
    ep4 = memory(DSV3, wl, ExpertLayout(8, 1, 4, ep=4), dev, CostParams(), 8)
    routed_bytes = DSV3.routed_params() * 2  # bf16
    assert plain.weights - ep4.weights == pytest.approx(routed_bytes * (1 - 1 / 4) / 8, rel=1e-12)
    assert ep4.kv_cache == plain.kv_cache  # each instance keeps its own sequences' KV


def test_ep_groups_are_consecutive_instances_rank_by_rank():
    plan = Planner(wide_ep=True).plan(MIXTRAL, atlas(1), Workload())
    lay = plan.layout
    groups = plan.ep_groups()
    assert sorted(r for g in groups for r in g) == list(range(plan.world_size))
    assert all(len(g) == lay.ep for g in groups)
    # members of a group: the same TP index and stage, instances ep apart by tp x pp ranks
    assert all(b - a == lay.tp * lay.pp for g in groups for a, b in itertools.pairwise(g))


# ---- the planner against brute force: EP, uneven stages and the node rule ------------------
@st.composite
def moe_models(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    hidden = heads * 128
    return ModelSpec(
        name="moe", architecture="MixtralForCausalLM",
        shape=ModelShape(num_layers=draw(st.sampled_from([1, 2, 3, 5])), hidden_size=hidden,
                         intermediate_size=2 * hidden, num_attention_heads=heads,
                         num_kv_heads=kv, head_dim=128, vocab_size=1000),
        num_experts=draw(st.sampled_from([2, 4, 6, 8])),
        num_experts_per_tok=draw(st.integers(1, 2)),
        moe_intermediate_size=draw(st.sampled_from([1024, 16384, 65536])),
        first_dense_layers=draw(st.integers(0, 1)),
    )


def split_topology(num_devices: int, num_nodes: int, device: str = "ascend-910b4") -> Topology:
    """`num_devices` devices over `num_nodes` nodes, filled in order (the last may hold fewer)."""
    per = math.ceil(num_devices / num_nodes)
    spec = get_device(device)
    return Topology(devices=tuple(Device(i, i // per, i % per, spec) for i in range(num_devices)),
                    name=f"{num_devices}x{device}")


def brute_force_layouts(model: ModelSpec, num_devices: int, mode: str):
    heads, kv = model.shape.num_attention_heads, model.shape.num_kv_heads
    for tp, pp, dp, ep in itertools.product(range(1, num_devices + 1), repeat=4):
        proposed = heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
        expert_parallel = ep == 1 or (mode == "colocated" and model.num_experts % ep == 0)
        if proposed and tp * pp * dp <= num_devices and dp % ep == 0 and expert_parallel:
            yield with_ep(Layout(tp, pp, dp), ep)


def spans_nodes(layout: Layout, topology: Topology) -> bool:
    """Whether a TP group spans nodes, ranks laid on the devices in order (one link domain
    per node here)."""
    nodes = [d.node for d in topology.devices]
    return any(len({nodes[r] for r in range(g, g + layout.tp)}) > 1
               for g in range(0, layout.num_devices, layout.tp))


@given(model=moe_models(), n=st.integers(1, 8), num_nodes=st.integers(1, 2),
       wl=st.builds(Workload, prompt_len=st.integers(1, 4096), output_len=st.integers(1, 512),
                    concurrency=st.integers(1, 64)))
def test_pick_is_the_brute_force_argmin_keeping_tp_groups_inside_nodes(model, n, num_nodes, wl):
    topo = split_topology(n, min(num_nodes, n))
    planner = Planner(wide_ep=True)
    evals = [planner.evaluate(model, topo, wl, lay)
             for lay in brute_force_layouts(model, n, wl.mode)]
    assert {e.layout for e in evals} == set(planner.layouts(model, topo, wl))
    feasible = [e for e in evals if e.feasible]
    if not feasible:
        with pytest.raises(NoFeasiblePlanError):
            planner.plan(model, topo, wl)
        return
    inside = [e for e in feasible if not spans_nodes(e.layout, topo)]
    best = min(inside or feasible, key=lambda e: e.sort_key())
    plan = planner.plan(model, topo, wl)
    assert plan.chosen.layout == best.layout and plan.chosen.cost == best.cost
    assert any("span" in note for note in plan.tp_notes) == spans_nodes(best.layout, topo)
    lay = plan.chosen.layout
    ranges = stage_layer_ranges(model.shape.num_layers, lay.pp, plan.pipeline_split_points
                                if model.shape.num_layers % lay.pp else None)
    assert [i for r in ranges for i in r] == list(range(model.shape.num_layers))


def one_layer_model() -> ModelSpec:
    """31 GiB of weights in bf16, most of them one decoder layer: more than one 910B4
    (28.8 GiB usable) holds, and a single layer cannot be cut into pipeline stages."""
    return ModelSpec(name="one-layer", architecture="LlamaForCausalLM", shape=ModelShape(
        num_layers=1, hidden_size=8192, intermediate_size=655360, num_attention_heads=64,
        num_kv_heads=8, head_dim=128, vocab_size=32000))


def test_a_tp_group_spans_nodes_when_nothing_else_fits_and_the_plan_says_so():
    topo = split_topology(2, 2)  # two nodes of one 910B4 each
    plan = Planner().plan(one_layer_model(), topo, Workload(concurrency=1, prompt_len=64,
                                                            output_len=16))
    assert plan.layout == Layout(2, 1, 1)
    (note,) = plan.tp_notes
    # inside a node: TP1 x PP1 on one device (DP1 or DP2) is short of memory, TP1 x PP2 of layers
    assert note.startswith("TP2 groups span 2 nodes: none of the 3 layouts whose TP groups each "
                           "stay on one node fits; the closest, TP1 x PP1 x DP1: needs ")
    assert f"tp        {note}" in format_plan(plan)
    assert plan.to_dict()["tp_notes"] == [note]


# ---- the head rule and uneven stages ---------------------------------------------------------
def test_tp_that_does_not_divide_the_heads_is_never_a_candidate():
    """DeepSeek-V3's 128 heads on 4 nodes: no TP25, 27 or 29 among the runners-up."""
    plan = Planner().plan(DSV3, atlas(4), Workload())
    assert {e.layout.tp for e in plan.evaluations} == {1, 2, 4, 8, 16, 32}


def test_a_pinned_tp_that_does_not_divide_the_heads_is_planned_and_said():
    smollm2 = load_model_spec("default")  # 9 heads, 3 KV heads: tp=2 holds 6 + 3 heads
    plan = _PinnedPlanner(Layout(2)).plan(smollm2, atlas(1), Workload(concurrency=4))
    assert plan.layout == Layout(2) and plan.tp_notes == (
        "tp=2 does not divide num_kv_heads=3: its ranks would hold 6 or 3 query heads, "
        "and the rank with the most sets every step's pace; tp that divide the heads: 1, 3, 9 "
        "(this tp was pinned, not proposed)",)


def test_a_pinned_pp_that_does_not_divide_the_layers_gets_uneven_stages():
    """SmolLM2's 30 layers over pp=4: the config no longer needs split points; the plan cuts
    the stages and carries the points to the engine (GET /plan, --pipeline-split-points)."""
    cfg = load_config({"cluster": {"world_size": 4}, "model": {"checkpoint_path": "default"},
                       "parallelism": {"strategy": "pp", "pipeline_parallel_size": 4}})
    plan = plan_config(cfg, atlas(1))
    split = plan.chosen.split
    assert split.source == "balanced" and plan.pipeline_split_points == split.points
    assert len(split.points) == 3 and sum(split.stage_layers(30)) == 30
    assert "pp=4 does not divide the 30 layers" in split.reason(30)


def _brute_force_slowest(num_layers: int, pp: int, time) -> float:
    return min(max(time(r, s == pp - 1) for s, r in enumerate(stage_layer_ranges(
        num_layers, pp, points))) for points in itertools.combinations(range(1, num_layers), pp - 1))


# ---- known answers: DeepSeek-V3 ----------------------------------------------------------------
def test_deepseek_v3_does_not_fit_two_atlas_nodes_in_bf16():
    assert DSV3.weight_bytes("bf16") > 16 * USABLE  # 1250 GiB > 16 x 57.6 GiB
    with pytest.raises(NoFeasiblePlanError, match="exceed device memory"):
        Planner().plan(DSV3, atlas(2), Workload())


def test_deepseek_v3_on_three_atlas_nodes_is_tp8_x_pp3_in_uneven_stages():
    plan = Planner().plan(DSV3, atlas(3), Workload())
    need = math.ceil(DSV3.weight_bytes("bf16") / USABLE)  # the weights alone: 22 devices
    assert need == 22
    assert not any(e.feasible for e in plan.evaluations if e.layout.tp * e.layout.pp < need)
    assert plan.layout == Layout(8, 3, 1)
    split = plan.chosen.split
    assert split.source == "balanced" and not split.has_equal_split
    assert plan.pipeline_split_points == split.points
    assert sum(split.stage_layers(61)) == 61 and len(split.points) == 2
    view = _TopologyView(atlas(3), CostParams())
    pricer = StagePricer(DSV3, plan.workload, plan.layout, view.figures, view.links(8, 3, 1), 32)
    assert max(split.stage_seconds) <= _brute_force_slowest(61, 3, pricer.time) * (1 + 1e-9)
    assert "pp=3 does not divide the 61 layers" in format_plan(plan)


def test_deepseek_v3_on_four_atlas_nodes_pipelines_over_them_without_ep():
    plan = Planner().plan(DSV3, atlas(4), Workload())
    assert plan.layout == Layout(8, 4, 1)
    assert plan.pipeline_split_points is not None and len(plan.pipeline_split_points) == 3
    # 4 micro-batches of 8 sequences each touch fewer distinct experts than 3 of 10.7
    assert expected_experts_read(256, 8, 8) < 0.8 * expected_experts_read(256, 8, 32 / 3)


def test_deepseek_v3_on_four_atlas_nodes_with_ep_is_one_instance_per_node():
    plan = Planner(wide_ep=True).plan(DSV3, atlas(4), Workload())
    assert plan.layout == ExpertLayout(8, 1, 4, ep=4)
    assert plan.to_dict()["layout"] == {"tp": 8, "pp": 1, "dp": 4, "sp": 1, "ep": 4}
    assert "plan      TP8 x PP1 x DP4 (EP4) on 32 device(s)" in format_plan(plan)
    # without a pipeline, only an EP group over all 32 devices leaves room for the rest
    fits = {e.layout for e in plan.evaluations if e.feasible and e.layout.pp == 1}
    assert fits == {ExpertLayout(8, 1, 4, ep=4), ExpertLayout(4, 1, 8, ep=8),
                    ExpertLayout(2, 1, 16, ep=16)}
    held = plan.chosen.memory.weights - (DSV3.num_params() - DSV3.routed_params()) * 2 / 8
    assert held == pytest.approx(DSV3.routed_params() * 2 / 32, rel=1e-12)
    assert plan.expert_note().startswith("EP4: each group of 4 instances shares one copy of the "
                                         "routed experts: an instance holds 64 of the 256")


def test_deepseek_v3_in_int8_on_two_atlas_nodes_keeps_tp_inside_each_node():
    plan = Planner().plan(DSV3, atlas(2), Workload(dtype="int8"))
    assert plan.layout == Layout(8, 2, 1) and plan.tp_notes == ()
    tp16 = next(e for e in plan.evaluations if e.layout == Layout(16, 1, 1))
    assert tp16.estimate is not None  # it fits, and is refused for spanning the two nodes
    assert tp16.reasons == ("its TP16 groups span 2 nodes, and a layout whose TP groups each "
                            "stay on one node fits (TP8 x PP2 x DP1)",)


# ---- known answers: Mixtral-8x7B ---------------------------------------------------------------
def test_mixtral_on_one_atlas_node_is_tp8():
    plan = Planner().plan(MIXTRAL, atlas(1), Workload())
    assert plan.layout == Layout(8, 1, 1)
    assert MIXTRAL.weight_bytes("bf16") > USABLE  # 87 GiB: TP1 never fits


def test_mixtral_on_two_atlas_nodes_is_one_tp8_instance_per_node():
    plan = Planner().plan(MIXTRAL, atlas(2), Workload())
    assert plan.layout == Layout(8, 1, 2) and plan.tp_notes == ()
    tp16 = next(e for e in plan.evaluations if e.layout == Layout(16, 1, 1))
    assert tp16.reasons[0].startswith("its TP16 groups span 2 nodes")


# ---- the figures docs/kthena_core.md quotes ------------------------------------------------------
DOCUMENTED = [  # (model, nodes, dtype, wide EP, layout, predicted tok/s rounded)
    (DSV3, 3, "bf16", False, Layout(8, 3, 1), 456), (DSV3, 3, "bf16", False, Layout(4, 6, 1), 369),
    (DSV3, 4, "bf16", False, Layout(8, 4, 1), 515),
    (DSV3, 4, "bf16", True, ExpertLayout(8, 1, 4, ep=4), 773),
    (DSV3, 4, "bf16", True, ExpertLayout(4, 1, 8, ep=8), 730),
    (DSV3, 4, "bf16", True, ExpertLayout(2, 1, 16, ep=16), 563),
    (DSV3, 2, "int8", False, Layout(8, 2, 1), 641), (DSV3, 2, "int8", False, Layout(16, 1, 1), 337),
    (MIXTRAL, 1, "bf16", False, Layout(8, 1, 1), 1793),
    (MIXTRAL, 1, "bf16", False, Layout(4, 1, 2), 1377),
    (MIXTRAL, 2, "bf16", False, Layout(8, 1, 2), 2048),
    (MIXTRAL, 2, "bf16", False, Layout(8, 2, 1), 1824),
    (MIXTRAL, 1, "bf16", True, ExpertLayout(2, 1, 4, ep=4), 2189),
    (MIXTRAL, 1, "bf16", True, ExpertLayout(4, 1, 2, ep=2), 2132),
]


@functools.cache
def _plan(model: str, nodes: int, dtype: str, wide_ep: bool):
    return Planner(wide_ep=wide_ep).plan(load_model_spec(model), atlas(nodes), Workload(dtype=dtype))


@pytest.mark.parametrize(("model", "nodes", "dtype", "wide_ep", "layout", "tok_s"), DOCUMENTED,
                         ids=[f"{m.name}-{n}-{d}-{lay.label}" for m, n, d, _, lay, _ in DOCUMENTED])
def test_the_predictions_the_docs_quote_are_todays(model, nodes, dtype, wide_ep, layout, tok_s):
    """docs/kthena_core.md, "Planning MoE": if the cost model moves, update the table there."""
    plan = _plan(model.name, nodes, dtype, wide_ep)
    (judged,) = [e for e in plan.evaluations if e.layout == layout]
    assert round(judged.estimate.throughput_tok_s) == tok_s
    splits = {("deepseek-v3", 3): (22, 20, 19), ("deepseek-v3", 4): (17, 15, 15, 14),
              ("deepseek-v3", 2): (32, 29)}
    if plan.chosen.layout == layout and layout.pp > 1:
        assert plan.chosen.split.stage_layers(61) == splits[model.name, nodes]
