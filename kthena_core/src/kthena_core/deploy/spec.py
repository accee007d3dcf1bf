"""deploy.yaml: what to deploy on which nodes, validated key by key into a `DeploySpec`.

The smallest file names the objects, the nodes and the mode; the image can come from
``--image``::

    name: smollm2-pd        # name of every object rendered (a DNS label)
    topology: cpu-host      # ONE node: a catalog node name or a topology YAML file
    num_nodes: 2            # how many such nodes
    mode: pd                # colocated (default) | pd
    pod_network: 10.244.0.0/16   # PD only, required: the cluster's pod CIDR

Optional keys: ``image``, ``namespace`` (default), ``model`` (default: SmolLM2-135M-Instruct;
anything ``kthena plan --model`` takes), ``checkpoint`` (the model folder on the nodes,
mounted read-only into each pod; ``default`` = the default model baked into the image),
``served_model_name`` (default: the name ``kthena serve --model MODEL`` serves,
``SmolLM2-135M-Instruct`` for the default model; a model file's own name), ``device`` +
``devices`` (a catalog device and how many per node, instead of ``topology``), ``pd`` (PD only: what is pinned of each
role, ``{prefill: {tp: 4, pp: 1, count: 1}, decode: {tp: 4}}``; the rest is the planner's
choice), ``num_prefill`` / ``num_decode`` (``plan`` or a count; PD only: the same as
``pd.prefill.count`` / ``pd.decode.count``), ``pod_network`` (PD only and required there: the network, or list of
networks, in CIDR notation that the pods' IPs come from; a decode worker accepts a prefill
worker's KV only from there), ``workload`` (`Workload` fields but ``mode``), ``port`` (8000),
``resources: {cpu, memory}`` (per worker pod), ``device_resource`` (the extended resource
name of the devices, e.g. ``huawei.com/ascend-1980``), ``kv_events`` (``redis://HOST:PORT``:
every worker publishes its KV cache's router chunks there, as its pod) and
``router_namespace`` (``kthena-system``: where kthena-router runs, which the NetworkPolicy
admits).

Engine features a worker runs with (each becomes its ``kthena serve`` flag, or is refused by name
where the engine cannot run it with the plan): ``workload.dtype: int8`` (weight-only int8,
``--quantization int8``, computed in bf16), ``workload.kv_dtype: int8`` (``--kv-cache-dtype
int8``), ``tp_overlap: true`` (``--tp-overlap``), ``kv_offload: host=SIZE[,...]``
(``--kv-offload``, colocated only), ``sequence_parallel: true`` (the planner weighs SP, which
``--sp`` runs; colocated only) and ``expert_parallel: true`` (``--enable-expert-parallel``: a
MoE model's experts split whole over each worker's TP ranks).

A bad file raises `DeployError` naming the key, the value and what is allowed; unknown keys
are errors, with the nearest known key suggested.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from kthena_core._yaml import read_yaml
from kthena_core.architectures import unserved_architecture
from kthena_core.config import ConfigError, load_pd_roles
from kthena_core.known_models import (
    catalog_name,
    is_repo_id,
    load_model_spec,
    names_default_model,
    served_name,
)
from kthena_core.model_spec import ModelSpec
from kthena_core.pd_roles import PDRoles, role_refusals
from kthena_core.redis_url import redacted_url, redis_url_problem
from kthena_core.sizes import parse_bytes
from kthena_core.topology import Topology, from_catalog
from kthena_core.workload import MODES, Workload

__all__ = ["DeployError", "DeploySpec", "load_deploy_spec"]

KEYS = ("name", "namespace", "image", "model", "checkpoint", "served_model_name", "topology",
        "device", "devices", "num_nodes", "mode", "num_prefill", "num_decode", "pod_network",
        "workload", "port", "resources", "device_resource", "kv_events", "router_namespace",
        "tp_overlap", "kv_offload", "sequence_parallel", "expert_parallel", "pd")
_RESOURCE_KEYS = ("cpu", "memory")
_WORKLOAD_KEYS = tuple(f.name for f in attrs.fields(Workload) if f.name != "mode")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_EXTENDED_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class DeployError(ConfigError):
    """A deploy.yaml value is missing, unknown, out of range, or the plan cannot be deployed."""


@attrs.frozen
class DeploySpec:
    """A validated deploy.yaml, with its model and topology resolved.

    Attributes:
        num_prefill, num_decode: the PD instance counts asked for; None means "as the plan
            splits" (they are ``pd_roles``' counts too).
        pd_roles: PD only: what is pinned of each role (tp, pp, count); the planner chooses
            the rest.
        cpu, memory: per worker pod; None means "from the plan" (see `plan_deployment`).
        device_resource: None means the usual name for the device kind.
        pod_network: PD only: the networks (CIDR) prefill pods' IPs come from, normalised.
        kv_events: the Redis every worker publishes its KV events to (``redis://HOST:PORT``),
            or None: none does.
        router_namespace: where kthena-router runs (the NetworkPolicy admits it).
        tp_overlap: workers run ``--tp-overlap`` (the plan must give them TP > 1).
        kv_offload: deploy.yaml's ``--kv-offload`` value, or None.
        kv_offload_bytes: host memory its tiers take in each pod (host tier, and the store
            segment when a store is named).
        sequence_parallel: the planner weighs SP (colocated only).
        expert_parallel: workers run ``--enable-expert-parallel`` (the plan must give them a
            TP that divides the experts).
    """

    name: str
    image: str
    model: ModelSpec
    topology: Topology
    workload: Workload
    served_model_name: str
    namespace: str = "default"
    checkpoint: str = "default"
    num_prefill: int | None = None
    num_decode: int | None = None
    port: int = 8000
    cpu: int | None = None
    memory: str | None = None
    device_resource: str | None = None
    pod_network: tuple[str, ...] = ()
    kv_events: str | None = None
    router_namespace: str = "kthena-system"
    tp_overlap: bool = False
    kv_offload: str | None = None
    kv_offload_bytes: int = 0
    sequence_parallel: bool = False
    expert_parallel: bool = False
    pd_roles: PDRoles = PDRoles()

    @property
    def mode(self) -> str:
        return self.workload.mode


def _fail(path: str, value: Any, allowed: str) -> DeployError:
    return DeployError(f"{path}: got {value!r}; allowed: {allowed}")


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], prefix: str = "") -> None:
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise DeployError(f"{prefix}{key}: unknown key{hint}; allowed keys: {', '.join(allowed)}")


def _string(data: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if value is None:
        raise DeployError(f"{key}: missing; it is required")
    if not isinstance(value, str) or not value.strip():
        raise _fail(key, value, "a non-empty string")
    return value


def _dns_label(data: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = _string(data, key, default)
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise _fail(key, value, "a DNS label: at most 63 lowercase letters, digits and '-', "
                                "starting and ending with a letter or digit")
    return value


def _positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(path, value, "an integer >= 1")
    return value


def _role_count(data: Mapping[str, Any], key: str, mode: str) -> int | None:
    if key not in data:
        return None
    if mode != "pd":
        raise _fail(key, data[key], "only with mode: pd (a colocated deployment has no roles to split)")
    if data[key] == "plan":
        return None
    return _positive_int(data[key], key)


_POD_NETWORK_ALLOWED = ("a network in CIDR notation, or a list of them (dual stack): the "
                        "cluster's pod CIDR, e.g. 10.244.0.0/16 (kubectl cluster-info dump | "
                        "grep -m1 cluster-cidr)")


def _pd_roles(data: Mapping[str, Any], mode: str, model: ModelSpec) -> PDRoles:
    """deploy.yaml's ``pd`` section with ``num_prefill`` / ``num_decode`` as its counts,
    checked against the model's heads and layers."""
    if "pd" in data and mode != "pd":
        raise _fail("pd", data["pd"], "only with mode: pd (it pins the prefill and decode "
                                      "roles)")
    try:
        roles = load_pd_roles(data.get("pd"))
    except ConfigError as error:
        raise DeployError(str(error)) from None
    for role, key in (("prefill", "num_prefill"), ("decode", "num_decode")):
        count = _role_count(data, key, mode)
        if count is None:
            continue
        pinned = roles.pin(role).count
        if pinned is not None and pinned != count:
            raise _fail(key, count, f"pd.{role}.count's {pinned}, or one of the two keys")
        roles = attrs.evolve(roles, **{role: attrs.evolve(roles.pin(role), count=count)})
    refusals = role_refusals(model, roles)
    if refusals:
        raise DeployError(refusals[0])
    return roles


def _pod_network(data: Mapping[str, Any], mode: str) -> tuple[str, ...]:
    """The pod CIDR(s) a decode worker takes KV from (``--prefill-hosts``): required in PD
    mode, where prefill pod IPs are unknown until the pods run; refused otherwise."""
    if mode != "pd":
        if "pod_network" in data:
            raise _fail("pod_network", data["pod_network"], "only with mode: pd (decode "
                        "workers take KV only from prefill pods in this network; a colocated "
                        "deployment moves no KV between pods)")
        return ()
    if "pod_network" not in data:
        raise DeployError("pod_network: missing; mode: pd needs the network the pods' IPs "
                          "come from, e.g. pod_network: 10.244.0.0/16 (the cluster's pod "
                          "CIDR): a decode worker takes a prefill worker's KV, and sends it "
                          "the deployment secret, only within it")
    raw = data["pod_network"]
    if not isinstance(raw, list):
        return (_cidr(raw, "pod_network"),)
    if not raw:
        raise _fail("pod_network", raw, _POD_NETWORK_ALLOWED)
    return tuple(_cidr(value, f"pod_network[{i}]") for i, value in enumerate(raw))


def _cidr(value: Any, path: str) -> str:
    """``value`` as a normalised network; a host address, a bare IP or /0 is refused."""
    if not isinstance(value, str) or "/" not in value:
        raise _fail(path, value, _POD_NETWORK_ALLOWED)
    try:
        network = ipaddress.ip_network(value.strip())
    except ValueError:
        try:
            meant = ipaddress.ip_network(value.strip(), strict=False)
        except ValueError:
            raise _fail(path, value, _POD_NETWORK_ALLOWED) from None
        raise _fail(path, value, f"a network address; this one has host bits set (did you "
                                 f"mean {str(meant)!r}?)") from None
    if network.prefixlen == 0:
        raise _fail(path, value, "a network narrower than /0, which would make every address "
                                 "a prefill host a decode worker sends the secret to")
    return str(network)


def _kv_events(data: Mapping[str, Any]) -> str | None:
    """The Redis URL every worker gets as ``--kv-events`` (checked as ``kthena serve`` checks
    it); credentials are refused: the URL is in every pod's spec."""
    if "kv_events" not in data:
        return None
    value = data["kv_events"]
    problem = redis_url_problem(value)
    if problem is not None:
        raise DeployError(f"kv_events: {problem}; allowed: redis://HOST:PORT[/DB], the Redis "
                          "kthena-router reads")
    parts = urllib.parse.urlsplit(value)
    if parts.username is not None or parts.password is not None:
        raise _fail("kv_events", redacted_url(value), "redis://HOST:PORT[/DB] without a user "
                    "or password: the URL is written into every pod's command line")
    return value


def _flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")
    return value


def _colocated_flag(data: Mapping[str, Any], key: str, mode: str, why: str) -> bool:
    value = _flag(data, key)
    if value and mode != "colocated":
        raise _fail(key, value, f"false with mode: {mode} ({why})")
    return value


_KV_OFFLOAD_ALLOWED = ("kthena serve's --kv-offload value, host=SIZE[,store=mooncake@HOST:PORT]"
                       "[,write=spill|through][,segment=SIZE][,listen=ADDRESS][,queue=N]"
                       "[,timeout=SECONDS], e.g. host=4GiB")


def _kv_offload(data: Mapping[str, Any], mode: str) -> tuple[str | None, int]:
    """(the ``--kv-offload`` value, host bytes its tiers take) or (None, 0). The sizes are
    read here (they size the pod); the rest of the value is checked by ``kthena serve`` when
    the pod starts."""
    if "kv_offload" not in data:
        return None, 0
    value = data["kv_offload"]
    if mode != "colocated":
        raise _fail("kv_offload", value, "only with mode: colocated (kthena serve --mode pd "
                                         "refuses --kv-offload)")
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _fail("kv_offload", value, _KV_OFFLOAD_ALLOWED)
    items = [part.partition("=") for part in value.split(",")]
    keys = {key: size for key, sep, size in items if sep}
    if len(keys) != len(items) or "host" not in keys:
        raise _fail("kv_offload", value, _KV_OFFLOAD_ALLOWED)
    try:
        num_bytes = parse_bytes(keys["host"])
        if "store" in keys:  # the RAM lent to the store (kthena serve's default: 64 MiB)
            num_bytes += parse_bytes(keys.get("segment", "64MiB"))
    except ValueError as error:
        raise _fail("kv_offload", value, f"{_KV_OFFLOAD_ALLOWED} ({error})") from None
    return value, num_bytes


def _workload(data: Mapping[str, Any], mode: str) -> Workload:
    raw = data.get("workload") or {}
    if not isinstance(raw, Mapping):
        raise _fail("workload", raw, f"a mapping with keys {', '.join(_WORKLOAD_KEYS)}")
    if "mode" in raw:
        raise _fail("workload.mode", raw["mode"], "nothing: set mode at the top level")
    _check_keys(raw, _WORKLOAD_KEYS, "workload.")
    try:
        return Workload(**raw, mode=mode)
    except (ValueError, TypeError) as error:  # "workload concurrency must be > 0, got 0"
        message = str(error).removeprefix("workload ")
        raise DeployError(f"workload.{message}") from None


def _resources(data: Mapping[str, Any]) -> tuple[int | None, str | None]:
    raw = data.get("resources") or {}
    if not isinstance(raw, Mapping):
        raise _fail("resources", raw, "a mapping with keys cpu, memory")
    _check_keys(raw, _RESOURCE_KEYS, "resources.")
    cpu = _positive_int(raw["cpu"], "resources.cpu") if "cpu" in raw else None
    memory = raw.get("memory")
    if memory is not None and (not isinstance(memory, str) or not _QUANTITY.match(memory)):
        raise _fail("resources.memory", memory, "a Kubernetes quantity such as 64Gi or 512Mi")
    return cpu, memory


def _device_resource(data: Mapping[str, Any]) -> str | None:
    value = data.get("device_resource")
    if value is not None and (not isinstance(value, str) or not _EXTENDED_RESOURCE.match(value)):
        raise _fail("device_resource", value, "an extended resource name such as "
                                              "huawei.com/Ascend910 or nvidia.com/gpu")
    return value


def _checkpoint(data: Mapping[str, Any], model: ModelSpec, model_key: str) -> str:
    if "checkpoint" not in data:
        if names_default_model(model_key):
            return "default"
        raise DeployError(f"checkpoint: missing; model {model_key!r} has no weights in the "
                          "image: give the absolute path of its checkpoint folder on the nodes "
                          "(config.json, *.safetensors, tokenizer.json), mounted read-only into "
                          "each pod")
    value = _string(data, "checkpoint")
    if value != "default" and not value.startswith("/"):
        raise _fail("checkpoint", value, "'default' or an absolute path on the nodes")
    return value


def _image(data: Mapping[str, Any], override: str | None) -> str:
    value = override if override is not None else data.get("image")
    if value is None:
        raise DeployError("image: missing; give image: in the deploy config or --image "
                          "(the worker image built from deploy/Dockerfile)")
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise _fail("image", value, "an image reference without spaces, e.g. "
                                    "registry.example.com/kthena-worker:0.1.0")
    return value


def _model(data: Mapping[str, Any], base_dir: str) -> tuple[ModelSpec, str]:
    key = _string(data, "model", "default")
    local = os.path.join(base_dir, os.path.expanduser(key))
    named = catalog_name(key) is not None  # names win over paths, as in kthena plan
    try:
        model = load_model_spec(local if not named and os.path.exists(local) else key)
    except (ValueError, FileNotFoundError) as error:
        raise DeployError(f"model: {error}") from None
    why = unserved_architecture([model.architecture])
    if why is not None:
        raise DeployError(f"model: {key!r}: {why} (kthena serve would refuse it)")
    return model, key


def _served_name(model: ModelSpec, model_key: str) -> str:
    """The name ``kthena serve --model MODEL`` serves for a model named by one of its names
    (``SmolLM2-135M-Instruct`` for the default model); a model file's own name otherwise."""
    if catalog_name(model_key) is not None or is_repo_id(model_key):
        return served_name(model_key)
    return model.name


def _topology(data: Mapping[str, Any], base_dir: str) -> Topology:
    num_nodes = _positive_int(data["num_nodes"], "num_nodes") if "num_nodes" in data else None
    if ("topology" in data) == ("device" in data):
        raise DeployError("topology, device: give exactly one: topology (a catalog node name "
                          "or a topology YAML file describing one node) or device + devices "
                          "(a catalog device and how many per node)")
    if "device" in data:
        return _device_topology(data, num_nodes or 1)
    if "devices" in data:
        raise _fail("devices", data["devices"], "only with device (topology: describes its own devices)")
    spec = _string(data, "topology")
    try:
        if spec.endswith((".yaml", ".yml")):
            return _file_topology(os.path.join(base_dir, os.path.expanduser(spec)), num_nodes)
        if spec == "auto":
            raise _fail("topology", spec, "a catalog node name or a topology file: 'auto' "
                                          "discovers this machine, not the cluster's nodes")
        return from_catalog(spec, num_nodes or 1)
    except DeployError:
        raise
    except (ValueError, KeyError) as error:  # TopologyError, UnknownHardwareError
        message = error.args[0] if error.args else str(error)
        raise DeployError(f"topology: {message}") from None


def _device_topology(data: Mapping[str, Any], num_nodes: int) -> Topology:
    device = _string(data, "device")
    per_node = _positive_int(data.get("devices", 1), "devices")
    node = {"device": device, "devices": per_node, "count": num_nodes}
    try:
        return Topology.from_dict({"name": f"{num_nodes}x{per_node}x{device}", "nodes": [node]},
                                  origin="deploy.yaml device")
    except (ValueError, KeyError) as error:
        raise DeployError(f"device: {error.args[0] if error.args else error}") from None


def _file_topology(path: str, num_nodes: int | None) -> Topology:
    """The file's nodes; with ``num_nodes``, its one node repeated that many times."""
    if num_nodes is None:
        return Topology.from_yaml(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as error:
        raise DeployError(f"topology: cannot read {path}: {error}") from None
    nodes = raw.get("nodes") if isinstance(raw, Mapping) else None
    if not isinstance(nodes, list) or not nodes:
        return Topology.from_yaml(path)  # its own error names what is wrong
    counts = [n.get("count", 1) if isinstance(n, Mapping) else 1 for n in nodes]
    if len(nodes) > 1 or counts[0] != 1:
        if sum(counts) == num_nodes:
            return Topology.from_yaml(path)
        raise _fail("num_nodes", num_nodes, f"nothing, or {sum(counts)}: {path} already lists "
                                            f"{sum(counts)} nodes (give a one-node topology to repeat)")
    name = raw.get("name") or Path(path).stem
    data = {**raw, "name": f"{num_nodes}x{name}", "nodes": [{**nodes[0], "count": num_nodes}]}
    return Topology.from_dict(data, origin=path)


def load_deploy_spec(source: str | os.PathLike[str] | Mapping[str, Any], *,
                     image: str | None = None) -> DeploySpec:
    """Read and validate a deploy.yaml (a path, or an already-parsed mapping).

    Relative ``topology`` and ``model`` paths resolve against the file's folder.

    Args:
        image: overrides the file's ``image`` (``--image``).

    Raises:
        DeployError: unreadable file, unknown key, bad value; the message names the key.
    """
    data, folder = read_yaml(source, DeployError, "deploy config")
    base_dir = folder or os.getcwd()
    if not isinstance(data, Mapping):
        raise _fail("<top level>", data, f"a mapping with keys {', '.join(KEYS)}")
    _check_keys(data, KEYS)
    mode = _string(data, "mode", "colocated")
    if mode not in MODES:
        raise _fail("mode", mode, " or ".join(MODES))
    model, model_key = _model(data, base_dir)
    served = _string(data, "served_model_name", _served_name(model, model_key))
    if len(served) > 256:
        raise _fail("served_model_name", served, "at most 256 characters (ModelServer.spec.model)")
    port = data.get("port", 8000)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _fail("port", port, "a TCP port in 1..65535")
    cpu, memory = _resources(data)
    kv_offload, kv_offload_bytes = _kv_offload(data, mode)
    return DeploySpec(
        name=_dns_label(data, "name"), image=_image(data, image), model=model,
        topology=_topology(data, base_dir),
        workload=_workload(data, mode), namespace=_dns_label(data, "namespace", "default"),
        checkpoint=_checkpoint(data, model, model_key), served_model_name=served,
        num_prefill=_role_count(data, "num_prefill", mode),
        num_decode=_role_count(data, "num_decode", mode), port=port, cpu=cpu, memory=memory,
        device_resource=_device_resource(data), pod_network=_pod_network(data, mode),
        kv_events=_kv_events(data),
        router_namespace=_dns_label(data, "router_namespace", "kthena-system"),
        tp_overlap=_flag(data, "tp_overlap"), kv_offload=kv_offload,
        kv_offload_bytes=kv_offload_bytes, expert_parallel=_flag(data, "expert_parallel"),
        pd_roles=_pd_roles(data, mode, model),
        sequence_parallel=_colocated_flag(data, "sequence_parallel", mode, "the engine runs "
                                          "sequence parallelism in a colocated engine only"))
