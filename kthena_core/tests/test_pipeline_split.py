"""Uneven pipeline splits: the split-point rule, the balancer against brute force, the planner
proposing a split where the LM head weighs on the last stage, a YAML's explicit points, and the
rendered manifest carrying them."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.config import ConfigError, load_config
from kthena_core.config_plan import _PinnedPlanner, plan_config
from kthena_core.cost_model import StagePricer
from kthena_core.layout import Layout
from kthena_core.model_spec import ModelSpec
from kthena_core.pipeline_split import UNEVEN_THRESHOLD, balanced_split_points
from kthena_core.planner import Planner
from kthena_core.report import format_plan
from kthena_core.shape import (
    LayerSplitError,
    ModelShape,
    check_split_points,
    stage_layer_range,
    stage_layer_ranges,
)
from kthena_core.topology import from_catalog
from kthena_core.workload import Workload

# 8 layers of ~2.6M weights and an untied LM head of 32000 x 512 = 16.4M (~6 layers' worth):
# with pp=2 the last stage's share is 4 layers + the head, the first's 4 layers.
BIG_HEAD = ModelSpec(name="big-head", architecture="LlamaForCausalLM", shape=ModelShape(
    num_layers=8, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_kv_heads=8,
    head_dim=64, vocab_size=32000))
SMALL_HEAD = ModelSpec(name="small-head", architecture="LlamaForCausalLM", shape=ModelShape(
    num_layers=8, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_kv_heads=8,
    head_dim=64, vocab_size=64))
ATLAS = from_catalog("atlas-800t-a2", 1)
WORKLOAD = Workload(prompt_len=128, output_len=64, concurrency=2)


# ---- the rule ------------------------------------------------------------------------------------
def test_split_points_are_the_first_layer_of_each_later_stage():
    assert stage_layer_ranges(30, 2, (10,)) == (range(0, 10), range(10, 30))
    assert stage_layer_ranges(30, 3, [8, 22]) == (range(0, 8), range(8, 22), range(22, 30))
    assert stage_layer_range(30, 4, 3, (1, 2, 3)) == range(3, 30)  # pp need not divide them
    assert stage_layer_ranges(30, 2) == (range(0, 15), range(15, 30))  # default: equal


@pytest.mark.parametrize(("pp", "points", "message"), [
    (2, (10, 20), r"has 2 point\(s\), but pp=2 stages need 1"),
    (3, (20, 10), r"must be strictly increasing"),
    (3, (10, 10), r"must be strictly increasing"),
    (2, (0,), r"each point must be in 1\.\.29"),
    (2, (30,), r"each point must be in 1\.\.29"),
    (2, ("10",), r"must be ints"),
    (31, tuple(range(1, 31)), r"pp=31 exceeds num_layers=30"),
])
def test_bad_split_points_are_refused_saying_what_is_allowed(pp, points, message):
    with pytest.raises(LayerSplitError, match=message):
        check_split_points(30, pp, points)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.just(n), st.sets(st.integers(1, n - 1), max_size=n - 1) if n > 1 else st.just(set()))))
def test_any_valid_points_cover_every_layer_once_in_order(case):
    num_layers, points = case
    ranges = stage_layer_ranges(num_layers, len(points) + 1, sorted(points))
    assert [i for r in ranges for i in r] == list(range(num_layers))
    assert all(len(r) >= 1 for r in ranges)


# ---- the balancer --------------------------------------------------------------------------------
def _brute_force(num_layers, pp, time):
    best = None
    for points in itertools.combinations(range(1, num_layers), pp - 1):
        ranges = stage_layer_ranges(num_layers, pp, points)
        slowest = max(time(r, s == pp - 1) for s, r in enumerate(ranges))
        best = slowest if best is None else min(best, slowest)
    return best


@given(costs=st.lists(st.floats(0.1, 10), min_size=1, max_size=12), pp=st.integers(1, 5),
       head=st.floats(0, 40), fixed=st.floats(0, 2))
def test_the_balanced_split_is_the_brute_force_minimum_of_the_slowest_stage(costs, pp, head, fixed):
    pp = min(pp, len(costs))

    def time(layers, last):
        return sum(costs[i] for i in layers) + fixed + (head if last else 0.0)

    points = balanced_split_points(len(costs), pp, time)
    got = max(time(r, s == pp - 1) for s, r in enumerate(stage_layer_ranges(len(costs), pp, points)))
    assert got <= _brute_force(len(costs), pp, time) * (1 + 1e-6)


# ---- the planner ---------------------------------------------------------------------------------
def _pricer(model, layout):
    planner = Planner()
    dev = planner.device_figures(ATLAS)
    from kthena_core.planner import _TopologyView

    links = _TopologyView(ATLAS, planner.params).links(layout.tp, layout.pp, layout.dp)
    return StagePricer(model, WORKLOAD, layout, dev, links, WORKLOAD.concurrency)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_large_lm_head_moves_the_split_to_the_brute_force_best(pp):
    layout = Layout(1, pp, 1)
    plan = _PinnedPlanner(layout).plan(BIG_HEAD, ATLAS, WORKLOAD)
    split = plan.chosen.split
    assert split.source == "balanced" and plan.pipeline_split_points == split.points
    stage_layers = split.stage_layers(8)
    assert stage_layers[-1] < stage_layers[0]  # the LM head's stage gets fewer layers
    time = _pricer(BIG_HEAD, layout).time
    assert max(split.stage_seconds) <= _brute_force(8, pp, time) * (1 + 1e-6)
    assert max(split.equal_stage_seconds) > (1 + UNEVEN_THRESHOLD) * max(split.stage_seconds)
    # the estimate is the moved split's: faster than the same layout cut into equal stages
    equal = Planner().evaluate(BIG_HEAD, ATLAS, WORKLOAD, layout,
                               split_points=tuple(range(8 // pp, 8, 8 // pp)))
    assert plan.chosen.estimate.tpot_s < equal.estimate.tpot_s
    # ... and the plan says so, in text and JSON
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("pipeline"))
    assert f"split moved to {list(split.points)}" in line and "unbalanced" in line
    data = json.loads(json.dumps(plan.to_dict()))["pipeline_split"]
    assert (data["points"], data["source"]) == (list(split.points), "balanced")
    assert data["stage_layers"] == list(stage_layers)


def test_balanced_ends_keep_the_equal_split():
    plan = _PinnedPlanner(Layout(1, 2, 1)).plan(SMALL_HEAD, ATLAS, WORKLOAD)
    assert plan.chosen.split.source == "equal" and plan.pipeline_split_points is None
    assert "pipeline  equal stages (4+4 layers)" in format_plan(plan)
    one = _PinnedPlanner(Layout(1, 1, 1)).plan(BIG_HEAD, ATLAS, WORKLOAD)
    assert one.chosen.split is None and "\npipeline" not in format_plan(one)


def test_the_planner_picks_among_moved_splits_by_its_own_cost():
    plan = Planner().plan(BIG_HEAD, ATLAS, WORKLOAD)
    feasible = [e for e in plan.evaluations if e.feasible]
    assert plan.chosen.cost == min(e.cost for e in feasible)
    assert any(e.split is not None and e.split.source == "balanced" for e in feasible)


# ---- the config ----------------------------------------------------------------------------------
def _config(pp, points, **parallelism):
    return load_config({"cluster": {"world_size": pp}, "model": {"checkpoint_path": "default"},
                        "parallelism": {"strategy": "pp", "pipeline_parallel_size": pp,
                                        "pipeline_split_points": points, **parallelism}})


def test_yaml_split_points_are_planned_as_given():
    cfg = _config(2, [10])
    assert cfg.parallelism.pipeline_split_points == (10,)
    plan = plan_config(cfg, ATLAS)
    assert plan.pipeline_split_points == (10,) and plan.chosen.split.source == "config"
    assert plan.chosen.split.stage_layers(30) == (10, 20)
    assert "split at [10] (10+20 layers; parallelism.pipeline_split_points)" in format_plan(plan)
    # four stages of 30 layers: not equal stages, so only with split points
    four = plan_config(_config(4, [8, 16, 23]), from_catalog("atlas-800t-a2", 1))
    assert four.chosen.split.stage_layers(30) == (8, 8, 7, 7)


@pytest.mark.parametrize(("pp", "points", "message"), [
    (2, [10, 20], "a list of 1 strictly increasing layer indices >= 1 for pipeline_parallel_size 2"),
    (3, [20, 10], "a list of 2 strictly increasing layer indices"),
    (2, 10, "a list of 1 strictly increasing"),
    (2, [0], "a list of 1 strictly increasing layer indices >= 1"),
])
def test_bad_yaml_split_points_are_refused_by_key(pp, points, message):
    with pytest.raises(ConfigError, match=r"^parallelism\.pipeline_split_points: got .*allowed: "):
        _config(pp, points)
    with pytest.raises(ConfigError, match=message):
        _config(pp, points)


def test_yaml_split_points_beyond_the_models_layers_are_refused_when_planned():
    with pytest.raises(ConfigError, match=r"pipeline_split_points: .*each point must be in 1\.\.29"):
        plan_config(_config(2, [30]), ATLAS)
    with pytest.raises(ConfigError, match="unset with strategy auto"):
        load_config({"parallelism": {"strategy": "auto", "pipeline_split_points": [10]}})


# ---- the manifests -------------------------------------------------------------------------------
def _deploy_test_helpers():
    """test_deploy_k8s's CRD check and pod reader (tests import in importlib mode: by path)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_deploy_k8s_helpers", Path(__file__).with_name("test_deploy_k8s.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_against_crd, module.pods


def test_the_rendered_serve_command_carries_the_moved_split(tmp_path):
    check_against_crd, pods = _deploy_test_helpers()
    from kthena_core.deploy import load_deploy_spec, plan_deployment, render_manifests

    folder = tmp_path / "big-head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8,
        "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False}))
    spec = load_deploy_spec({"name": "big-head", "image": "kthena-worker:test",
                             "model": str(folder), "checkpoint": "/mnt/models/big-head",
                             "topology": "atlas-800t-a2", "num_nodes": 1,
                             "workload": {"prompt_len": 128, "output_len": 64, "concurrency": 2}})
    dep = plan_deployment(spec, _PinnedPlanner(Layout(1, 2, 1)))
    docs = render_manifests(dep)
    for doc in docs:
        check_against_crd(doc)
    serving = next(d for d in docs if d["kind"] == "ModelServing")
    args = pods(serving)["serve"]["args"]
    points = dep.plan.pipeline_split_points
    assert points is not None
    assert args[args.index("--pp") + 1] == "2"
    assert args[args.index("--pipeline-split-points") + 1] == ",".join(map(str, points))
    # kthena_serve's test_pp.py parses this command with kthena serve's own parser
