"""``kthena bench moe``: a tiny MoE model against the dense model of equal active parameters.

A small run: both checkpoints written and loaded as the engine loads them, one JSON row per
model and a summary; the MoE model's active parameters are the dense model's plus its router,
and its total adds the experts no token of a step is routed to.
"""

from __future__ import annotations

import json

from kthena_serve.bench.moe import main


def test_a_small_run_prints_both_models_and_their_ratios(capsys):
    args = ["--hidden", "128", "--layers", "2", "--experts", "4", "--top-k", "2",
            "--expert-width", "64", "--prompt", "32", "--batch", "4", "--repeats", "2",
            "--rounds", "1", "--kernels", "native", "--dtype", "fp32"]
    assert main(args) == 0
    moe, dense, summary = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (moe["model"], dense["model"], summary["summary"]) == ("moe", "dense", "moe / dense")
    router = 2 * 128 * 4  # layers x hidden x experts
    assert moe["active_params"] == dense["params"] + router
    assert moe["params"] == moe["active_params"] + 2 * (4 - 2) * 3 * 128 * 64
    for key in ("prefill_ms", "decode_batch1_ms", "decode_batch4_ms"):
        assert moe[key] > 0 and dense[key] > 0
        assert summary[f"{key}_ratio"] == round(moe[key] / dense[key], 3)
    assert summary["cpu"] and summary["threads"] == 1


def test_bad_sizes_are_refused_by_name(capsys):
    assert main(["--hidden", "100"]) == 2
    assert main(["--experts", "4", "--top-k", "5"]) == 2
    err = capsys.readouterr().err
    assert "--hidden 100 must be a multiple of 128" in err
    assert "--top-k 5 must be in 1..--experts (4)" in err
