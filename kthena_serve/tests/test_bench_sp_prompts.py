"""`kthena bench layouts --sp-prompts`'s parts: the prompt-length flag, the collectives it
measures (two real gloo ranks), the planner's predictions and the table. The full run (two
servers, 2K-8K prompts) is a benchmark, not a test: docs/bench_layouts.md has its figures."""

from __future__ import annotations

import pytest

from kthena_serve.bench.sp_prompts import (
    format_sp_table,
    measure_collectives,
    parse_prompt_lens,
    predict_sp,
)


def test_prompt_lengths_are_sorted_and_deduplicated():
    assert parse_prompt_lens("8191, 2048,4096,2048") == (2048, 4096, 8191)


@pytest.mark.parametrize("text", ["", "2k", "1", "2048,-3"])
def test_a_bad_prompt_length_is_refused_with_an_example(text):
    with pytest.raises(ValueError, match="--sp-prompts: "):
        parse_prompt_lens(text)


def test_collectives_are_timed_over_two_gloo_ranks():
    result = measure_collectives([64, 255], hidden=32, repeat=3)
    assert set(result["sizes"]) == {"64", "256"}  # odd sizes are padded to split evenly
    for times in result["sizes"].values():
        assert min(times["all_reduce"], times["reduce_scatter"], times["all_gather"]) > 0
        factor = (times["reduce_scatter"] + times["all_gather"]) / times["all_reduce"]
        assert times["sp_collective_factor"] == pytest.approx(factor)


def test_predictions_price_the_measured_collectives():
    from kthena_core.config_plan import resolve_topology
    from kthena_core.cost_model import CostParams
    from kthena_core.known_models import load_model_spec

    model, cores = load_model_spec("default"), resolve_topology("auto:cores", measure=False)
    plain = predict_sp(model, 4096, 1, CostParams(), cores)
    ring = predict_sp(model, 4096, 2, CostParams(), cores)
    slow = predict_sp(model, 4096, 2, CostParams(sp_collective_factor=2.0), cores)
    assert ring["ttft_s"] < plain["ttft_s"] < slow["ttft_s"]
    assert ring["activations_mib"] < plain["activations_mib"]


def test_the_table_puts_each_sp_row_beside_its_plain_tp_row():
    def row(n, sp, ttft, predicted):
        return {"prompt_len": n, "sp": sp,
                "measured": {"ttft_s": ttft, "ttft_s_min": ttft * 0.9,
                             "prefill_tok_s": n / ttft, "peak_rss_mib_per_rank": [900.0, 700.0]},
                "predicted_default": {"ttft_s": predicted},
                "predicted_measured_collectives": {"ttft_s": predicted, "activations_mib": 12.5}}

    result = {"rows": [row(2048, 1, 1.0, 1.2), row(2048, 2, 1.1, 1.26)],
              "collectives": {"sizes": {"2048": {"sp_collective_factor": 1.5}}},
              "machine": {"cpu": "Test CPU", "cores": 2, "loadavg_before": [1.0],
                          "loadavg_after": [2.0]}}
    table = format_sp_table(result).splitlines()
    assert table[2] == "| 2048 | off | 1000 (900) / 1200 / 1200 | 2048 | 900 / 700 | 12.5 | - |"
    assert table[3].endswith("| 1.10 / 1.05 |")
    assert "2048: 1.50" in table[5] and "Test CPU, 2 cores" in table[7]


@pytest.mark.parametrize(("argv", "message"), [
    (["--sp-plot", "x.png"], "--sp-plot draws the --sp-prompts run"),
    (["--sp-prompts", "2k"], "--sp-prompts: '2k' is not comma-separated prompt lengths"),
    (["--sp-prompts", "64", "--runs", "0"], "--runs must be >= 1"),
])
def test_the_flags_are_checked_before_anything_starts(capsys, argv, message):
    from kthena_core.cli import main

    assert main(["bench", "layouts", *argv]) == 2
    assert message in capsys.readouterr().err
