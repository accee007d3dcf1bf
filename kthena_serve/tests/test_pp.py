"""Pipeline parallelism's parts, in one process: the stage split, micro-batches, a chain of
stages equal to the whole model, and the refusals. The multi-process runs are in
test_parity.py (PP=2, TP=2 x PP=2 against transformers) and test_two_hosts.py."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.shape import LayerSplitError, check_pp, stage_layer_range
from kthena_serve.model import PipelineStage, TensorParallelError
from kthena_serve.model.errors import BatchError
from kthena_serve.parallel_runner import split_microbatches
from kthena_serve.scheduled import ScheduledBatch, ScheduledSeq


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
    from kthena_serve.model_inputs import build_inputs

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
