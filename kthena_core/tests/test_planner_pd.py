"""PD planned per role: each role's layout and count, a brute force on small spaces, the
known answer for Llama-2-70B on one Atlas 800T A2, the reason lines, pinned roles and the
refusals by name."""

from __future__ import annotations

import itertools
import math
import time

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.cli import main
from kthena_core.config import ConfigError, load_config
from kthena_core.config_plan import _PinnedPlanner, plan_config
from kthena_core.hardware import get_device
from kthena_core.known_models import load_model_spec
from kthena_core.layout import ExpertLayout, Layout, LayoutError, PDLayout
from kthena_core.model_spec import ModelSpec
from kthena_core.pd_roles import PDRoles, RolePin
from kthena_core.planner import NoFeasiblePlanError, Planner
from kthena_core.report import format_plan
from kthena_core.shape import ModelShape
from kthena_core.topology import Device, Topology, from_catalog
from kthena_core.workload import Workload

LLAMA_70B = load_model_spec("llama-2-70b")


def topology(num_devices: int, num_nodes: int = 1, device: str = "ascend-910b4") -> Topology:
    """`num_devices` devices over `num_nodes` nodes, filled in order (the last may hold fewer)."""
    per = math.ceil(num_devices / num_nodes)
    spec = get_device(device)
    return Topology(devices=tuple(Device(i, i // per, i % per, spec) for i in range(num_devices)),
                    name=f"{num_devices}x{device}")


# ---- the value ------------------------------------------------------------------------------------
def test_a_pd_layout_is_a_layout_and_a_count_per_role():
    lay = PDLayout(Layout(2, 1, 2), Layout(4, 1, 1))
    assert lay.label == "prefill 2 x TP2 + decode 1 x TP4"
    assert (lay.num_devices, lay.dp, lay.tp, lay.pp, lay.sp, lay.ep) == (8, 3, 4, 1, 1, 1)
    assert [(i.role, i.first_rank, i.tp) for i in lay.instances()] == [
        ("prefill", 0, 2), ("prefill", 2, 2), ("decode", 4, 4)]
    assert lay.as_layout() == Layout(4, 1, 3)
    assert PDLayout(Layout(2, 2, 1), Layout(4, 1, 1)).label == "prefill 1 x TP2 x PP2 + decode 1 x TP4"
    with pytest.raises(LayoutError, match=r"PDLayout.decode: sp=4; allowed: 1"):
        PDLayout(Layout(4), Layout(4, sp=4))
    with pytest.raises(LayoutError, match=r"PDLayout.prefill must be a plain Layout"):
        PDLayout(ExpertLayout(4, 1, 2, ep=2), Layout(4))


# ---- brute force ----------------------------------------------------------------------------------
@st.composite
def models(draw):
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([64, 128]))
    return ModelSpec(
        name="random", architecture="LlamaForCausalLM",
        shape=ModelShape(
            num_layers=draw(st.sampled_from([2, 3, 4, 6, 30, 80])),
            hidden_size=heads * head_dim * draw(st.sampled_from([1, 16])),
            intermediate_size=draw(st.sampled_from([2, 3, 4])) * heads * head_dim * 16,
            num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            vocab_size=draw(st.sampled_from([1000, 32000]))),
        tie_word_embeddings=draw(st.booleans()))


def brute_force_pd_layouts(model: ModelSpec, n: int):
    """Every prefill (tp, pp) x count + decode (tp, pp) x count on at most n devices, tp giving
    every rank as many whole heads, pp at most the layers."""
    heads, kv, layers = (model.shape.num_attention_heads, model.shape.num_kv_heads,
                         model.shape.num_layers)
    for tp_p, pp_p, n_p, tp_d, pp_d, n_d in itertools.product(range(1, n + 1), repeat=6):
        proposed = all(heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) for tp in (tp_p, tp_d))
        if (proposed and max(pp_p, pp_d) <= layers
                and tp_p * pp_p * n_p + tp_d * pp_d * n_d <= n):
            yield PDLayout(Layout(tp_p, pp_p, n_p), Layout(tp_d, pp_d, n_d))


def spans_nodes(layout: PDLayout, topo: Topology) -> bool:
    """Whether a TP group of either role spans nodes, ranks laid on the devices in order,
    prefill instances first."""
    nodes = [d.node for d in topo.devices]
    return any(len({nodes[i.first_rank + p * i.tp + t] for t in range(i.tp)}) > 1
               for i in layout.instances() for p in range(i.pp))


