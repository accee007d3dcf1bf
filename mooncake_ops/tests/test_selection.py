"""Kernel choice by measurement (`mooncake_ops.selection`): the pick, the fallback, the cache
and its key, the split kernel, the dispatch override and the mode override.

Timings are injected through the ``timer(label, fn)`` argument and the machine's load through
``load``, so no assert depends on this machine's speed or on what else runs on it; the
candidates used are the two every CPU has (``torch-dense`` and ``bf16-fp32-compute``) unless a
test says otherwise.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time

import pytest
import torch
import torch.nn.functional as F

from mooncake_ops import dispatch
from mooncake_ops import kernel_timing as timing
from mooncake_ops import selection as sel
from mooncake_ops.linear import FP32_COMPUTE_BF16, TORCH_DENSE
from mooncake_ops.linear_int8 import INT8_DEQUANT_DENSE

ALWAYS = ("torch-dense", "bf16-fp32-compute")


def idle() -> sel.MachineLoad:
    return sel.MachineLoad(0.25, 2)


def busy() -> sel.MachineLoad:
    return sel.MachineLoad(1.9, 2)


def _layers(num_layers: int = 2, hidden: int = 32,
            seed: int = 0) -> list[list[timing.MatmulWeight]]:
    g = torch.Generator().manual_seed(seed)

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g).to(torch.bfloat16)

    return [[timing.MatmulWeight(w(3 * hidden, hidden)), timing.MatmulWeight(w(hidden, hidden)),
             timing.MatmulWeight(w(4 * hidden, hidden), gate_up=True),
             timing.MatmulWeight(w(hidden, 2 * hidden))] for _ in range(num_layers)]


class Timings:
    """An injected timer: seconds per (family, candidate) label prefix; every call counted;
    a candidate mapped to an exception raises it (a kernel that fails here)."""

    def __init__(self, table: dict[str, float | Exception], default: float = 1.0) -> None:
        self.table, self.default, self.calls = table, default, []

    def __call__(self, label: str, fn: object) -> float:
        self.calls.append(label)
        family, name = label.split(":")[:2]
        value = self.table.get(f"{family}:{name}", self.default)
        if isinstance(value, Exception):
            raise value
        return value


def test_fastest_takes_the_smallest_finite_time_and_refuses_all_failed():
    assert sel.fastest({"a": 2.0, "b": 1.0, "c": None, "d": math.inf}) == "b"
    with pytest.raises(RuntimeError, match="every candidate failed: a, b"):
        sel.fastest({"a": None, "b": math.inf})


def test_one_kernel_runs_both_classes_when_it_is_close_to_the_best_in_each():
    decode = {"x": 1.0, "y": 1.1}
    prefill = {"x": 1.15, "y": 1.0}
    # x is 1.15x the best at prefill, y 1.1x the best at decode: y's worst ratio is smaller
    assert sel.split_or_single(decode, prefill, loss=1.2) == ("y", "y")
    assert sel.split_or_single(decode, {"x": 2.0, "y": 1.0}, loss=1.2) == ("y", "y")
    assert sel.split_or_single({"x": 1.0, "y": 2.0}, {"x": 2.0, "y": 1.0}) == ("x", "y")


def test_auto_takes_the_fastest_candidate_per_class_from_injected_timings():
    timer = Timings({"matmul_decode:bf16-fp32-compute": 0.1, "matmul_decode:torch-dense": 1.0,
                     "matmul_prefill:bf16-fp32-compute": 5.0, "matmul_prefill:torch-dense": 1.0})
    layers = _layers()
    candidates = [k for k in sel.linear_candidates(layers[0][0].weight) if k.name in ALWAYS]
    found = timing.measure_linear(layers, None, candidates, timer)
    assert sel.split_or_single(found["decode"], found["prefill"]) == (
        "bf16-fp32-compute", "torch-dense")
    # every decode row count and the prefill pass of each candidate was timed
    assert {c.split(":")[0] for c in timer.calls} == {"matmul_decode", "matmul_prefill"}
    assert {int(c.split(":")[2]) for c in timer.calls} == {1, 8, timing.PREFILL_ROWS}


def test_a_candidate_that_fails_is_left_out_and_the_next_fastest_runs():
    timer = Timings({"matmul_decode:bf16-fp32-compute": RuntimeError("no such kernel here"),
                     "matmul_prefill:bf16-fp32-compute": 0.1, "matmul_decode:torch-dense": 1.0,
                     "matmul_prefill:torch-dense": 1.0})
    layers = _layers()
    candidates = [k for k in sel.linear_candidates(layers[0][0].weight) if k.name in ALWAYS]
    found = timing.measure_linear(layers, None, candidates, timer)
    assert found["decode"]["bf16-fp32-compute"] is None
    assert sel.split_or_single(found["decode"], found["prefill"]) == (
        "torch-dense", "bf16-fp32-compute")


def test_the_measurement_is_cached_and_timed_again_when_its_key_changes(tmp_path):
    timer = Timings({})
    first = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=idle)
    assert first.source == "measured" and timer.calls
    files = list((tmp_path / "kernels").glob("*.json"))
    assert [f.stem for f in files] == [first.key]
    assert json.loads(files[0].read_text())["linear_decode"] == first.linear_decode

    timer.calls.clear()
    again = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=idle)
    assert again.source == "cached" and not timer.calls
    assert (again.linear_decode, again.linear_prefill) == (first.linear_decode,
                                                             first.linear_prefill)

    other = sel.choose_kernels("auto", _layers(hidden=64), None, None, cache_dir=tmp_path,
                               timer=timer, load=idle)  # other shapes: another key, timed again
    assert other.source == "measured" and timer.calls and other.key != first.key

    threads = torch.get_num_threads()
    timer.calls.clear()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        moved = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                                   load=idle)
    finally:
        torch.set_num_threads(threads)
    assert moved.source == "measured" and moved.key != first.key and timer.calls


def test_openmps_wait_settings_are_part_of_the_key(tmp_path, monkeypatch):
    """Every multi-threaded timing depends on how OpenMP's threads wait between parallel
    regions (asleep under PASSIVE, spinning otherwise): another policy or spin count times
    again."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    passive = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                                 timer=Timings({}), load=idle)
    keys = {passive.key}
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "5000")):
        monkeypatch.setenv(name, value)
        timer = Timings({})
        moved = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                                   timer=timer, load=idle)
        assert moved.source == "measured" and timer.calls and moved.key not in keys, name
        keys.add(moved.key)


