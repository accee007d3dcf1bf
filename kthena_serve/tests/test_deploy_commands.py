"""The commands `kthena deploy k8s` puts in its pods are this layer's real entry points.

kthena_core renders the manifests but may not import kthena_serve, so the check that each
rendered command parses, with the very parser its entry point uses, and builds a valid engine
config, lives here. Kubernetes expands ``$(POD_NAME)`` / ``$(POD_IP)`` from the container's env
before the process starts; the test does the same.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path
from unittest import mock

import pytest
from fastapi import FastAPI

from kthena_core.cli import build_parser
from kthena_core.deploy import load_deploy_spec, plan_deployment, render_model_serving
from kthena_core.deploy.k8s import API_KEY_ENV, HEALTH_PATH, PD_SECRET_ENV
from kthena_serve.cli import _cmd_serve, spec_from_args
from kthena_serve.cluster.auth import SECRET_ENV, check_prefill_url
from kthena_serve.model.source import served_name
from kthena_serve.pd import worker
from kthena_serve.pd.config import Transport

ATLAS = str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "atlas-800t-a2.yaml")
POD_NETWORK = "10.244.0.0/16"
PD_CPU = {"name": "smollm2-pd", "image": "kthena-worker:test", "topology": "cpu-host",
          "num_nodes": 2, "mode": "pd", "pod_network": POD_NETWORK}
COLOCATED_CPU = {k: v for k, v in {**PD_CPU, "name": "smollm2", "mode": "colocated"}.items()
                 if k != "pod_network"}
LLAMA_ATLAS = {"name": "llama-2-70b", "image": "kthena-worker:test", "model": "llama-2-70b",
               "checkpoint": "/mnt/models/Llama-2-70b-hf", "topology": ATLAS, "num_nodes": 2}
POD = {"POD_NAME": "smollm2-pd-0-decode-0-0", "POD_IP": "10.1.2.3", "POD_NAMESPACE": "serving"}
REDIS = "redis://redis.kthena-system:6379"


def containers(data: dict) -> dict[str, dict]:
    serving = render_model_serving(plan_deployment(load_deploy_spec(data)))
    return {r["name"]: r["entryTemplate"]["spec"]["containers"][0]
            for r in serving["spec"]["template"]["roles"]}


def expand(args: list[str]) -> list[str]:
    out = []
    for arg in args:
        for name, value in POD.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


def test_pd_workers_parse_with_the_worker_parser_and_build_valid_configs():
    for role, container in containers(PD_CPU).items():
        program, flag, module = container["command"]
        assert (program, flag) == ("python3", "-m") and find_spec(module) is not None
        assert module == worker.__name__
        args = worker._parse(expand(container["args"]))
        assert (args.role, args.host, args.port) == (role, "0.0.0.0", 8000)
        assert args.name == POD["POD_NAME"] and args.mooncake_host == POD["POD_IP"]
        spec = worker._spec(args)  # the ServeSpec the worker serves
        # the name `kthena serve` serves the default model as, not the catalog name
        assert spec.served_model_name == served_name("default") == "SmolLM2-135M-Instruct"
        config = spec.engine
        assert (config.model, config.device, config.tp) == ("default", "cpu", 1)
        assert spec.pd.transport is Transport.MOONCAKE
        assert spec.public_metrics  # kthena-router scrapes /metrics without the secret


def test_a_decode_pod_allows_prefill_pods_of_the_pod_network_only():
    """What the decode worker's ``--prefill-hosts`` becomes, checked as it checks hosts."""
    args = {role: worker._parse(expand(c["args"])) for role, c in containers(PD_CPU).items()}
    assert args["decode"].prefill_hosts == POD_NETWORK
    hosts = [h.strip() for h in args["decode"].prefill_hosts.split(",")]
    check_prefill_url("http://10.244.3.17:8000", hosts)  # a prefill pod's remote_host
    for outside in ("http://127.0.0.1:8000", "http://10.245.0.1:8000"):
        with pytest.raises(ValueError, match="not a prefill worker host"):
            check_prefill_url(outside, hosts)


@pytest.fixture
def pod_npus(monkeypatch):
    """The Atlas pod's 8 NPUs, as kthena_comm would count them there: EngineConfig refuses a
    device the host lacks, and this host has no NPU."""
    from kthena_comm import device

    entry = device.device_backend("npu")
    monkeypatch.setitem(device._REGISTRY, "npu", device.DeviceBackend(
        "npu", entry.backend, entry.prepare, lambda: 8, entry.requirement))


@pytest.mark.parametrize("data", [COLOCATED_CPU, LLAMA_ATLAS], ids=["cpu", "llama-2-70b-910b"])
def test_colocated_pods_run_kthena_serve_with_flags_it_accepts(data, pod_npus):
    (container,) = containers(data).values()
    assert container["command"] == ["kthena"]
    (script,) = entry_points(group="console_scripts", name="kthena")
    assert script.value == "kthena_core.cli:main"
    args = build_parser().parse_args(expand(container["args"]))
    assert args.func is _cmd_serve
    spec = spec_from_args(args)  # the same check `kthena serve` runs before loading anything
    assert (spec.host, spec.port, spec.mode) == ("0.0.0.0", 8000, "colocated")
    assert spec.public_metrics  # kthena-router scrapes /metrics without the API key
    config = spec.engine
    assert config.tp == int(container["args"][container["args"].index("--tp") + 1])


