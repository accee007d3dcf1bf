"""``kthena serve --config``: each honoured key changes the ServeSpec served (its EngineConfig
or its own fields), a plan the engine cannot run is refused by name, explicit flags win, the
spec round-trips through JSON, and one end-to-end run prints the plan, serves that same layout
and answers a completion."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from _serve_process import start_serve

from kthena_core.cli import build_parser
from kthena_core.config import load_config
from kthena_core.config_plan import plan_config
from kthena_core.discovery import discover
from kthena_core.topology import from_catalog
from kthena_serve.cli import spec_from_args
from kthena_serve.planned import (
    UnservablePlanError,
    check_servable,
    config_settings,
    plan_config_path,
)
from kthena_serve.spec import ServeSpec

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "examples", "cpu-smollm2.yaml")


def _serve(tmp_path, yaml_text: str, *flags: str):
    path = tmp_path / "kthena_config.yaml"
    path.write_text(yaml_text)
    spec = spec_from_args(build_parser().parse_args(["serve", "--config", str(path), *flags]))
    return spec, spec.engine, plan_config_path(str(path)).plan


BASE = "cluster: {topology: auto}\nparallelism: {strategy: auto}\n"


@pytest.mark.parametrize(
    ("yaml_text", "field", "value"),
    [
        ("service: {kv_cache_reuse: false}", "enable_prefix_caching", False),
        ("service: {kv_cache_reuse: true}", "enable_prefix_caching", True),
        ("service: {max_batch_size: 7}", "max_num_seqs", 7),
        ("kv_cache: {reuse_bucket_size: 32}", "block_size", 32),
        ("kv_cache: {memory_pool_size: 96MiB}", "kv_cache_memory", 96 * 2**20),
        ("kv_cache: {max_tokens: 1000, reuse_bucket_size: 16}", "num_kv_blocks", 63),
        ("model: {dtype: float32}", "dtype", "float32"),
        ("model: {dtype: fp16}", "dtype", "float16"),
        ("kv_cache: {offload: 'host=64MiB'}", "kv_offload", 64 * 2**20),
        ("service: {target_step_ms: 250}", "target_step_ms", 250),
        ("service: {target_step_ms: 0}", "target_step_ms", 0),
        ("service: {max_queue_delay: 7.5}", "max_queue_delay_s", 7.5),
    ],
)
def test_each_honoured_key_changes_the_engine_config(tmp_path, yaml_text, field, value):
    _, config, _ = _serve(tmp_path, BASE + yaml_text + "\n")
    got = getattr(config, field)
    assert (got.host_bytes if field == "kv_offload" else got) == value


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("service: {target_step_ms: -5}", "service.target_step_ms: got -5; allowed: a number >= 0"),
    ("service: {max_queue_delay: soon}", "service.max_queue_delay: got 'soon'; allowed: a number"),
])
def test_bad_service_knobs_are_refused_naming_the_key(tmp_path, yaml_text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _serve(tmp_path, BASE + yaml_text + "\n")


def test_a_bad_offload_value_in_the_config_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--kv-offload"):
        _serve(tmp_path, BASE + "kv_cache: {offload: 'disk=1GiB'}\n")


def test_service_host_and_port_and_the_plans_tp_drive_the_flags(tmp_path):
    spec, config, plan = _serve(tmp_path, BASE + "service: {host: 0.0.0.0, port: 8123}\n")
    assert (spec.host, spec.port, config.tp) == ("0.0.0.0", 8123, plan.layout.tp)


def test_explicit_flags_override_the_config_even_at_their_default(tmp_path, capsys):
    spec, config, _ = _serve(tmp_path, BASE + "service: {max_batch_size: 7, port: 9001}\n",
                             "--max-num-seqs", "64", "--port", "0")
    assert (config.max_num_seqs, spec.port) == (64, 0)  # 64 is the flag's default: still wins
    assert "override the config: --max-num-seqs, --port" in capsys.readouterr().err


def test_without_config_the_defaults_are_untouched():
    spec = spec_from_args(build_parser().parse_args(["serve"]))
    assert (spec.plan, spec.config_path) == (None, None)
    assert (spec.engine.max_num_seqs, spec.port, spec.mode) == (64, 8000, "colocated")


def test_served_layout_is_the_plan_layout(tmp_path):
    with open(EXAMPLE, encoding="utf-8") as f:
        spec, _, plan = _serve(tmp_path, f.read())
    lay = plan.chosen.layout
    assert (spec.layout, spec.mode) == (lay, "colocated")
    assert str(spec.layout) == f"tp={lay.tp} pp={lay.pp} dp={lay.dp} sp={lay.sp}"


def test_a_calibration_file_scores_the_plan_and_reaches_get_plan(tmp_path, monkeypatch):
    from kthena_core.bench_record import load_bench
    from kthena_core.calibrate import factors_dict, fit_calibration
    from kthena_core.calibration_file import save_calibration
    from kthena_core.known_models import load_model_spec

    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))  # no cached calibration
    bench = os.path.join(os.path.dirname(EXAMPLE), "bench_cpu_smollm2.json")
    import yaml

    from kthena_core.hardware import DeviceSpec
    from kthena_core.topology import Device, Topology

    # the 2-core host the bench ran on, with its bandwidth and matmul peak as measured
    spec = DeviceSpec(name="cpu-host", kind="cpu", vendor="AuthenticAMD", memory_bytes=24 << 30,
                      memory_bw=50e9, peak_flops={"bf16": 349e9, "fp32": 145e9},
                      link_kind="memory", link_bw=50e9, link_latency=1e-6, pcie_bw=50e9)
    topology = Topology(devices=(Device(0, 0, 0, spec),), name="AMD EPYC", source="host.yaml")
    (tmp_path / "host.yaml").write_text(yaml.safe_dump(topology.to_dict()))
    config = tmp_path / "kthena_config.yaml"
    config.write_text("cluster: {topology: host.yaml}\nparallelism: {strategy: auto}\n")
    cal = fit_calibration(load_bench(bench), load_model_spec("default"), topology, source=bench)
    path = save_calibration(cal, tmp_path / "cal.json")
    argv = ["serve", "--config", str(config), "--calibration", str(path)]
    report = spec_from_args(build_parser().parse_args(argv)).report()["plan"]
    assert report["calibration"]["file"] == str(path) and report["calibration"]["source"] == bench
    assert report["cost_factors"] == report["calibration"]["factors"] == factors_dict(cal.params)
    assert report["factors"]["origin"] == "calibration file"
    assert report["figures"]["memory_bw"] == 50e9 and report["figures"]["device"] == "cpu-host"
    uncalibrated = spec_from_args(build_parser().parse_args(["serve", "--config", str(config)]))
    plan = uncalibrated.report()["plan"]
    assert plan["calibration"] is None and plan["cost_factors"]["memory_efficiency"] == 0.8
    assert plan["factors"]["origin"] == "built-in default"  # a YAML topology: not this machine
    assert plan["estimate"] != report["estimate"]  # the factors changed the prediction
    with pytest.raises(ValueError, match="--calibration scores the plan of --config"):
        spec_from_args(build_parser().parse_args(["serve", "--calibration", str(path)]))


def test_pd_mode_serves_the_plans_prefill_and_decode_split():
    cfg = load_config({"service": {"mode": "pd"}, "parallelism": {"strategy": "auto"},
                       "cluster": {"topology": "atlas-800t-a2"}})
    topology = from_catalog("atlas-800t-a2", 1)
    plan = plan_config(cfg, topology)
    flags = config_settings(cfg, plan)
    est = plan.chosen.estimate
    assert (flags["mode"], flags["prefill"], flags["decode"]) == ("pd", est.prefill_replicas,
                                                                 est.decode_replicas)
    assert flags["prefill"] + flags["decode"] == plan.layout.dp
    # each role's TP size is the plan's (the workers run it: pd/reshard.py)
    assert (flags["prefill_tp"], flags["decode_tp"]) == (plan.prefill_layout.tp,
                                                        plan.decode_layout.tp)


@pytest.mark.parametrize(
    ("data", "nodes", "message"),
    [
        ({"cluster": {"world_size": 4}, "service": {"mode": "pd"},
          "parallelism": {"strategy": "tp_pp_dp", "pipeline_parallel_size": 2,
                          "data_parallel_size": 2}},
         1, "PD with pp=2 per worker is not supported"),
        ({"cluster": {"world_size": 16}, "parallelism": {"strategy": "dp", "data_parallel_size": 16}},
         2, "the layout spans 2 hosts"),
    ],
)
def test_a_plan_the_engine_cannot_run_is_refused_by_name(data, nodes, message):
    cfg = load_config(data)
    topology = from_catalog("atlas-800t-a2", nodes)
    with pytest.raises(UnservablePlanError, match=re.escape(message)):
        check_servable(plan_config(cfg, topology), topology)


@pytest.mark.parametrize(("parallelism", "flags"), [
    ({"strategy": "pp", "pipeline_parallel_size": 2}, {"tp": 1, "pp": 2, "dp": 1}),
    ({"strategy": "dp", "data_parallel_size": 2}, {"tp": 1, "pp": 1, "dp": 2}),
    ({"strategy": "tp_pp", "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
     {"tp": 2, "pp": 2, "dp": 1}),
])
def test_pp_and_colocated_dp_plans_drive_the_pp_and_dp_flags(parallelism, flags):
    world = flags["tp"] * flags["pp"] * flags["dp"]
    cfg = load_config({"cluster": {"world_size": world}, "parallelism": parallelism})
    topology = from_catalog("atlas-800t-a2", 1)
    plan = plan_config(cfg, topology)
    check_servable(plan, topology)
    given = config_settings(cfg, plan)  # the plan's engine layout as one value, dp as replicas
    layout = given["layout"]
    assert {"tp": layout.tp, "pp": layout.pp, "dp": given["dp"]} == flags


def test_the_example_plans_one_servable_layout_here():
    cfg = load_config(EXAMPLE)
    topology = discover()
    plan = plan_config(cfg, topology)
    check_servable(plan, topology)


def test_the_spec_round_trips_through_json_every_part_typed(tmp_path):
    spec, _, _ = _serve(tmp_path, BASE + "kv_cache: {offload: 'host=64MiB'}\n", "--mode",
                        "colocated", "--router-weights", "1,2,3", "--kv-cache-dtype", "int8")
    text = json.dumps(spec.to_json())
    again = ServeSpec.from_json(json.loads(text))
    assert again == spec and again.plan == spec.plan
    assert again.engine.kv_offload.host_bytes == 64 * 2**20
    assert again.pd.weights.kv_usage == 3.0 and again.engine.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="not a ServeSpec's JSON"):
        ServeSpec.from_json({"engine": {}})


def test_target_step_ms_reaches_every_engine_through_the_spec():
    from kthena_serve.engine.config import DEFAULT_TARGET_STEP_MS

    default = spec_from_args(build_parser().parse_args(["serve"]))
    assert default.engine.target_step_ms == DEFAULT_TARGET_STEP_MS
    for argv, value in [(["--target-step-ms", "50"], 50.0), (["--target-step-ms", "0"], 0.0)]:
        spec = spec_from_args(build_parser().parse_args(["serve", *argv]))
        assert spec.engine.target_step_ms == value
        assert ServeSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    pd = spec_from_args(build_parser().parse_args(["serve", "--mode", "pd",
                                                   "--target-step-ms", "40"]))
    assert pd.engine.target_step_ms == 40.0  # the decode workers' engines (JSON to each)


def test_the_api_key_never_reaches_the_json():
    spec = ServeSpec.resolve({"api_key": "s3cret"})
    assert spec.api_key == "s3cret" and "s3cret" not in json.dumps(spec.to_json())
    assert "s3cret" not in repr(spec)


def test_a_yaml_pipeline_split_reaches_the_engine_through_the_spec(tmp_path):
    yaml_text = ("cluster: {topology: atlas-800t-a2, world_size: 2}\n"
                 "parallelism: {strategy: pp, pipeline_parallel_size: 2}\n")
    spec, config, plan = _serve(tmp_path, yaml_text)
    assert (config.pp, config.tp, plan.layout.pp) == (2, 1, 2)
    assert spec.served()["pp"] == 2 and spec.plan["layout"]["pp"] == 2


def test_pd_reports_its_worker_counts_not_a_dp_of_their_sum():
    spec = ServeSpec.resolve({"mode": "pd", "prefill": 1, "decode": 2})
    assert spec.served() == {"tp": 1, "pp": 1, "dp": 1, "sp": 1, "mode": "pd", "prefill": 1,
                             "decode": 2, "prefill_tp": 1, "decode_tp": 1}
    roles = ServeSpec.resolve({"mode": "pd", "tp": 2, "decode_tp": 4}).served()
    assert (roles["prefill_tp"], roles["decode_tp"]) == (2, 4)
    assert (str(spec.layout), spec.mode) == ("tp=1 pp=1 dp=1 sp=1", "pd")


@pytest.mark.parametrize(("flags", "message"), [
    ({"tpp": 2}, "unknown setting(s) tpp; allowed:"),
    ({"dtype": "int4"}, "--dtype: EngineConfig.dtype must be"),
    ({"enable_prefix_caching": False, "kv_events": "redis://127.0.0.1:1", "pod_name": "a.b"},
     "--kv-events: nothing is cached with --no-prefix-caching"),
    ({"router_weights": "1,2"}, "--router-weights: takes overlap,load,kv_usage"),
    ({"pod_name": "a.b"}, "--pod-name takes effect only with --kv-events"),
    ({"mode": "pd", "decode": 0}, "PD needs at least one decode worker"),
    ({"mode": "pd", "prefill": -1}, "PD needs at least one decode worker and no negative"),
    ({"target_step_ms": -1.0}, "--target-step-ms: EngineConfig.target_step_ms must be None or "
     "0 (off), or milliseconds up to 60000 (got -1.0)"),
])
def test_resolve_refuses_bad_settings_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServeSpec.resolve(flags)


@pytest.mark.slow
def test_kthena_serve_config_prints_the_plan_serves_it_and_answers():
    env = {k: v for k, v in os.environ.items() if k != "KTHENA_API_KEY"}
    proc, url, text = start_serve("--config", EXAMPLE, "--port", "0", "--kv-cache-memory",
                                  "128MiB")
    try:
        assert "plan      TP1 x PP1 x DP1" in text, text
        planned = re.search(r"plan layout (.+)", text).group(1)
        served = re.search(r"serving layout (.+)", text).group(1)
        assert planned == served == "tp=1 pp=1 dp=1 sp=1 mode=colocated", text
        reply = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"model": "default", "prompt": "The capital of France is",
                                 "max_tokens": 4, "temperature": 0}).json()
        assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] > 0
        report = httpx.get(f"{url}/plan", timeout=30).json()
        assert report["served"] == {"tp": 1, "pp": 1, "dp": 1, "sp": 1, "mode": "colocated"}
        printed = subprocess.run([sys.executable, "-m", "kthena_core.cli", "plan", "--config",
                                  EXAMPLE, "--json", "--candidates", "3"], capture_output=True,
                                 text=True, check=True, env=env)
        assert report["plan"] == json.loads(printed.stdout)  # what kthena plan prints
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert ('kthena_deployment_info{dp="1",mode="colocated",pp="1",sp="1",tp="1"} 1.0'
                in metrics), metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