def test_a_stale_or_corrupt_cache_file_is_measured_again(tmp_path):
    first = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                               timer=Timings({}), load=idle)
    path = tmp_path / "kernels" / f"{first.key}.json"
    path.write_text("{not json")
    timer = Timings({})
    again = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=idle)
    assert again.source == "measured" and timer.calls
    assert json.loads(path.read_text())["key"] == first.key


# ---- the load a measurement ran under ------------------------------------------------------------

def test_busy_means_a_load_above_half_the_cores():
    assert not sel.MachineLoad(1.0, 2).is_busy  # exactly half: the neighbours fit beside us
    assert sel.MachineLoad(1.01, 2).is_busy
    assert not sel.MachineLoad(31.5, 64).is_busy and sel.MachineLoad(32.5, 64).is_busy


def test_a_choice_timed_on_a_busy_machine_is_provisional_and_timed_again(tmp_path):
    timer = Timings({})
    first = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=busy)
    assert first.source == "measured" and first.provisional
    assert (first.load_1m, first.num_cores) == (1.9, 2)
    assert first.summary().endswith("(provisional: timed at load 1.9 on 2 cores; timed again "
                                    "at the next start)")
    assert first.labels()["provisional"] == "timed at load 1.9 on 2 cores"
    path = tmp_path / "kernels" / f"{first.key}.json"
    record = json.loads(path.read_text())
    assert record["provisional"] is True and record["load_1m"] == 1.9
    assert record["num_cores"] == 2 and record["measured_at_s"] == first.measured_at_s
    stamped = datetime.datetime.fromisoformat(record["measured_at"])
    assert abs(stamped.timestamp() - first.measured_at_s) < 1  # the ISO time is the epoch's

    timer.calls.clear()  # the next start, on an idle machine: timed again and overwritten
    again = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=idle)
    assert again.source == "measured" and timer.calls and not again.provisional
    record = json.loads(path.read_text())
    assert record["provisional"] is False and record["load_1m"] == 0.25
    assert "provisional" not in again.labels() and "provisional" not in again.summary()