@given(model=models(), n=st.integers(2, 6), num_nodes=st.integers(1, 2),
       wl=st.builds(Workload, prompt_len=st.integers(1, 4096), output_len=st.integers(1, 512),
                    concurrency=st.integers(1, 64), mode=st.just("pd"),
                    objective=st.sampled_from(["throughput", "latency"])))
def test_the_pick_is_the_brute_force_argmin_per_role(model, n, num_nodes, wl):
    topo = topology(n, min(num_nodes, n))
    planner = Planner()
    evals = [planner.evaluate(model, topo, wl, lay) for lay in brute_force_pd_layouts(model, n)]
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
    # every role fits, the deployment serves its slower role's rate, ranks partition
    prefill, decode = plan.roles
    assert all(r.memory.total <= r.memory.capacity for r in plan.roles)
    est = plan.chosen.estimate
    assert math.isclose(est.throughput_tok_s, min(prefill.rate, decode.rate) * wl.output_len)
    assert (est.prefill_replicas, est.decode_replicas) == (prefill.layout.dp, decode.layout.dp)
    assert est.ttft_s >= prefill.seconds and est.tpot_s == decode.seconds
    assert list(prefill.ranks()) + list(decode.ranks()) == list(range(plan.world_size))
    for groups in (plan.tp_groups(), plan.pp_groups(), plan.dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(plan.world_size))
    assert len(plan.role_notes()) == 2


# ---- the known answer -----------------------------------------------------------------------------
def test_llama_2_70b_pd_on_one_atlas_node_is_prefill_tp4_and_decode_tp4():
    """Seed B: prefill on NPUs 0-3, decode on 4-7 (docs/kthena_core.md, "Planning PD" has the
    reasoning)."""
    plan = Planner().plan(LLAMA_70B, from_catalog("atlas-800t-a2"), Workload(mode="pd"))
    assert plan.pd_layout == PDLayout(Layout(4, 1, 1), Layout(4, 1, 1))
    assert (plan.prefill_layout, plan.decode_layout) == (Layout(4, 1, 1), Layout(4, 1, 1))
    prefill, decode = plan.roles
    assert [plan.device_ids[r] for r in prefill.ranks()] == [0, 1, 2, 3]
    assert [plan.device_ids[r] for r in decode.ranks()] == [4, 5, 6, 7]
    assert plan.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # what kthena_serve reads of a PD plan, unchanged: one layout, the split
    assert plan.layout == Layout(4, 1, 2) and plan.world_size == 8
    est = plan.chosen.estimate
    assert (est.prefill_replicas, est.decode_replicas) == (1, 1)
    # prefill is compute-bound, decode bandwidth-bound; decode sets the rate
    assert prefill.bound == "compute-bound" and decode.bound == "bandwidth-bound"
    assert decode.rate < prefill.rate
    assert est.throughput_tok_s == pytest.approx(919.5, abs=0.1)
    assert est.tpot_s == pytest.approx(0.0348, abs=1e-4)
    assert prefill.seconds == pytest.approx(0.2305, abs=1e-3)
    # the decode role: TP2 x PP2 reads the same 32 GiB per device twice a token (2
    # micro-batches), TP1 x PP4 four times
    decodes = {e.layout.decode: e.estimate.tpot_s for e in plan.evaluations
               if e.feasible and e.layout.prefill == Layout(4, 1, 1)}
    assert decodes[Layout(2, 2, 1)] > 1.6 * decodes[Layout(4, 1, 1)]
    assert decodes[Layout(1, 4, 1)] > 3 * decodes[Layout(4, 1, 1)]
    # every 3- and 4-device prefill layout outruns the decode role: a tie broken by TTFT
    rival = plan.rivals()[0]
    assert rival.layout == PDLayout(Layout(2, 2, 1), Layout(4, 1, 1))
    assert rival.estimate.throughput_tok_s == est.throughput_tok_s
    assert rival.estimate.ttft_s > est.ttft_s