def test_llama_pods_ask_the_engine_for_the_plans_tp_on_the_npu(pod_npus):
    (container,) = containers(LLAMA_ATLAS).values()
    config = spec_from_args(build_parser().parse_args(container["args"])).engine
    assert (config.tp, config.device, config.model) == (8, "npu", "/mnt/models/Llama-2-70b-hf")


def test_the_secret_travels_in_the_variable_the_pd_auth_reads():
    assert PD_SECRET_ENV == SECRET_ENV
    for container in containers(PD_CPU).values():
        assert SECRET_ENV in {e["name"] for e in container["env"]}
        assert SECRET_ENV not in " ".join(container["args"])


@pytest.mark.parametrize("data", [PD_CPU, COLOCATED_CPU], ids=["pd", "colocated"])
def test_kv_events_make_each_pod_publish_under_its_own_name(data, monkeypatch):
    """The rendered --kv-events / --pod-name, expanded as Kubernetes does, give the owner name
    kthena-router's plugin compares ({pod name}.{namespace}) in both entry points."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for role, container in containers({**data, "kv_events": REDIS}).items():
        argv = expand(container["args"])
        if role == "serve":
            config = spec_from_args(build_parser().parse_args(argv)).kv_events
        else:
            config = worker._spec(worker._parse(argv)).kv_events
        assert (config.redis_url, config.pod, config.model) == (
            REDIS, f"{POD['POD_NAME']}.{POD['POD_NAMESPACE']}", "SmolLM2-135M-Instruct")


@pytest.mark.parametrize("data", [PD_CPU, COLOCATED_CPU, {**PD_CPU, "kv_events": REDIS},
                                  {**COLOCATED_CPU, "kv_events": REDIS}],
                         ids=["pd", "colocated", "pd-kv-events", "colocated-kv-events"])
def test_every_variable_the_args_name_is_in_the_pods_env(data):
    """Kubernetes expands $(VAR) only from the container's env; an unknown one stays as text."""
    for container in containers(data).values():
        names = set(re.findall(r"\$\((\w+)\)", " ".join(container["args"])))
        assert names <= {e["name"] for e in container["env"]}


def test_the_api_key_travels_in_the_variable_both_entry_points_read(monkeypatch):
    for container in [*containers(PD_CPU).values(), *containers(COLOCATED_CPU).values()]:
        (key,) = [e for e in container["env"] if e["name"] == API_KEY_ENV]
        assert set(key["valueFrom"]) == {"secretKeyRef"}
    monkeypatch.setenv(API_KEY_ENV, "key-of-the-pd-worker")
    assert worker._take_api_key() == "key-of-the-pd-worker"
    monkeypatch.setenv(API_KEY_ENV, "key-of-kthena-serve")
    (container,) = containers(COLOCATED_CPU).values()
    spec = spec_from_args(build_parser().parse_args(expand(container["args"])))
    assert spec.api_key == "key-of-kthena-serve"


def test_the_probed_path_is_served_by_both_kinds_of_worker():
    from kthena_serve.pd.server import common_routes
    from kthena_serve.server import build_app

    pd_app = FastAPI()
    common_routes(pd_app, lambda: b"", lambda: True)
    assert HEALTH_PATH in {route.path for route in pd_app.routes}
    app = build_app(mock.MagicMock(), model_name="m")
    assert HEALTH_PATH in {route.path for route in app.routes}


def test_the_features_a_deploy_file_asks_for_reach_the_engine_config():
    """int8 weights and KV, and a KV offload with a Mooncake Store below it (listening on the
    pod's IP), as `kthena serve` reads the rendered flags."""
    store = "mooncake@mooncake-master.kthena-system:50051"
    data = {**COLOCATED_CPU, "workload": {"dtype": "int8", "kv_dtype": "int8"},
            "kv_offload": f"host=1GiB,store={store}"}
    (container,) = containers(data).values()
    config = spec_from_args(build_parser().parse_args(expand(container["args"]))).engine
    assert (config.dtype, config.quantization, config.kv_cache_dtype) == (
        "bfloat16", "int8", "int8")
    offload = config.kv_offload
    assert (offload.host_bytes, offload.store_address, offload.store_listen) == (
        1 << 30, "mooncake-master.kthena-system:50051", POD["POD_IP"])


def test_expert_parallel_reaches_the_engine_config(pod_npus):
    """deploy.yaml's expert_parallel is the engine's --enable-expert-parallel (the model is set
    on the checked spec: the test holds whichever MoE architectures the engine serves)."""
    import attrs

    from kthena_core.known_models import load_model_spec

    spec = attrs.evolve(load_deploy_spec({**LLAMA_ATLAS, "num_nodes": 1, "expert_parallel": True}),
                        model=load_model_spec("mixtral-8x7b"))
    serving = render_model_serving(plan_deployment(spec))
    (role,) = serving["spec"]["template"]["roles"]
    args = role["entryTemplate"]["spec"]["containers"][0]["args"]
    config = spec_from_args(build_parser().parse_args(args)).engine
    assert (config.tp, config.expert_parallel) == (8, True)