def test_a_provisional_choice_timed_while_waiting_for_the_lock_is_a_siblings(tmp_path):
    # a replica or rank that started beside this one timed it while this call waited: taken
    first = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                               timer=Timings({}), load=busy)
    path = tmp_path / "kernels" / f"{first.key}.json"
    record = json.loads(path.read_text())
    record["measured_at_s"] = time.time() + 60  # written after the next call started
    path.write_text(json.dumps(record))
    timer = Timings({})
    again = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=idle)
    assert again.source == "cached" and again.provisional and not timer.calls


def test_a_final_cached_choice_is_reused_with_its_load(tmp_path):
    first = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                               timer=Timings({}), load=idle)
    timer = Timings({})
    again = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=busy)  # busy now: a final record is still final
    assert again.source == "cached" and not timer.calls and not again.provisional
    assert (again.load_1m, again.num_cores, again.measured_at, again.measured_at_s) == (
        first.load_1m, first.num_cores, first.measured_at, first.measured_at_s)


def test_margins_are_the_runner_up_over_the_winner_per_family(tmp_path):
    choice = sel.KernelChoice("auto", "a", "a", {}, "measured", {
        "matmul_decode": {"a": 2.0, "b": 3.0, "c": 5.0},
        "matmul_prefill": {"a": 4.0, "b": None, "c": math.inf},  # one finished
        "paged_decode_attention": {"x": 0.5, "y": 0.5}})
    assert choice.margins() == {"matmul_decode": 1.5, "matmul_prefill": None,
                                "paged_decode_attention": 1.0}
    # through a measurement: decode is the sum of the 1- and 8-row passes (2 and 6 ms); the
    # other candidates this CPU may have (native, oneDNN) take the default 1 s per pass
    timer = Timings({"matmul_decode:torch-dense": 1e-3, "matmul_decode:bf16-fp32-compute": 3e-3,
                     "matmul_prefill:torch-dense": 4e-3,
                     "matmul_prefill:bf16-fp32-compute": 5e-3})
    measured = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                                  timer=timer, load=idle)
    assert measured.margins() == {"matmul_decode": pytest.approx(3.0),
                                  "matmul_prefill": pytest.approx(1.25)}


def test_an_old_record_without_the_load_reads_back_as_final(tmp_path):
    first = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                               timer=Timings({}), load=idle)
    path = tmp_path / "kernels" / f"{first.key}.json"
    record = json.loads(path.read_text())
    for name in ("load_1m", "num_cores", "measured_at", "measured_at_s", "provisional"):
        del record[name]
    path.write_text(json.dumps(record))
    timer = Timings({})
    again = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                               load=busy)
    assert again.source == "cached" and not timer.calls and not again.provisional
    assert (again.load_1m, again.num_cores, again.measured_at_s) == (None, None, None)
    assert again.timed_under() == "" and "provisional" not in again.labels()


def test_cached_choices_reads_every_record_and_skips_the_rest(tmp_path):
    assert sel.cached_choices(tmp_path) == []  # no kernels/ folder at all
    one = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                             timer=Timings({}), load=idle)
    two = sel.choose_kernels("auto", _layers(hidden=64), None, None, cache_dir=tmp_path,
                             timer=Timings({}), load=busy)
    folder = tmp_path / "kernels"
    (folder / "torn.json").write_text("{not json")
    (folder / "foreign.json").write_text(json.dumps({"bench": "something else"}))
    (folder / "list.json").write_text("[1, 2]")
    found = {c.key: c for c in sel.cached_choices(tmp_path)}
    assert set(found) == {one.key, two.key}
    assert found[two.key].provisional and found[two.key].source == "cached"
    assert not found[one.key].provisional


def test_the_split_kernel_runs_each_class_on_its_own_kernel():
    small, large = TORCH_DENSE, FP32_COMPUTE_BF16
    kernel = sel.split_kernel(small, large)
    weight = torch.randn(48, 32).to(torch.bfloat16)
    packed = kernel.pack(weight)
    for rows, expected_kernel in ((1, small), (sel.DECODE_MAX_ROWS, small),
                                  (sel.DECODE_MAX_ROWS + 1, large), (100, large)):
        x = torch.randn(rows, 32).to(torch.bfloat16)
        expected = expected_kernel.linear(x, expected_kernel.pack(weight))
        assert torch.equal(kernel.linear(x, packed), expected), rows


