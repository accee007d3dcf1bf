"""``kthena doctor`` finds each staged fault: a leaked KV block on a live server, prompts that
drag the prefix hit rate, a missing HCCL variable, a workload that does not fit, an old
calibration, kernels timed on a busy host; and bad input is one line naming what was wrong.

Servers are real: a tiny engine behind the OpenAI app on a free loopback port, with an API key.
The leak is real: a request id the engine never had takes blocks on the engine's own KV
manager and is never freed (what a scheduler that forgets ``free`` leaves behind).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import attrs
import httpx
import pytest
from _tiny import tiny_engine

from kthena_core.cli import main as kthena_main
from kthena_core.discovery import NotPresent, discover_all
from kthena_serve.async_engine import AsyncLLM
from kthena_serve.doctor import (
    DoctorError,
    ServerFacts,
    calibration_check,
    exit_status,
    host_checks,
    kernel_cache_checks,
    load_host_facts,
    server_checks,
)
from kthena_serve.doctor.cli import run_doctor
from kthena_serve.doctor.server import Scrape
from kthena_serve.engine.stats import EngineStats
from kthena_serve.engine.step_times import StepTimes
from kthena_serve.server import BackgroundServer, build_app

MODEL = "tiny"
KEY = "doctor-test-key"
LONG_PROMPT = "The capital of France is a city of light and of many bridges over the river"


def _by_name(checks) -> dict:  # noqa: ANN001
    return {c.name: c for c in checks}


def _serve(core):  # noqa: ANN001, ANN202
    engine = AsyncLLM(core).start()
    server = BackgroundServer(build_app(engine, model_name=MODEL, api_key=KEY)).start()
    return engine, server


def _complete(url: str, prompt, **extra) -> None:  # noqa: ANN001
    reply = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                             "temperature": 0, **extra}, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def healthy():
    """A server that ran three salted requests (each its own salt: none can hit)."""
    engine, server = _serve(tiny_engine())
    try:
        for salt in ("a", "b", "c"):
            _complete(server.url, LONG_PROMPT, cache_salt=salt)
        yield server.url, engine
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def leaky():
    """A server whose KV manager holds blocks for a request the engine never had; it then
    serves short prompts (one block or less: never a hit)."""
    core = tiny_engine()
    kv = core.kv
    kv.match_prefix("leaked-request", list(range(10, 22)))
    assert kv.try_allocate("leaked-request", 12) is not None  # 3 blocks of 4, never freed
    kv.release_owner()  # the engine's thread owns the manager from now on
    engine, server = _serve(core)
    try:
        for _ in range(3):
            _complete(server.url, [5, 6, 7])
        yield server.url, engine
    finally:
        server.stop()
        engine.shutdown()


# ---- server checks ---------------------------------------------------------------------------
def test_a_healthy_server_passes_and_names_salt_as_what_drags_its_hit_rate(healthy) -> None:
    url, engine = healthy
    checks = _by_name(run_doctor(url, KEY, None, None))
    assert checks["server"].verdict == "ok" and "engine running" in checks["server"].value
    assert checks["kv_leaks"].verdict == "ok"
    assert checks["preemptions"].verdict == "ok"
    hit = checks["prefix_hit_rate"]
    assert hit.verdict == "warn" and "100% salted" in hit.value and "cache_salt" in hit.fix
    usage = checks["kv_usage"]
    assert usage.verdict == "ok" and f"of {engine.stats().kv.num_blocks} blocks" in usage.value
    assert checks["step_time"].verdict in ("ok", "warn")
    assert "prefill" in checks["step_time"].value and "idle" in checks["step_time"].value
    assert checks["kernels"].verdict == "skip"  # the tiny model is built outside the loader
    assert exit_status(checks.values()) == 0


def test_step_times_are_measured_per_phase(healthy) -> None:
    url, engine = healthy
    times = engine.stats().step_times
    assert times.prefill_s > 0 and times.decode_s > 0 and times.sampling_s > 0
    assert times.idle_s > 0  # the engine waited between the fixture's requests
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'kthena_step_seconds_total{phase="decode"}' in text
    assert 'kthena_prompts_total{cache="salted"} 3.0' in text


def test_a_leaked_block_fails_the_leak_check_and_the_exit_status(leaky) -> None:
    url, engine = leaky
    stats = engine.stats()
    assert (stats.num_leaked_requests, stats.num_leaked_blocks) == (1, 3)
    checks = _by_name(run_doctor(url, KEY, None, None))
    leak = checks["kv_leaks"]
    assert leak.verdict == "fail"
    assert leak.value == "3 block reference(s) held by 1 request(s) the engine no longer has"
    assert "free" in leak.fix
    assert exit_status(checks.values()) == 1


def test_short_prompts_are_named_as_what_drags_the_hit_rate(leaky) -> None:
    url, _ = leaky
    hit = _by_name(run_doctor(url, KEY, None, None))["prefix_hit_rate"]
    assert hit.verdict == "warn" and "100% shorter than a block" in hit.value
    assert "4 tokens or fewer can never hit" in hit.fix


def test_the_command_prints_one_json_object_and_exits_1_on_a_failure(leaky, capsys) -> None:
    url, _ = leaky
    assert kthena_main(["doctor", "--url", url, "--api-key", KEY, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["num_failed"] == 1
    assert {c["name"] for c in report["checks"]} >= {"kv_leaks", "step_time", "kv_fit"}


@pytest.mark.parametrize(("key", "said"), [("wrong", "the API key is wrong"),
                                           (None, "the API key is missing")])
def test_a_refused_key_is_one_line_naming_it(healthy, capsys, monkeypatch, key, said) -> None:
    url, _ = healthy
    monkeypatch.delenv("KTHENA_API_KEY", raising=False)
    argv = ["doctor", "--url", url] + (["--api-key", key] if key else [])
    assert kthena_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "401" in err and "Traceback" not in err


def test_an_unreachable_server_is_one_line_naming_the_url(capsys) -> None:
    assert kthena_main(["doctor", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kthena doctor: error: --url http://127.0.0.1:9: cannot reach")
    assert err.count("\n") == 1


# ---- host checks -----------------------------------------------------------------------------
def _config(tmp_path, body: str) -> str:  # noqa: ANN001
    path = tmp_path / "kthena_config.yaml"
    path.write_text(body)
    return str(path)


NPU_TWO_NODES = """
cluster: {topology: "atlas-800t-a2:2", nnodes: 2}
parallelism: {strategy: auto}
model: {checkpoint_path: default, dtype: bfloat16}
service: {max_batch_size: 16}
"""


def test_a_missing_hccl_variable_fails_on_a_two_node_npu_plan(tmp_path) -> None:
    config = _config(tmp_path, NPU_TWO_NODES)
    discovery = discover_all()
    missing = _by_name(host_checks(load_host_facts(config, {}, lambda: discovery)))
    env = missing["collectives_env"]
    assert env.verdict == "fail" and "HCCL_IF_IP and HCCL_SOCKET_IFNAME are both unset" in env.value
    assert missing["native_kernels"].verdict == "skip"  # an NPU plan
    if isinstance(discovery.npu, NotPresent):  # this host has no NPU
        assert missing["devices"].verdict == "fail"
        assert "this host shows 0" in missing["devices"].value
    given = _by_name(host_checks(load_host_facts(config, {"HCCL_IF_IP": "127.0.0.1"},
                                                 lambda: discovery)))
    assert given["collectives_env"].verdict == "ok"
    assert "HCCL_IF_IP=127.0.0.1" in given["collectives_env"].value


def test_an_hccl_address_of_another_host_fails(tmp_path) -> None:
    config = _config(tmp_path, NPU_TWO_NODES)
    facts = load_host_facts(config, {"HCCL_IF_IP": "192.0.2.77"}, discover_all)  # TEST-NET-1
    env = _by_name(host_checks(facts))["collectives_env"]
    assert env.verdict == "fail" and "is not an address of this host" in env.value


def test_a_workload_larger_than_this_hosts_memory_fails(tmp_path) -> None:
    discovery = discover_all()
    host = sum(d.spec.memory_bytes for d in discovery.cpu.devices)
    per_sequence = 1280 * 30 * 3 * 64 * 2 * 2  # SmolLM2-135M's bf16 KV for 1024 + 256 tokens
    sequences = 2 * host // per_sequence + 1
    config = _config(tmp_path, f"""
