"""One engine over two "hosts": two network namespaces joined by a veth pair, each running
``kthena-run --config C --node_rank R serve --config C``. The config pins PP=2 over a two-node
topology, so stage 0 (and the API) runs in namespace A, stage 1 in namespace B, and every step's
activations cross the veth link over gloo. The greedy completion must equal one local engine's.

(The PD split over two namespaces, KV moved by the Mooncake Transfer Engine, is
test_pd_mooncake.py's and test_pd_connector.py's.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _netns import two_host_network

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are"
CLIENT = """
import json, sys, httpx
reply = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=120, json={
    "model": "default", "prompt": sys.argv[1], "max_tokens": 12, "temperature": 0})
print(json.dumps({"status": reply.status_code, "body": reply.json()}))
"""


def _two_node_topology(path: Path) -> None:
    from kthena_core.discovery import discover

    data = discover().to_dict()
    data["nodes"] = data["nodes"] * 2  # this host's CPU, twice: one per namespace
    data["name"] = "two CPU hosts"
    path.write_text(yaml.safe_dump(data))


def _wait_for(log: Path, text: str, procs: list[subprocess.Popen], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = log.read_text(errors="replace")
        if text in seen:
            return seen
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} within {timeout_s}s; log:\n{log.read_text()[-4000:]}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _veth_bytes(ns: str) -> int:
    shown = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show"], capture_output=True,
                           text=True, check=True)
    return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(shown.stdout)
               if link["ifname"] != "lo")


def serve_across_and_ask(launches: list[tuple[list[str], dict | None]], namespaces: tuple[str, str],
                         logs: list[Path], cwd: Path, client_args: list[str],
                         client: str = CLIENT) -> tuple[dict, int]:
    """Start ``launches[i]`` (argv, env) in ``namespaces[i]``, wait for rank 0's API and for
    rank 1, send PROMPT from the first namespace with ``client`` (``client_args`` after the
    prompt), stop both whatever happens; (the reply, bytes received in the second namespace
    while it was answered). Rank 0 must report the PP=2 layout it serves."""
    procs: list[subprocess.Popen] = []
    try:
        for (argv, env), ns, log in zip(launches, namespaces, logs, strict=True):
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env,
                                          stdout=log.open("w"), stderr=subprocess.STDOUT,
                                          cwd=cwd))
        node0 = _wait_for(logs[0], "\ncurl ", procs, 300)
        assert "serving layout tp=1 pp=2 dp=1 sp=1 mode=colocated" in node0, node0[-3000:]
        node1 = logs[1].read_text()
        assert "rank 1 of 2" in node1, node1[-3000:]
        before = _veth_bytes(namespaces[1])
        done = subprocess.run(["ip", "netns", "exec", namespaces[0], sys.executable, "-c",
                               client, PROMPT, *client_args], capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        reply = json.loads(done.stdout.strip().splitlines()[-1])
        assert reply["status"] == 200, reply
        moved = _veth_bytes(namespaces[1]) - before
    finally:
        _stop(procs)
    assert all(p.returncode is not None for p in procs)
    return reply, moved


def local_greedy_text() -> str:
    """PROMPT's 12 greedy tokens from one local fp32 engine (what both hosts must serve)."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    llm = LLM(dtype="float32", num_kv_blocks=64)
    try:
        return llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].text
    finally:
        llm.close()


def test_pipeline_stages_on_two_hosts_serve_the_local_engines_tokens(tmp_path):
    _two_node_topology(tmp_path / "two-hosts.yaml")
    kthena_run = Path(sys.executable).with_name("kthena-run")
    with two_host_network("pp", 215) as (ns_a, ns_b, addr_a, _addr_b):
        (tmp_path / "deploy.yaml").write_text(
            "cluster: {topology: two-hosts.yaml, nnodes: 2, world_size: 2, "
            f"master_addr: {addr_a}, master_port: 29400}}\n"
            "parallelism: {strategy: pp, pipeline_parallel_size: 2}\n"
            "model: {dtype: float32}\n"
            "service: {host: 127.0.0.1, port: 8000, max_batch_size: 8}\n"
            "kv_cache: {memory_pool_size: 64MiB}\n")
        config = str(tmp_path / "deploy.yaml")
        launches = [([str(kthena_run), "--config", config, "--node_rank", str(rank), "serve",
                      "--config", config], None) for rank in range(2)]
        reply, moved = serve_across_and_ask(
            launches, (ns_a, ns_b), [tmp_path / "node0.log", tmp_path / "node1.log"], tmp_path,
            [])
        node0 = (tmp_path / "node0.log").read_text()
        assert "plan layout tp=1 pp=2 dp=1 sp=1 mode=colocated" in node0
    assert reply["body"]["choices"][0]["text"] == local_greedy_text()
    # stage 0 -> stage 1 activations (12 steps of [tokens, 2, 576] fp32) crossed the veth link
    assert moved > 12 * 2 * 576 * 4, moved