def test_the_split_kernel_fused_gate_up_matches_its_parts():
    from mooncake_ops.linear import NATIVE_PACKED_BF16, native_bf16_linear_available

    if not native_bf16_linear_available():
        pytest.skip("the fused SwiGLU input is the AVX512_BF16 native kernel's (not on this CPU)")
    kernel = sel.split_kernel(NATIVE_PACKED_BF16, TORCH_DENSE)
    weight = torch.randn(64, 32).to(torch.bfloat16)
    packed = kernel.pack_gate_up(weight)
    from mooncake_ops import silu_and_mul

    small = torch.randn(2, 32).to(torch.bfloat16)
    assert torch.equal(kernel.gate_up_silu(small, packed), NATIVE_PACKED_BF16.gate_up_silu(
        small, NATIVE_PACKED_BF16.pack_gate_up(weight)))
    large = torch.randn(40, 32).to(torch.bfloat16)
    assert torch.equal(kernel.gate_up_silu(large, packed), silu_and_mul(F.linear(large, weight)))


def test_every_linear_candidate_matches_f_linear_on_fresh_inputs():
    """Each kernel auto may choose computes F.linear. Derived bound: x and w are exact bf16,
    each candidate sums in fp32 (K = 96 terms: relative error ~96 * 2^-24, negligible) and
    rounds the sum to bf16 once (at most the unit roundoff 2^-8 of |y|); the bound allows four
    times that rounding, relative to the largest |y|."""
    weight = torch.randn(64, 96).to(torch.bfloat16)
    for rows in (1, 7, 40):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        exact = F.linear(x.double(), weight.double())
        for kernel in sel.linear_candidates(weight):
            y = kernel.linear(x, kernel.pack(weight)).double()
            bound = 4 * 2.0 ** -8 * exact.abs().max()
            assert (y - exact).abs().max() <= bound, (kernel.name, rows)


def test_attention_candidates_are_timed_and_the_choice_is_applied_and_reset():
    shape = timing.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               dtype=torch.bfloat16)
    timer = Timings({"paged_decode_attention:torch-sdpa": 0.01}, default=1.0)
    found = timing.measure_attention(shape, timer)
    assert sel.fastest(found["paged_decode_attention"]) == "torch-sdpa"
    choice = sel.KernelChoice("auto", None, None, {"paged_decode_attention": "torch-sdpa"})
    before = dispatch.implementation_name("paged_decode_attention", "cpu")
    try:
        choice.apply()
        assert dispatch.implementation_name("paged_decode_attention", "cpu") == "torch-sdpa"
    finally:
        sel.KernelChoice("native", None, None).apply()
    assert dispatch.implementation_name("paged_decode_attention", "cpu") == before


def test_a_chosen_candidate_that_is_not_one_is_refused_with_the_list():
    with pytest.raises(ValueError, match="'fast' is not an implementation of "
                                         "paged_decode_attention on cpu; candidates: .*torch-sdpa"):
        dispatch.choose_impl("paged_decode_attention", "cpu", "fast")


def test_a_native_choice_is_void_while_native_kernels_are_off():
    if "native" not in dispatch.op_candidates("paged_decode_attention", "cpu"):
        pytest.skip("no native build loads on this CPU")
    dispatch.choose_impl("paged_decode_attention", "cpu", "native")
    previous = dispatch.use_native(False)
    try:
        assert dispatch.implementation_name("paged_decode_attention", "cpu") == "torch-reference"
    finally:
        dispatch.use_native(previous)
        dispatch.choose_impl("paged_decode_attention", "cpu", None)


def test_the_mode_comes_from_the_argument_alone_and_bad_ones_are_named(monkeypatch):
    """This layer reads no environment: ``KTHENA_KERNELS`` is only kthena_serve's default for
    ``EngineConfig.kernels`` (kthena_serve/tests/test_kernels.py names a bad one there)."""
    monkeypatch.setenv("KTHENA_KERNELS", "torch")
    assert sel.resolve_mode(None) == "auto"
    assert sel.resolve_mode("native") == "native"
    monkeypatch.setenv("KTHENA_KERNELS", "fastest")
    assert sel.resolve_mode("auto") == "auto"
    with pytest.raises(ValueError, match="kernels='amx': the kernel choice is one of"):
        sel.resolve_mode("amx")