cluster: {{topology: cpu-host}}
parallelism: {{strategy: auto}}
model: {{checkpoint_path: default, dtype: bfloat16}}
service: {{max_batch_size: {sequences}}}
""")
    fit = _by_name(host_checks(load_host_facts(config, {}, lambda: discovery)))["kv_fit"]
    assert fit.verdict == "fail" and f"KV for {sequences} sequences" in fit.value
    assert "this host has" in fit.value and "max_batch_size" in fit.fix


def test_a_workload_no_device_layout_fits_fails(tmp_path) -> None:
    config = _config(tmp_path, """
cluster: {topology: atlas-800t-a2}
parallelism: {strategy: auto}
model: {checkpoint_path: default, dtype: bfloat16}
service: {max_batch_size: 1000000}
""")
    checks = _by_name(host_checks(load_host_facts(config, {}, discover_all)))
    assert checks["kv_fit"].verdict == "fail" and checks["kv_fit"].value.startswith("no plan fits")
    assert checks["devices"].verdict == "skip" and checks["collectives_env"].verdict == "skip"


def test_a_pool_smaller_than_the_planned_kv_warns(tmp_path) -> None:
    config = _config(tmp_path, """
cluster: {topology: auto}
parallelism: {strategy: auto}
model: {checkpoint_path: default, dtype: bfloat16}
service: {max_batch_size: 16}
kv_cache: {memory_pool_size: 100MiB}
""")
    fit = _by_name(host_checks(load_host_facts(config, {}, discover_all)))["kv_fit"]
    assert fit.verdict == "warn" and "memory_pool_size 100MiB holds about 3 of them" in fit.value


def test_the_example_config_passes_on_this_host() -> None:
    checks = host_checks(load_host_facts("docs/examples/cpu-smollm2.yaml", {}, discover_all))
    assert exit_status(checks) == 0, checks


def test_a_bad_config_is_one_line(tmp_path, capsys) -> None:
    config = _config(tmp_path, "service: {max_batch_size: -1}\n")
    assert kthena_main(["doctor", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "service.max_batch_size" in err


def test_calibration_age(tmp_path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"bench": "kthena serve", "machine": {"cpu": "AMD EPYC",
                                                                       "cores": 2}}))
    fresh = calibration_check(str(bench))
    assert fresh.verdict == "ok" and "0 day(s) old, measured on AMD EPYC (2 cores)" in fresh.value
    old = time.time() - 90 * 86400
    os.utime(bench, (old, old))
    stale = calibration_check(str(bench))
    assert stale.verdict == "warn" and "90 day(s) old" in stale.value
    assert calibration_check(None).verdict == "skip"
    bench.write_text("{not json")
    with pytest.raises(DoctorError, match="--calibration .*cannot read it as JSON"):
        calibration_check(str(bench))


# ---- kernel choices cached on this host ------------------------------------------------------
def _cache_a_choice(cache_dir, load_1m: float):  # noqa: ANN001, ANN202
    """A kernel choice timed with injected timings (decode: torch-dense 2 ms, bf16-fp32-compute
    6 ms over the 1- and 8-row passes; prefill 4 and 5 ms; any other candidate this CPU has,
    1 s a pass) at an injected load on 2 cores."""
    import torch

    from mooncake_ops import selection as sel

    table = {"matmul_decode:torch-dense": 1e-3, "matmul_decode:bf16-fp32-compute": 3e-3,
             "matmul_prefill:torch-dense": 4e-3, "matmul_prefill:bf16-fp32-compute": 5e-3}

    def timer(label: str, fn: object) -> float:
        return table.get(":".join(label.split(":")[:2]), 1.0)

    g = torch.Generator().manual_seed(0)
    layers = [[sel.MatmulWeight(torch.randn(64, 32, generator=g).to(torch.bfloat16))]]
    return sel.choose_kernels("auto", layers, None, None, cache_dir=cache_dir, timer=timer,
                              load=lambda: sel.MachineLoad(load_1m, 2))


def test_the_doctor_lists_cached_kernel_choices_with_margins_age_and_load(
        tmp_path, monkeypatch, capsys) -> None:
    choice = _cache_a_choice(tmp_path, load_1m=1.9)
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path))
    kthena_main(["doctor"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if f"kernel_cache:{choice.key[:8]}" in x)
    assert line.startswith("warn") and (
        "matmul decode torch-dense (runner-up x3.00), prefill torch-dense (runner-up x1.25); "
        "decode attention default (not timed), prefill attention default (not timed); "
        "timed ") in line
    assert re.search(r"timed \d+ (s|min) ago at load 1.9 on 2 cores: provisional \(timed "
                     r"again at the next start\)$", line), line

    later = kernel_cache_checks(tmp_path, now=choice.measured_at_s + 3 * 3600 + 60)
    assert [c.value.split("; ")[-1] for c in later] == [
        "timed 3 h ago at load 1.9 on 2 cores: provisional (timed again at the next start)"]
    assert later[0].verdict == "warn" and "times it again" in later[0].fix

    final = _cache_a_choice(tmp_path, load_1m=0.4)  # the next start, on a quiet host
    (again,) = kernel_cache_checks(tmp_path, now=final.measured_at_s + 2 * 86400)
    assert again.verdict == "ok" and again.value.endswith(
        "timed 2 days ago at load 0.4 on 2 cores: final")


def test_no_cached_kernel_choice_is_one_skip_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path))
    lines = [c for c in run_doctor(None, None, None, None) if c.name.startswith("kernel_cache")]
    assert [(c.name, c.verdict) for c in lines] == [("kernel_cache", "skip")]
    assert lines[0].value.startswith(f"no kernel choice cached in {tmp_path}/kernels")


def test_a_server_running_provisional_kernels_warns() -> None:
    from mooncake_ops.selection import KernelChoice

    labels = KernelChoice("auto", "a", "a", {}, "measured", load_1m=1.9, num_cores=2,
                          provisional=True).labels()
    names = sorted(labels)
    quoted = ",".join(f'{n}="{labels[n]}"' for n in names)
    text = f"# TYPE kthena_kernels_info gauge\nkthena_kernels_info{{{quoted}}} 1.0\n"
    facts = ServerFacts("http://127.0.0.1:1", True, "test", Scrape.parse(text), {})
    kernels = _by_name(server_checks(facts))["kernels"]
    assert kernels.verdict == "warn" and kernels.value.endswith(
        "(provisional: timed at load 1.9 on 2 cores; timed again at the next start)")


# ---- the data behind the checks --------------------------------------------------------------
def test_holders_names_every_live_request_and_drops_freed_ones() -> None:
    from mooncake_kv import KVCacheManager

    kv = KVCacheManager(8, 4, check_invariants=True)
    kv.match_prefix("a", list(range(9)))
    kv.try_allocate("a", 9)
    kv.match_prefix("b", [1, 2])
    assert kv.holders() == {"a": 3, "b": 0}
    kv.free("a")
    assert kv.holders() == {"b": 0}


def test_step_times_and_leaks_survive_json_and_sum_over_engines() -> None:
    core = tiny_engine()
    one = core.stats()
    two = EngineStats.from_json(json.loads(json.dumps(one.to_json())))
    assert two == one
    times = StepTimes(1.0, 2.0, 3.0, 4.0, 5.0)
    total = EngineStats.total([attrs.evolve(one, step_times=times, num_leaked_blocks=2)] * 2,
                              block_size=4)
    assert total.step_times == StepTimes(2.0, 4.0, 6.0, 8.0, 10.0)
    assert total.num_leaked_blocks == 4
    old = one.to_json()
    del old["step_times"], old["num_leaked_blocks"], old["num_leaked_requests"]
    assert EngineStats.from_json(old).step_times == StepTimes()  # an older worker's stats



def test_the_host_probe_line_names_its_figures_source_age_and_load(tmp_path, monkeypatch,
                                                                 cpu_profile) -> None:
    from kthena_core.discovery.host_probe import load_host_probe

    _, probe = cpu_profile
    monkeypatch.setenv("KTHENA_HOST_PROBE", str(probe))
    figures = load_host_probe(probe)
    line = _by_name(host_checks(load_host_facts(None, {}, discover_all)))["host_probe"]
    assert line.verdict == "ok" and line.value.startswith(f"file {probe}: ")
    assert f"{figures.memory_bw / 1e9:.1f} GB/s read" in line.value
    # a probe taken under load warns, says when and at what load, and what happens next
    busy = {**json.loads(probe.read_text()), "load_avg_1m": 3.5, "cores": 2,
            "measured_at": time.time() - 7200, "provisional": True}
    probe.write_text(json.dumps(busy))
    line = _by_name(host_checks(load_host_facts(None, {}, discover_all)))["host_probe"]
    assert line.verdict == "warn" and "2 h old, taken at load 3.50 on 2 core(s)" in line.value
    assert "provisional" in line.value and "measures again" in line.fix


def test_a_missing_probe_file_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KTHENA_HOST_PROBE", str(tmp_path / "none.json"))
    assert kthena_main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"KTHENA_HOST_PROBE={tmp_path / 'none.json'}" in err


# ---- structured_output: xgrammar imports, or the import's own error ------------------------------
def _xgrammar_fails_with(monkeypatch, missing: str) -> None:  # noqa: ANN001
    """A test double for an install that cannot be staged in this venv: importing xgrammar
    raises ModuleNotFoundError naming ``missing`` (xgrammar itself, or a module it imports)."""

    class Broken:
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
            if name == "xgrammar":
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
            return None

    monkeypatch.delitem(sys.modules, "xgrammar", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])


def test_structured_output_check_says_whether_xgrammar_imports():
    import importlib.util

    from kthena_serve.doctor.host import structured_output_check

    check = structured_output_check()
    expected = "ok" if importlib.util.find_spec("xgrammar") is not None else "fail"
    assert check.verdict == expected, check


@pytest.mark.parametrize(("missing", "said"), [
    ("xgrammar", "xgrammar is not installed; install it with pip install --no-deps"),
    ("transformers", "xgrammar is installed but its import failed (ModuleNotFoundError: No "
                     "module named 'transformers')"),
])
def test_a_broken_xgrammar_is_one_fail_line_and_the_400_names_the_real_error(
        monkeypatch, missing, said):  # noqa: ANN001
    from kthena_serve.doctor.host import structured_output_check
    from kthena_serve.engine.errors import InvalidRequestError
    from kthena_serve.engine.grammar import choice_grammar, xgrammar_problem
    from kthena_serve.engine.structured_output import StructuredOutputsParams

    _xgrammar_fails_with(monkeypatch, missing)
    assert said in xgrammar_problem()
    check = structured_output_check()
    assert check.verdict == "fail" and said in check.fix
    engine = tiny_engine()
    try:
        spec = StructuredOutputsParams(grammar=choice_grammar(["yes", "no"]))
        with pytest.raises(InvalidRequestError, match=re.escape(said)):
            engine.processor.grammars.compile(spec)
    finally:
        engine.close()