def test_each_role_says_why_it_got_its_layout():
    plan = Planner().plan(LLAMA_70B, from_catalog("atlas-800t-a2"), Workload(mode="pd"))
    prefill, decode = plan.role_notes()
    assert prefill.startswith("1 x TP4 on device(s) 0-3: compute-bound (a prompt: ")
    assert "4.34 prompts/s, 1.21x the 3.59/s the decode role serves" in prefill
    assert prefill.endswith("beats 1 x TP2 x PP2 beside it: ties on throughput (919.5 tok/s: "
                            "the slower role sets it); TTFT 419.4 vs 231.0 ms")
    assert decode.startswith("1 x TP4 on device(s) 4-7: bandwidth-bound (a decode step: ")
    assert "TPOT 34.80 ms for 32 sequences an instance, 3.59 requests/s, sets the deployment's " \
           "rate" in decode
    assert decode.endswith("beats 1 x TP2 x PP2 beside it: throughput 550.5 vs 919.5 tok/s "
                           "(TPOT 58.13 ms, TTFT 231.0 ms)")
    text = format_plan(plan)
    assert f"prefill   {prefill}" in text and f"decode    {decode}" in text
    assert "plan      prefill 1 x TP4 + decode 1 x TP4 on 8 device(s)" in text
    out = plan.to_dict()
    assert out["layout"] == {"tp": 4, "pp": 1, "dp": 2, "sp": 1}
    role = out["pd"]["prefill"]
    assert (role["tp"], role["pp"], role["count"], role["device_ids"]) == (4, 1, 1, [0, 1, 2, 3])
    assert role["reason"] == prefill and role["pipeline_split_points"] is None
    assert out["pd"]["decode"]["device_ids"] == [4, 5, 6, 7]
    assert out["candidates"][0]["layout"] == {"prefill": {"tp": 2, "pp": 2, "dp": 1, "sp": 1},
                                              "decode": {"tp": 4, "pp": 1, "dp": 1, "sp": 1}}


def test_kthena_plan_mode_pd_prints_each_roles_layout(capsys):
    assert main(["plan", "--model", "llama-2-70b", "--topology", "atlas-800t-a2",
                 "--mode", "pd"]) == 0
    out = capsys.readouterr().out
    assert "\nprefill   1 x TP4 on device(s) 0-3: compute-bound" in out
    assert "\ndecode    1 x TP4 on device(s) 4-7: bandwidth-bound" in out
    assert "PD split: 1 prefill + 1 decode instance(s)" in out


def test_roles_of_different_sizes_hand_off_the_kv_re_sharded():
    """On two nodes prefill and decode may differ; the hand-off is priced at the busier side's
    share of a prompt's KV."""
    plan = _PinnedPlanner(None, pd_roles=PDRoles(RolePin(tp=4, count=2), RolePin(tp=8))).plan(
        LLAMA_70B, from_catalog("atlas-800t-a2", 2), Workload(mode="pd"))
    assert plan.pd_layout == PDLayout(Layout(4, 1, 2), Layout(8, 1, 1))
    per_rank = LLAMA_70B.kv_bytes_per_token("bf16", 4) * 1024  # the TP4 side holds more
    # prefill on node 0, decode on node 1: RoCE, 25 GB/s x link efficiency 0.8
    assert plan.chosen.estimate.kv_transfer_s == pytest.approx(per_rank / (25e9 * 0.8))


def test_70b_pd_on_64_devices_plans_in_reasonable_time():
    # Not a timed assertion on the machine's speed: a generous bound against accidental blow-up.
    start = time.process_time()
    plan = Planner().plan(LLAMA_70B, from_catalog("atlas-800t-a2", 8),
                          Workload(mode="pd", concurrency=256))
    assert plan.world_size <= 64 and len(plan.roles) == 2
    assert time.process_time() - start < 60


# ---- pinned roles and refusals --------------------------------------------------------------------
def pd_config(roles: dict, **sections) -> dict:
    return {"cluster": {"topology": "atlas-800t-a2"}, "parallelism": {"strategy": "auto"},
            "service": {"mode": "pd"}, "pd": roles, **sections}


def test_a_config_pins_what_it_names_and_the_planner_chooses_the_rest():
    cfg = load_config(pd_config({"prefill": {"tp": 2, "pp": 2}}))
    plan = plan_config(cfg, from_catalog("atlas-800t-a2"), LLAMA_70B)
    assert plan.prefill_layout == Layout(2, 2, 1) and plan.decode_layout == Layout(4, 1, 1)
    assert plan.roles[0].split_points is None  # 80 layers: two equal stages
    # a pinned layout in PD mode: its splits into prefill + decode instances of its size
    pinned = load_config({"cluster": {"world_size": 8}, "service": {"mode": "pd"},
                          "parallelism": {"strategy": "tp_pp_dp", "tensor_parallel_size": 4,
                                          "data_parallel_size": 2}})
    assert plan_config(pinned, from_catalog("atlas-800t-a2"), LLAMA_70B).pd_layout == \
        PDLayout(Layout(4, 1, 1), Layout(4, 1, 1))