def test_fixed_modes_time_nothing():
    timer = Timings({})
    torch_choice = sel.choose_kernels("torch", _layers(), None, None, timer=timer)
    assert (torch_choice.linear_decode, torch_choice.source) == ("torch-dense", "fixed")
    assert set(torch_choice.attention.values()) == {"torch-sdpa"}
    native = sel.choose_kernels("native", _layers(), None, None, timer=timer)
    assert native.attention == {} and native.source == "fixed"
    assert not timer.calls
    fp32 = [[timing.MatmulWeight(torch.randn(8, 8))]]  # no packed kernel for fp32: F.linear
    assert sel.choose_kernels("auto", fp32, None, None, timer=timer).linear_kernel() is None
    assert not [c for c in timer.calls if c.startswith("matmul")]


def test_labels_and_summary_name_every_choice():
    choice = sel.KernelChoice("auto", "a", "b", {"paged_prefill_attention": "native"},
                              "cached")
    assert choice.labels() == {"mode": "auto", "source": "cached", "matmul_decode": "a",
                               "matmul_prefill": "b", "decode_attention": "default",
                               "prefill_attention": "native"}
    assert choice.summary() == ("kernels (auto, cached): matmul a (decode) / b (prefill); "
                                "decode attention default; prefill attention native")


# ---- weight-only int8 ----------------------------------------------------------------------------

def test_every_int8_candidate_matches_the_dequantised_weight_on_fresh_inputs():
    """Each int8 path auto may choose computes F.linear over the dequantised weight (q * scale,
    float64 here). Derived bound, as for the bf16 candidates: x is exact bf16 and the dequantised
    weight is rounded to bf16 at most once (2^-8 relative) before an fp32 sum (K = 96 terms,
    negligible), and the result is rounded to bf16 once: four roundings of the largest |y|."""
    from mooncake_ops.linear_int8 import dequantize_int8_weight, pack_int8_weight

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    weight = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    packed = pack_int8_weight(weight)
    dense = dequantize_int8_weight(packed, torch.float64)
    candidates = sel.int8_candidates(weight)
    assert {"int8-op", "int8-dequant-dense", "int8-weight-only"} <= {k.name for k in candidates}
    for rows in (1, 7, 40, 300):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        exact = F.linear(x.double(), dense)
        for kernel in candidates:
            assert kernel.pack is pack_int8_weight  # one packed form for every path
            y = kernel.linear(x, packed).double()
            assert (y - exact).abs().max() <= 4 * 2.0 ** -8 * exact.abs().max(), (kernel.name,
                                                                                 rows)
        gate_up = pack_int8_weight(torch.randn(128, 96, generator=g).to(torch.bfloat16))
        both = F.linear(x.double(), dequantize_int8_weight(gate_up, torch.float64))
        expected = F.silu(both[:, :64]) * both[:, 64:]
        for kernel in candidates:
            y = kernel.gate_up_silu(x, gate_up).double()
            # the unfused paths round the [rows, 128] half-way to bf16 first: two more roundings
            assert (y - expected).abs().max() <= 8 * 2.0 ** -8 * expected.abs().max() + 1e-6, (
                kernel.name, rows)


