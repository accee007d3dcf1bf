"""Pipeline parallelism's parts, in one process: the stage split (equal, or cut at
``pipeline_split_points``), micro-batches, a chain of stages equal to the whole model, and the
refusals; an uneven split through the engine's spawned ranks on a tiny model, and its flag,
YAML key and rendered deploy command. The multi-process runs are in
test_parity.py (PP=2, TP=2 x PP=2 against transformers) and test_two_hosts.py."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.shape import LayerSplitError, check_pp, stage_layer_range, stage_layer_ranges
from kthena_serve.engine.parallel_runner import split_microbatches
from kthena_serve.engine.scheduled import ScheduledBatch, ScheduledSeq
from kthena_serve.model import PipelineStage, TensorParallelError
from kthena_serve.model.errors import BatchError


def _batch(lengths: list[int]) -> ScheduledBatch:
    return ScheduledBatch(tuple(ScheduledSeq(f"r{i}", tuple(range(n)), 0, (i,), True)
                                for i, n in enumerate(lengths)))


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 6))
def test_microbatches_are_contiguous_nonempty_and_at_most_parts(lengths, parts):
    batch = _batch(lengths)
    runs = split_microbatches(batch, parts)
    assert tuple(s for run in runs for s in run.seqs) == batch.seqs
    assert all(run.seqs for run in runs)
    assert len(runs) == min(parts, len(lengths))


def test_microbatches_balance_tokens():
    runs = split_microbatches(_batch([1] * 8), 2)  # eight decodes: four each
    assert [len(r.seqs) for r in runs] == [4, 4]
    runs = split_microbatches(_batch([100, 1, 1, 1, 1]), 2)  # a prefill chunk and four decodes
    assert [r.num_tokens for r in runs] == [100, 4]


def test_stages_cover_the_layers_once_in_order():
    ranges = [stage_layer_range(30, 3, s) for s in range(3)]
    assert ranges == [range(0, 10), range(10, 20), range(20, 30)]
    stage = PipelineStage.of(30, 2, 1)
    assert (stage.is_first, stage.is_last, stage.layers) == (False, True, range(15, 30))


@pytest.mark.parametrize(("layers", "pp", "message"), [
    (30, 4, "pp=4 does not divide num_layers=30 into equal stages; allowed pp: 1, 2, 3, 5, 6"),
    (30, 0, "must both be >= 1"),
])
def test_a_pp_the_layers_cannot_take_is_refused_with_the_allowed_sizes(layers, pp, message):
    with pytest.raises(LayerSplitError, match=message):
        check_pp(layers, pp)
    with pytest.raises(TensorParallelError, match="pipeline parallelism: "):
        PipelineStage.of(layers, pp, 0)


@pytest.fixture(scope="module")
def stages():
    from kthena_serve.model import load_model

    whole, _ = load_model("default", dtype=torch.float32)
    parts = [load_model("default", dtype=torch.float32, stage=PipelineStage.of(30, 2, s))[0]
             for s in range(2)]
    return whole, parts


def _caches(model, blocks=8):
    shape = (blocks, 16, model.num_kv_heads_per_rank, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]


def test_each_stage_loads_only_its_layers_and_ends(stages):
    _, (first, last) = stages
    assert (len(first.layers), len(last.layers)) == (15, 15)
    assert first.norm is None and first.lm_head_weight is None
    assert last.norm is not None and last.lm_head_weight is not None  # tied: embedding table too
    # stage 1's layer 0 is the checkpoint's layer 15
    whole = stages[0]
    assert torch.equal(last.layers[0].input_norm, whole.layers[15].input_norm)


def test_two_stages_chained_give_the_whole_models_logits(stages):
    from kthena_serve.engine.model_inputs import build_inputs

    whole, (first, last) = stages
    batch = _batch([11, 7])
    batch = ScheduledBatch(tuple(ScheduledSeq(s.request_id, tuple(range(5, 5 + len(s.token_ids))),
                                              0, (i,), True) for i, s in enumerate(batch.seqs)))
    inputs = build_inputs(batch, 16)
    args = (inputs.input_ids, inputs.positions, inputs.attention)
    with torch.inference_mode():
        expected = whole(*args, _caches(whole))
        hidden = first.forward_stage(*args, _caches(first))
        got = last.forward_stage(*args, _caches(last), hidden)
    assert isinstance(hidden, tuple) and hidden[0].shape == (18, 576)
    torch.testing.assert_close(got, expected)
    with pytest.raises(BatchError, match="holds pipeline stage 0 of 2; run it with forward_stage"):
        first(*args, _caches(first))
    with pytest.raises(BatchError, match="every later stage the previous stage's"):
        last.forward_stage(*args, _caches(last))


def test_kthena_run_serve_is_kthena_serve_on_every_rank(capsys):
    from kthena_core.launcher import main

    assert main(["--nnodes", "1", "--nproc_per_node", "2", "--pp", "2", "--backend", "gloo",
                 "--dry-run", "serve", "--pp", "2"]) == 0
    assert "--module kthena_core.cli serve --pp 2" in capsys.readouterr().out


def test_kthena_run_names_the_interface_that_reaches_the_master(capsys):
    from kthena_core.launcher import gloo_interface, main

    assert gloo_interface("127.0.0.1") == "lo"
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    assert main(["--nnodes", "2", "--node_rank", "0", "--nproc_per_node", "1", "--pp", "2",
                 "--master_addr", "127.0.0.1", "--backend", "gloo", "--dry-run", "serve"]) == 0
    assert "GLOO_SOCKET_IFNAME=lo" in capsys.readouterr().out


@pytest.mark.parametrize(("env", "flags", "message"), [
    ({"WORLD_SIZE": "2", "RANK": "1"}, ["--pp", "3"],
     "WORLD_SIZE=2, but --tp 1 x --pp 3 needs 3 ranks"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, ["--pp", "2", "--mode", "pd"],
     "--mode pd and --dp start their own processes"),
    ({"WORLD_SIZE": "two"}, [], "WORLD_SIZE='two' (set by kthena-run / torchrun) must be an int"),
])
def test_kthena_serve_under_a_launcher_refuses_a_world_it_cannot_run(env, flags, message,
                                                                    monkeypatch, capsys):
    from kthena_core.cli import main

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", *flags, "--port", "0"]) == 2  # refused before anything loads
    assert message in capsys.readouterr().err


# ---- uneven splits: pipeline_split_points -----------------------------------------------------------
def test_split_points_cut_the_stages_where_asked():
    first, last = (PipelineStage.of(30, 2, s, (10,)) for s in range(2))
    assert (first.layers, last.layers) == (range(0, 10), range(10, 30))
    assert PipelineStage.of(30, 4, 3, (8, 16, 23)).layers == range(23, 30)  # 4 does not divide 30
    with pytest.raises(TensorParallelError, match=r"pipeline parallelism: pipeline_split_points="
                                                  r"\[30\]: each point must be in 1\.\.29"):
        PipelineStage.of(30, 2, 0, (30,))


@pytest.fixture(scope="module")
def uneven_stages(stages):
    from kthena_serve.model import load_model

    return [load_model("default", dtype=torch.float32,
                       stage=PipelineStage.of(30, 2, s, (10,)))[0] for s in range(2)]


def test_uneven_stages_chained_give_the_whole_models_logits(stages, uneven_stages):
    from kthena_serve.engine.model_inputs import build_inputs

    whole, (first, last) = stages[0], uneven_stages
    assert (len(first.layers), len(last.layers)) == (10, 20)
    assert torch.equal(last.layers[0].input_norm, whole.layers[10].input_norm)
    batch = ScheduledBatch(tuple(ScheduledSeq(f"r{i}", tuple(range(3 + i, 3 + i + n)), 0, (i,), True)
                                 for i, n in enumerate([9, 5])))
    inputs = build_inputs(batch, 16)
    args = (inputs.input_ids, inputs.positions, inputs.attention)
    with torch.inference_mode():
        expected = whole(*args, _caches(whole))
        got = last.forward_stage(*args, _caches(last), first.forward_stage(*args, _caches(first)))
    torch.testing.assert_close(got, expected)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    from _tiny import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("six-layers"), num_hidden_layers=6)


def _tiny_engine(checkpoint, **fields):
    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.config import EngineConfig

    return LLMEngine.from_config(EngineConfig(model=str(checkpoint), dtype="float32",
                                              kernels="torch", block_size=4,
                                              max_num_batched_tokens=64, **fields))


def _greedy(engine, prompts, max_tokens=8):
    from kthena_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: list(o.token_ids) for o in engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(prompts))]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 45))]


@pytest.mark.parametrize(("pp", "points"), [(2, (2,)), (3, (1, 5))])
def test_an_uneven_pipeline_engine_is_token_identical_to_one_process(six_layers, pp, points):
    """Spawned ranks, each stage holding exactly its layers and a KV pool for them: the same
    greedy tokens as the single-process engine."""
    single = _tiny_engine(six_layers, num_kv_blocks=64)
    try:
        expected = _greedy(single, PROMPTS)
    finally:
        single.close()
    engine = _tiny_engine(six_layers, num_kv_blocks=64, pp=pp, pipeline_split_points=points)
    try:
        counts = [len(r) for r in stage_layer_ranges(6, pp, points)]
        # each rank's pool: its buffer and a (K, V) pair per layer it holds
        assert [p.num_pool_tensors for p in engine.runner.placements()] == [1 + 2 * n for n in counts]
        assert _greedy(engine, PROMPTS) == expected
    finally:
        engine.close()


def test_the_shared_block_count_is_sized_for_the_stage_with_the_most_layers(six_layers):
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.parallel_runner import ParallelModelRunner

    def blocks(**fields):
        config = EngineConfig(model=str(six_layers), block_size=4, kv_cache_memory="1MiB",
                              **fields)
        return ParallelModelRunner._fixed_pool_size(config).num_kv_blocks

    one_layer = blocks(pp=2, pipeline_split_points=(5,)) * 5  # the 5-layer stage sets the count
    assert blocks(pp=2) * 3 == pytest.approx(one_layer, rel=0.01)  # equal: 3 layers per stage
    assert blocks(pp=2, pipeline_split_points=(1,)) == blocks(pp=2, pipeline_split_points=(5,))
    with pytest.raises(TensorParallelError, match=r"each point must be in 1\.\.5"):
        blocks(pp=2, pipeline_split_points=(6,))


def test_bad_split_points_stop_the_engine_before_any_rank_starts(six_layers):
    import multiprocessing

    with pytest.raises(TensorParallelError, match=r"pipeline_split_points=\[6\]: each point "
                                                  r"must be in 1\.\.5 \(6 layers"):
        _tiny_engine(six_layers, num_kv_blocks=64, pp=2, pipeline_split_points=(6,))
    assert multiprocessing.active_children() == []  # refused before a rank was spawned
    from kthena_serve.engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"pipeline_split_points must be None \(equal stages\) "
                                          r"or 2 strictly increasing"):
        _tiny_engine(six_layers, pp=3, pipeline_split_points=(4,))


def _spec(*argv):
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args

    return spec_from_args(build_parser().parse_args(["serve", *argv]))


def test_the_flag_reaches_the_engine_config_and_the_served_layout():
    spec = _spec("--pp", "3", "--pipeline-split-points", "8,22")
    assert spec.engine.pipeline_split_points == (8, 22)
    assert spec.served()["pipeline_split_points"] == [8, 22]
    assert "pipeline_split_points" not in _spec("--pp", "2").served()


@pytest.mark.parametrize(("argv", "message"), [
    (["--pp", "2", "--pipeline-split-points", "ten"],
     "'ten' is not comma-separated layer indices"),
    (["--pipeline-split-points", "10"],
     "--pipeline-split-points: EngineConfig.pipeline_split_points must be None with pp=1"),
    (["--pp", "2", "--pipeline-split-points", "10,20"],
     "must be None (equal stages) or 1 strictly increasing positive int(s) for pp=2"),
])
def test_a_bad_flag_is_refused_in_one_line(argv, message, capsys):
    from kthena_core.cli import main

    try:
        code = main(["serve", "--port", "0", *argv])
    except SystemExit as exit_:  # argparse's own refusal of the flag's text
        code = exit_.code
    assert code == 2  # refused before anything loads
    assert message in capsys.readouterr().err


def test_yaml_split_points_reach_the_engine_through_the_spec(tmp_path):
    from kthena_serve.planned import plan_config_path

    path = tmp_path / "kthena_config.yaml"
    path.write_text("cluster: {topology: atlas-800t-a2, world_size: 2}\n"
                    "parallelism: {strategy: pp, pipeline_parallel_size: 2, "
                    "pipeline_split_points: [10]}\n")
    spec = _spec("--config", str(path))
    assert (spec.engine.pp, spec.engine.pipeline_split_points) == (2, (10,))
    assert spec.plan["pipeline_split"]["points"] == [10]
    assert plan_config_path(str(path)).plan.pipeline_split_points == (10,)
    # a --pp flag of its own drops the config's points (they cut the config's pp)
    assert _spec("--config", str(path), "--pp", "3").engine.pipeline_split_points is None


def test_the_rendered_deploy_command_builds_the_split_engine(tmp_path):
    """What `kthena deploy k8s` renders for a plan that moved the split (kthena_core's
    test_pipeline_split.py) is read back by kthena serve's own parser."""
    import json

    from kthena_core.config_plan import _PinnedPlanner
    from kthena_core.deploy import load_deploy_spec, plan_deployment, render_model_serving
    from kthena_core.layout import Layout

    folder = tmp_path / "big-head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8,
        "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False}))
    dep = plan_deployment(load_deploy_spec({
        "name": "big-head", "image": "kthena-worker:test", "model": str(folder),
        "checkpoint": "/mnt/models/big-head", "topology": "atlas-800t-a2", "num_nodes": 1,
        "workload": {"prompt_len": 128, "output_len": 64, "concurrency": 2}}),
        _PinnedPlanner(Layout(1, 2, 1)))
    serving = render_model_serving(dep)
    container = serving["spec"]["template"]["roles"][0]["entryTemplate"]["spec"]["containers"][0]
    assert container["command"] == ["kthena"]
    args = container["args"][1:]
    args[args.index("--device") + 1] = "cpu"  # the pod's Ascend devices: not on this host
    spec = _spec(*args)
    assert spec.engine.pipeline_split_points == dep.plan.pipeline_split_points is not None
    assert spec.engine.pp == 2