@pytest.mark.parametrize(("data", "message"), [
    (pd_config({"prefill": {"tp": 9}}),
     "pd.prefill.tp: got 9; allowed: one of 1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64 "
     "(llama-2-70b has 64 attention heads, 8 KV heads: each rank holds whole heads)"),
    (pd_config({"decode": {"pp": 81}}),
     "pd.decode.pp: got 81; allowed: at most llama-2-70b's 80 layers"),
])
def test_a_role_the_model_cannot_split_is_refused_by_name(data, message):
    with pytest.raises(ConfigError) as error:
        plan_config(load_config(data), from_catalog("atlas-800t-a2"), LLAMA_70B)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(("data", "message"), [
    (pd_config({"prefill": {"dtype": "fp8"}}),
     "pd.prefill.dtype: got 'fp8'; allowed: nothing: both roles compute in model.dtype"),
    (pd_config({"decode": {"tpp": 2}}), "pd.decode.tpp: unknown key (did you mean 'tp'?)"),
    (pd_config({"decode": {"count": 0}}), "pd.decode.count: got 0; allowed: a number > 0"),
    (pd_config({"prefill": {"tp": 4}}, service={"mode": "colocated"}),
     "pd: got {'prefill': {'tp': 4}}; allowed: unset with service.mode colocated"),
    ({**pd_config({"prefill": {"tp": 4}}), "cluster": {"world_size": 4},
      "parallelism": {"strategy": "tp", "tensor_parallel_size": 4}},
     "parallelism.strategy: got 'tp'; allowed: auto with a pd section"),
])
def test_a_bad_pd_section_is_refused_by_name(data, message):
    with pytest.raises(ConfigError) as error:
        load_config(data)
    assert str(error.value).startswith(message)


def test_a_pinned_role_tp_may_split_the_heads_unevenly_and_the_plan_says_so():
    cfg = load_config(pd_config({"prefill": {"tp": 3}}))
    plan = plan_config(cfg, from_catalog("atlas-800t-a2"), LLAMA_70B)
    assert plan.prefill_layout.tp == 3
    assert any(note.startswith("prefill: tp=3 does not divide") and "pinned, not proposed" in note
               for note in plan.tp_notes)


def test_a_pinned_pd_layout_needs_two_instances():
    cfg = load_config({"cluster": {"world_size": 4}, "service": {"mode": "pd"},
                       "parallelism": {"strategy": "tp", "tensor_parallel_size": 4}})
    with pytest.raises(ConfigError, match=r"^parallelism.data_parallel_size: got 1 with "
                                          r"service.mode pd; allowed: at least 2"):
        plan_config(cfg, from_catalog("atlas-800t-a2"), LLAMA_70B)


def test_old_pd_configs_stay_valid():
    cfg = load_config({"service": {"mode": "pd"}, "parallelism": {"strategy": "auto"}})
    assert not cfg.pd.is_set


def test_a_role_tp_larger_than_a_node_is_refused_where_one_inside_fits():
    cfg = load_config(pd_config({"decode": {"tp": 16}}))
    with pytest.raises(ConfigError, match=r"^pd.decode.tp: got 16, but a node of "
                                          r"3xatlas-800t-a2 has 8 devices and a plan whose TP "
                                          r"groups each stay on one node fits \(prefill 1 x TP8 "
                                          r"\+ decode 2 x TP8\); allowed: at most 8"):
        plan_config(cfg, from_catalog("atlas-800t-a2", 3), LLAMA_70B)


def one_layer_model() -> ModelSpec:
    """31 GiB of weights in bf16, most of them one decoder layer: more than one 910B4 (28.8
    GiB usable) holds, and a single layer cannot be cut into pipeline stages."""
    return ModelSpec(name="one-layer", architecture="LlamaForCausalLM", shape=ModelShape(
        num_layers=1, hidden_size=8192, intermediate_size=655360, num_attention_heads=64,
        num_kv_heads=8, head_dim=128, vocab_size=32000))


def test_a_role_tp_larger_than_a_node_runs_where_nothing_else_fits():
    topo = topology(4, 4)  # four nodes of one 910B4
    wl = Workload(mode="pd", concurrency=1, prompt_len=64, output_len=16)
    plan = _PinnedPlanner(None, pd_roles=PDRoles(decode=RolePin(tp=2))).plan(
        one_layer_model(), topo, wl)
    assert plan.pd_layout == PDLayout(Layout(2, 1, 1), Layout(2, 1, 1))
    (note,) = plan.tp_notes
    assert note.startswith("The prefill role's TP2 groups span 2 nodes: no layout whose TP "
                           "groups each stay on one node was judged")
    assert attrs.evolve(plan.chosen, reasons=()).feasible