def test_int8_auto_takes_the_fastest_int8_path_per_class_and_shares_the_packed_weight(tmp_path):
    timer = Timings({"matmul_decode:int8-op": 0.5, "matmul_decode:int8-dequant-dense": 9.0,
                     "matmul_prefill:int8-op": 9.0, "matmul_prefill:int8-dequant-dense": 0.5})
    choice = sel.choose_kernels("auto", _layers(), None, None, timer=timer,
                                quantization="int8", cache_dir=tmp_path, load=idle)
    assert (choice.linear_decode, choice.linear_prefill) == ("int8-op", "int8-dequant-dense")
    assert any(c.startswith("matmul_decode:int8-weight-only") for c in timer.calls)
    assert not [c for c in timer.calls if "torch-dense" in c or "bf16" in c]  # bf16 not timed
    kernel = choice.linear_kernel()
    weight = torch.randn(48, 32).to(torch.bfloat16)
    packed = kernel.pack(weight)
    assert packed.dtype == torch.int8
    x = torch.randn(40, 32).to(torch.bfloat16)  # a prefill-sized call: the dequantising path
    assert torch.equal(kernel.linear(x, packed), INT8_DEQUANT_DENSE.linear(x, packed))
    # int8 and bf16 measurements of the same shapes are kept apart
    bf16 = sel.choose_kernels("auto", _layers(), None, None, timer=Timings({}),
                              cache_dir=tmp_path, load=idle)
    assert bf16.source == "measured" and bf16.key != choice.key
    again = sel.choose_kernels("auto", _layers(), None, None, timer=Timings({}),
                               quantization="int8", cache_dir=tmp_path, load=idle)
    assert again.source == "cached" and again.linear_prefill == "int8-dequant-dense"


def test_int8_fixed_modes_and_a_bad_quantization():
    timer = Timings({})
    native = sel.choose_kernels("native", _layers(), None, None, timer=timer, quantization="int8")
    torch_choice = sel.choose_kernels("torch", _layers(), None, None, timer=timer,
                                      quantization="int8")
    assert native.linear_decode == native.linear_prefill == "int8-weight-only"
    assert torch_choice.linear_decode == "int8-dequant-dense"
    assert set(torch_choice.attention.values()) == {"torch-sdpa"}
    assert not timer.calls
    with pytest.raises(ValueError, match=r"quantization='int4': None or 'int8'"):
        sel.choose_kernels("auto", _layers(), None, None, timer=timer, quantization="int4")


def test_an_unwritable_cache_folder_warns_and_times_uncached(tmp_path, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder should be")
    timer = Timings({})
    with caplog.at_level(logging.WARNING, logger="mooncake_ops"):
        choice = sel.choose_kernels("auto", _layers(), None, None, cache_dir=blocker,
                                    timer=timer, load=idle)
    assert choice.source == "measured" and timer.calls
    assert "cannot cache in" in caplog.text and blocker.is_file()


def test_the_one_time_measurement_says_what_it_times_before_and_the_choice_after(tmp_path,
                                                                                 caplog):
    """Issue 53: a start-up was silent for ~15 s while kernels were timed. A line before
    (what, and about how long) and one after (the time taken, the choice); none on a cache
    hit, where nothing is timed."""
    timer = Timings({})
    with caplog.at_level(logging.INFO, logger="mooncake_ops"):
        choice = sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path,
                                    timer=timer, load=idle)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "kernel selection:")]
    assert len(lines) == 2, lines
    candidates = len(sel.linear_candidates(_layers()[0][0].weight))
    assert lines[0].startswith(f"kernel selection: timing {candidates} matmul kernels at "
                               "this model's shapes, once on this machine (seconds, up to a "
                               "minute")
    assert f"cached in {tmp_path}" in lines[0]
    assert lines[1].startswith("kernel selection: timed in ") and choice.summary() in lines[1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mooncake_ops"):
        sel.choose_kernels("auto", _layers(), None, None, cache_dir=tmp_path, timer=timer,
                           load=idle)
    assert not [r for r in caplog.records if "kernel selection: timing" in r.getMessage()]


def test_native_unavailable_is_said_on_its_own_logger(monkeypatch, caplog):
    """The native-kernels warning goes to ``mooncake_ops.native``, which a deployment quiets
    in all but one of its processes (the warning printed once per PD worker, issue 53)."""
    from mooncake_ops.backends import native

    monkeypatch.setattr(native, "_state", {"module": None, "reason": None, "loaded": False})
    monkeypatch.setattr(native, "_BUILDS", {"AVX512": "no_such_build_kthena_test",
                                            "AVX2": "no_such_build_kthena_test"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.WARNING, logger="mooncake_ops"):
        assert not native.is_available()
    records = [r for r in caplog.records if "native CPU kernels unavailable" in r.getMessage()]
    assert [r.name for r in records] == ["mooncake_ops.native"]
    assert "no_such_build_kthena_test" in records[0].getMessage()
