"""The grouped-kernel choice: injected timings decide (no test reads this machine's speed), the
split rule keeps one copy of the experts, the cache in a folder of the test's own."""

from __future__ import annotations

import json

import pytest
import torch

import mooncake_ops as mo
from mooncake_ops import moe_selection as ms
from mooncake_ops.kernel_cache import MachineLoad
from mooncake_ops.moe_kernels import GROUPED_MM, LOOP, PADDED_BMM, GroupedKernel
from mooncake_ops.selection import cached_choices

QUIET = MachineLoad(0.0, 2)
BUSY = MachineLoad(8.0, 2)


def _weights(dtype=torch.float32, experts=4):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(experts, 32, 16, generator=gen).to(dtype),
            torch.randn(experts, 16, 16, generator=gen).to(dtype))


class Timings:
    """A timer that runs nothing and answers from a table: ``(family, kernel) -> seconds``."""

    def __init__(self, table: dict[tuple[str, str], float]) -> None:
        self.table, self.labels = table, []

    def __call__(self, label: str, fn) -> float:
        self.labels.append(label)
        family, kernel, _ = label.split(":")
        return self.table[(family, kernel)]


@pytest.fixture
def three_candidates(monkeypatch):
    """The candidates this test names, whatever this machine offers (all dense layout)."""
    monkeypatch.setattr(ms, "grouped_candidates", lambda weight: (LOOP, PADDED_BMM, GROUPED_MM))


def _table(decode: dict[str, float], prefill: dict[str, float]):
    return Timings({**{("moe_decode", k): v for k, v in decode.items()},
                    **{("moe_prefill", k): v for k, v in prefill.items()}})


def test_each_class_runs_its_winner_when_the_split_pays(three_candidates):
    timer = _table({"torch-loop": 1e-3, "torch-padded-bmm": 9e-3, "torch-grouped-mm": 2e-3},
                   {"torch-loop": 9e-3, "torch-padded-bmm": 3e-3, "torch-grouped-mm": 8e-3})
    gate_up, down = _weights()
    choice = ms.choose_moe_kernels("auto", gate_up, down, 2, timer=timer, load=lambda: QUIET)
    assert (choice.decode, choice.prefill, choice.source) == ("torch-loop", "torch-padded-bmm",
                                                               "measured")
    assert choice.timings_ms["moe_decode"]["torch-loop"] == 2.0  # 1 and 8 tokens, summed
    assert sorted({label.rsplit(":", 1)[1] for label in timer.labels}) == ["1", "256", "8"]
    experts = mo.pack_experts(gate_up, down, **choice.pack_args())
    assert (experts.decode, experts.prefill, experts.decode_max_rows) == (LOOP, PADDED_BMM, 32)


def test_one_kernel_runs_both_when_it_is_within_the_split_loss(three_candidates):
    timer = _table({"torch-loop": 1.0e-3, "torch-padded-bmm": 5e-3, "torch-grouped-mm": 1.1e-3},
                   {"torch-loop": 4e-3, "torch-padded-bmm": 5e-3, "torch-grouped-mm": 3.5e-3})
    gate_up, down = _weights()
    choice = ms.choose_moe_kernels("auto", gate_up, down, 1, timer=timer, load=lambda: QUIET)
    assert (choice.decode, choice.prefill) == ("torch-grouped-mm", "torch-grouped-mm")


def test_a_split_across_layouts_becomes_the_kernel_with_the_best_worst_ratio():
    times_d = {"a": 1.0, "b": 3.0, "c": 1.5}
    times_p = {"a": 3.0, "b": 1.0, "c": 1.6}
    assert ms.one_layout(times_d, times_p, {"a": "dense", "b": "dense", "c": "dense"}) == (
        "a", "b")
    assert ms.one_layout(times_d, times_p, {"a": "dense", "b": "packed", "c": "dense"}) == (
        "c", "c")


def test_failing_candidates_are_left_out_and_logged(monkeypatch, caplog):
    def broken_pack(gate_up, down):
        raise RuntimeError("no such instruction here")

    broken = GroupedKernel("torch-grouped-mm", "dense", broken_pack, LOOP.run)
    monkeypatch.setattr(ms, "grouped_candidates", lambda weight: (LOOP, broken))
    timer = _table({"torch-loop": 1e-3}, {"torch-loop": 1e-3})
    gate_up, down = _weights()
    choice = ms.choose_moe_kernels("auto", gate_up, down, 1, timer=timer, load=lambda: QUIET)
    assert (choice.decode, choice.timings_ms["moe_decode"]["torch-grouped-mm"]) == (
        "torch-loop", None)
    assert "no such instruction here" in caplog.text


def test_the_measurement_is_cached_and_a_busy_one_timed_again(three_candidates, tmp_path):
    timer = _table({"torch-loop": 1e-3, "torch-padded-bmm": 2e-3, "torch-grouped-mm": 3e-3},
                   {"torch-loop": 1e-3, "torch-padded-bmm": 2e-3, "torch-grouped-mm": 3e-3})
    gate_up, down = _weights()
    first = ms.choose_moe_kernels("auto", gate_up, down, 2, cache_dir=tmp_path, timer=timer,
                                  load=lambda: BUSY)
    assert first.provisional and "provisional" in first.summary()
    calls = len(timer.labels)
    second = ms.choose_moe_kernels("auto", gate_up, down, 2, cache_dir=tmp_path, timer=timer,
                                   load=lambda: QUIET)
    assert len(timer.labels) == 2 * calls and second.source == "measured"  # timed again
    third = ms.choose_moe_kernels("auto", gate_up, down, 2, cache_dir=tmp_path, timer=timer,
                                  load=lambda: QUIET)
    assert len(timer.labels) == 2 * calls and third.source == "cached"
    assert (third.decode, third.prefill, third.top_k) == (second.decode, second.prefill, 2)
    records = list((tmp_path / "kernels").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["kind"] == "moe"
    assert cached_choices(tmp_path) == []  # not a linear choice: skipped there


def test_fixed_modes_time_nothing():
    def no_timing(label, fn):
        raise AssertionError(f"timed {label}")

    gate_up, down = _weights(torch.bfloat16)
    torch_choice = ms.choose_moe_kernels("torch", gate_up, down, 2, timer=no_timing)
    assert (torch_choice.decode, torch_choice.source) == ("torch-loop", "fixed")
    native = ms.choose_moe_kernels("native", gate_up, down, 2, timer=no_timing)
    expected = mo.select_linear_kernel(gate_up).name  # bf16 on the CPU: always a kernel
    assert native.decode == native.prefill == expected
    meta = ms.choose_moe_kernels("auto", gate_up.to("meta"), down.to("meta"), 2, timer=no_timing)
    assert meta.decode == "torch-loop" and meta.source == "fixed"  # off the CPU: no timing


def test_misuse_is_refused_before_timing():
    gate_up, down = _weights()
    with pytest.raises(ValueError, match="one of auto, native, torch"):
        ms.choose_moe_kernels("fastest", gate_up, down, 2)
    with pytest.raises(ValueError, match=r"top_k=5 must be in 1\.\.4"):
        ms.choose_moe_kernels("torch", gate_up, down, 5)
    with pytest.raises(mo.OpsShapeError, match="down"):
        ms.choose_moe_kernels("torch", gate_up, down[:, :8], 2)
