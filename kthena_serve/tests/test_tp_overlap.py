"""TP overlap (`kthena_serve.model.overlap`): every matmul + TP collective as one MC2 op.

Two gloo processes (`_tp_overlap_worker.py`) check the fused ops against the matmul-then-
collective reference on fresh random inputs, and run test_sp's scenarios (a batch of 97 tokens,
a 101-token prompt whole and in chunks, a short one, prefix hits) over a tiny random Llama with
SmolLM2's uneven head split on TP=2 plain and with MC2, with and without SP, and SmolLM2 itself
on one batch: tokens must be identical, and the fused-op counts say which path each forward
took. Then the engine (spawned ranks, scheduler) with ``tp_overlap``, and the refusals.
"""

from __future__ import annotations

import json
import os

import pytest
from _ranks import HERE, run_two_ranks
from test_sp import engine_prompts, engine_tokens, uneven_checkpoint  # noqa: F401

from kthena_serve.engine.config import EngineConfig
from kthena_serve.model import MC2Overlap, TensorParallel, TensorParallelError

SCENARIOS = ["batched_uneven", "single_101", "chunked_101", "short", "prefix_hit"]
# (forwards in all, forwards SP splits: prefill ones of >= 16 tokens) per scenario
FORWARDS = {"batched_uneven": (8, 1), "single_101": (8, 1), "chunked_101": (12, 4),
            "short": (8, 0), "prefix_hit": (10, 3)}


@pytest.fixture(scope="module")
def parity(uneven_checkpoint, tmp_path_factory):  # noqa: F811
    """Both ranks' results (see _tp_overlap_worker.py), after both exited cleanly."""
    out = tmp_path_factory.mktemp("tp_overlap")
    run_two_ranks(lambda rank, port: [os.path.join(HERE, "_tp_overlap_worker.py"), str(rank),
                                      port, str(uneven_checkpoint),
                                      str(out / f"rank{rank}.json"), "real"])
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_fused_ops_match_matmul_then_collective_on_random_inputs(parity):
    for rank in parity:
        assert len(rank["ops"]) == 3 * 4 * 3  # ops x tile counts x shapes
        over = {key: (err, bound) for key, (err, bound) in rank["ops"].items() if err > bound}
        assert over == {}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [*SCENARIOS, "real_batched_uneven"])
def test_mc2_tokens_equal_plain_tp(parity, scenario):
    for rank in parity:
        runs = rank[scenario]
        assert runs["mc2"]["tokens"] == runs["tp"]["tokens"]
        assert len(runs["mc2"]["tokens"][0]) == 8
        if "sp_mc2" in runs:
            assert runs["sp_mc2"]["tokens"] == runs["sp"]["tokens"] == runs["tp"]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_tp_collective_went_through_a_fused_op(parity, scenario):
    forwards, split = FORWARDS[scenario]
    for rank in parity:
        per_forward = 2 * rank["layers"]  # o_proj and down_proj
        runs = rank[scenario]
        assert runs["mc2"]["fused"] == {"matmul_all_reduce": per_forward * forwards,
                                        "all_gather_matmul": 0, "matmul_reduce_scatter": 0}
        assert runs["sp_mc2"]["fused"] == {"matmul_all_reduce": per_forward * (forwards - split),
                                           "all_gather_matmul": per_forward * split,
                                           "matmul_reduce_scatter": per_forward * split}


@pytest.mark.slow
def test_engine_with_tp_overlap_matches_plain_tp(uneven_checkpoint):  # noqa: F811
    """Through the engine: TP=2 with MC2 (3 tiles) and SP against plain TP=2, a 101-token
    prompt prefilled in 48-token chunks beside a 23-token one, then the first again."""
    prompts = engine_prompts()

    def fused_ops(model):  # noqa: ANN001, ANN202 - rank 0's fused collectives
        return model.tp.fused

    wired, *fused = engine_tokens(uneven_checkpoint, prompts, fused_ops, tp=2, sp=2,
                                  sp_min_tokens=16, tp_overlap=True, tp_overlap_tiles=3)
    none, *plain = engine_tokens(uneven_checkpoint, prompts, fused_ops, tp=2)
    assert isinstance(wired, MC2Overlap) and wired.num_tiles == 3 and none is None
    assert fused == plain
    assert len(fused[0][0]) == 8


def test_the_engine_config_refuses_overlap_where_it_cannot_run():
    cases = [({"tp_overlap": True}, "EngineConfig.tp_overlap must be False with tp = 1 (got "
                                    "True); TP overlap fuses each row-parallel matmul"),
             ({"tp": 2, "tp_overlap": True, "quantization": "int8"},
              "EngineConfig.tp_overlap must be False with quantization int8"),
             ({"tp": 2, "tp_overlap_tiles": 4}, "EngineConfig.tp_overlap_tiles must be None "
                                                "without tp_overlap (got 4)"),
             ({"tp": 2, "tp_overlap": True, "tp_overlap_tiles": 0},
              "EngineConfig.tp_overlap_tiles must be a positive int or None (got 0)")]
    for fields, message in cases:
        with pytest.raises(ValueError) as error:
            EngineConfig(**fields)
        assert str(error.value).startswith(message), str(error.value)
    assert EngineConfig(tp=2, tp_overlap=True, tp_overlap_tiles=4).tp_overlap_tiles == 4


def test_a_device_without_the_fused_op_is_refused_naming_it():
    """torch_npu is not installed here: npu overlap names the op it lacks (the EngineConfig
    check calls the same function, after refusing an npu this host does not have)."""
    from mooncake_ops import UnsupportedDeviceError
    from mooncake_ops.mc2 import require_fused

    with pytest.raises(UnsupportedDeviceError, match=r"MC2 overlap on npu needs torch_npu's "
                                                     r"MC2 ops \(npu_mm_all_reduce_base\)"):
        require_fused("npu", ("matmul_all_reduce",))
    with pytest.raises(UnsupportedDeviceError, match="runs on cpu .tiled., cuda and npu"):
        require_fused("mps")
    assert set(require_fused("cpu").values()) == {"torch-tiled (kthena_comm async collectives)"}


def test_overlap_needs_a_group_and_a_positive_tile_count():
    with pytest.raises(TensorParallelError, match="need world_size > 1"):
        TensorParallel(0, 1, fused=MC2Overlap(None))
    with pytest.raises(TensorParallelError, match="MC2Overlap.num_tiles must be a positive int"):
        MC2Overlap(None, 0)


def test_flags_and_the_configs_fused_communication_turn_it_on(tmp_path):
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args
    from kthena_serve.spec import ServeSpec

    spec = ServeSpec.resolve({"tp": 2, "tp_overlap": True, "tp_overlap_tiles": 2})
    assert (spec.engine.tp_overlap, spec.engine.tp_overlap_tiles) == (True, 2)
    with pytest.raises(ValueError, match="^--tp-overlap: EngineConfig.tp_overlap must be False "
                                         "with tp = 1"):
        ServeSpec.resolve({"tp_overlap": True})
    args = build_parser().parse_args(["serve", "--tp", "2", "--tp-overlap"])
    assert spec_from_args(args).engine.tp_overlap
    path = tmp_path / "kthena_config.yaml"
    path.write_text("cluster: {topology: 'auto:cores', world_size: 2}\n"
                    "parallelism: {strategy: tp, tensor_parallel_size: 2,\n"
                    "              fused_communication: true}\n")
    spec = spec_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    assert (spec.engine.tp, spec.engine.tp_overlap) == (2, True)
