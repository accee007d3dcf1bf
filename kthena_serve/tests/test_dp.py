"""``kthena serve --dp 2`` end to end, and its pieces without processes (``Router.pick``, the
routing choice itself, is tested with what PD and DP share in test_cluster.py).

One real deployment (two replicas of the default model, a tiny KV pool, an API key) serves
the process tests, in file order: greedy parity with one engine, spreading under load, prefix
affinity, pass-through of errors and metrics, a killed replica, and SIGTERM last. A colocated
engine in this process gives the reference tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _support import metric_value, wait_until
from _tiny import default_tokenizer, greedy_text

from kthena_serve.bench.soak import process_tree
from kthena_serve.cluster.router import Router
from kthena_serve.dp.frontend import REPLICA_HEADER, routing_prompt
from kthena_serve.dp.launcher import ROLE, ReplicaLauncher, replica_specs
from kthena_serve.dp.metrics import merge_replica_metrics
from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.spec import ServeSpec

API_KEY = "dp-test-key"
# "--kernels native" on both sides of a token comparison: see _tiny.PD_ENGINE
FLAGS = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "8", "--shutdown-timeout", "2",
         "--kernels", "native"]
TEXT = ("Data-parallel serving runs whole copies of the engine side by side, and a router in "
        "front sends each request to the copy that already holds its prompt in cache. ")


# ---- without processes --------------------------------------------------------------------------
def _router(num_replicas: int = 2, block_size: int = 4) -> Router:
    workers = [(f"replica-{i}", ROLE, f"http://r{i}") for i in range(num_replicas)]
    router = Router(workers, PDConfig(), block_size=block_size)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    return router


def test_replica_cores_and_threads() -> None:
    assert [s.cores for s in replica_specs([0, 1], 2)] == [(0,), (1,)]
    assert [s.cores for s in replica_specs([3], 2)] == [(3,), (3,)]  # i % ncores
    assert [s.cores for s in replica_specs([0, 1, 2, 3, 4], 2)] == [(0, 1, 2), (3, 4)]
    assert [s.name for s in replica_specs([0], 3)] == ["replica-0", "replica-1", "replica-2"]
    with pytest.raises(ValueError, match="at least one"):
        replica_specs([0, 1], 0)
    launcher = ReplicaLauncher(EngineConfig(tp=2), 2, "m", cores=[0, 1, 2, 3, 4, 5])
    try:
        worker = launcher.workers["replica-0"]
        assert worker.spec.cores == (0, 1, 2) and launcher.threads_per_rank(worker) == 1
        env = launcher._environment(worker)
        assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
        command = launcher._command(worker, Path("/tmp/ready"))
        assert launcher.secret not in " ".join(command)  # the environment only
        assert "--ranks" in command and command[command.index("--ranks") + 1] == "2"
    finally:
        launcher.stop()


def test_routing_prompt_is_what_the_replica_hashes() -> None:
    from kthena_serve.dp.serve import _routing_processor

    processor = _routing_processor(EngineConfig())
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                       "cache_salt": "t"}).encode()
    assert routing_prompt("/v1/chat/completions", body, processor) == (
        processor.encode_chat([{"role": "user", "content": "Hi"}]), "t")
    body = json.dumps({"model": "m", "prompt": ["first text", "second"]}).encode()
    assert routing_prompt("/v1/completions", body, processor) == (
        processor.encode("first text"), None)
    body = json.dumps({"model": "m", "prompt": [5, 6, 7]}).encode()
    assert routing_prompt("/v1/completions", body, processor) == ([5, 6, 7], None)
    for bad in (b"{not json", b'{"model": "m", "prompt": "x", "bogus": 1}', b"[]"):
        assert routing_prompt("/v1/completions", bad, processor) == ([], None)


def test_routing_prompt_follows_the_encode_rule_with_a_bos_tokenizer() -> None:
    from test_bos_tokens import BOS, bos_tokenizer

    from kthena_serve.engine.input_processor import EngineLimits, InputProcessor

    tokenizer = bos_tokenizer("add_bos_token")
    processor = InputProcessor(tokenizer, EngineLimits(max_model_len=2048, vocab_size=49152,
                                                       max_n=4, num_kv_blocks=0, block_size=16))
    bos = tokenizer.token_to_id(BOS)

    def route(path: str, **body) -> list[int]:
        return routing_prompt(path, json.dumps({"model": "m", **body}).encode(), processor)[0]

    text = route("/v1/completions", prompt="Hello there")
    assert text == tokenizer.encode("Hello there", add_special_tokens=True) and text[0] == bos
    assert route("/v1/completions", prompt="Hello there", add_special_tokens=False) == text[1:]
    messages = [{"role": "user", "content": "Hi"}]
    chat = route("/v1/chat/completions", messages=messages)
    assert chat == tokenizer.encode_chat(messages) and chat[0] != bos  # the template's own
    assert route("/v1/chat/completions", messages=messages, add_special_tokens=True) == [
        bos, *chat]
    assert route("/v1/chat/completions", messages=messages, add_generation_prompt=False) == (
        tokenizer.encode_chat(messages, add_generation_prompt=False))
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    with_tools = route("/v1/chat/completions", messages=messages, tools=[tool])
    assert len(with_tools) > len(chat)  # the tools are rendered, as the replica renders them


def test_remembered_prompts_keep_the_index_bounded() -> None:
    workers = [(f"replica-{i}", ROLE, f"http://r{i}") for i in range(2)]
    router = Router(workers, PDConfig(), block_size=4, index_max_entries=40)
    for worker in router.workers.values():
        worker.is_up = True
    for i in range(300):  # distinct prompts whose blocks no replica ever confirms
        pick = router.pick(ROLE, list(range(1000 * i, 1000 * i + 16)), remember=True)
        router.done(pick.worker.name)
        assert router.index.num_entries <= 40
    assert router.index.num_entries == 40 and router.index.num_dropped == 300 * 4 - 40
    recent = list(range(299_000, 299_016))
    assert max(router.index.match(recent).values()) == 4  # the newest prompt is kept
    pick = router.pick(ROLE, list(range(5000_000, 5000_016)), remember=True)
    router.forget_remembered(pick)  # its replica answered with an error
    assert router.index.match(list(range(5000_000, 5000_016))) == {
        "replica-0": 0, "replica-1": 0}


def test_replica_metrics_merge_with_a_replica_label() -> None:
    one = ('# HELP kthena_requests_total Finished\n# TYPE kthena_requests_total counter\n'
           'kthena_requests_total{finish_reason="stop"} 3.0\n')
    two = one.replace("3.0", "4.0")
    text = merge_replica_metrics({"replica-0": one, "replica-1": two}).decode()
    assert text.count("# TYPE kthena_requests_total counter") == 1
    assert 'kthena_requests_total{finish_reason="stop",replica="replica-0"} 3.0' in text
    assert 'kthena_requests_total{finish_reason="stop",replica="replica-1"} 4.0' in text
    assert merge_replica_metrics({}) == b""


def _flags(**values) -> dict:
    return {"dp": 2, "mode": "colocated", "kv_events": None, **values}


@pytest.mark.parametrize(("values", "message"), [
    ({"dp": 0}, "--dp: must be at least 1"),
    ({"mode": "pd"}, "--dp 2: not supported with --mode pd"),
    ({"kv_events": "redis://127.0.0.1:6379"}, "--dp 2: not supported with --kv-events"),
])
def test_refused_flag_combinations(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ServeSpec.resolve(_flags(**values))
    ServeSpec.resolve(_flags(dp=1, mode="colocated"))  # no --dp: nothing to check


# ---- one real deployment ------------------------------------------------------------------------
def _kthena(*args: str, api_key: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("KTHENA_API_KEY", None)
    if api_key:
        env["KTHENA_API_KEY"] = api_key
    return subprocess.Popen([sys.executable, "-m", "kthena_core.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _descendants(pid: int) -> set[int]:
    return set(process_tree(pid)[1:])


def _alive(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    except OSError:
        return False


class Deployment:
    """``kthena serve --dp 2`` in a subprocess; its output is read on a thread."""

    def __init__(self) -> None:
        self.proc = _kthena("--dp", "2", "--port", "0", *FLAGS, api_key=API_KEY)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_until(lambda: self.url is not None or self.proc.poll() is not None, 300,
                   "the router's ready line")
        assert self.url, "kthena serve --dp 2 exited:\n" + "".join(self.lines)
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def url(self) -> str | None:
        for line in self.lines:
            match = re.search(r"on (http://\S+) \(replica", line)
            if match:
                return match.group(1)
        return None

    def replica_port(self, name: str) -> int:
        ports = [re.search(rf"dp replica {name} on 127\.0\.0\.1:(\d+)", line)
                 for line in self.lines]
        return int([m for m in ports if m][-1].group(1))

    def replica_pid(self, name: str) -> int | None:
        for pid in _descendants(self.proc.pid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"kthena_serve.dp.replica" in args and name.encode() in args and _alive(pid):
                return pid
        return None

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=120,
                          **kwargs)

    def complete(self, prompt: str, max_tokens: int = 8, **extra) -> httpx.Response:
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, **extra}
        return self.post("/v1/completions", body)

    def replicas(self) -> dict:
        return httpx.get(f"{self.url}/dp/replicas", headers=self.headers, timeout=10).json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def dp():
    deployment = Deployment()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def reference():
    from kthena_serve.engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=8,
                                                num_threads=1, kernels="native"))

    def generate(ids: list[int], max_tokens: int) -> str:
        return greedy_text(engine, ids, max_tokens)

    generate.processor = engine.processor
    yield generate
    engine.close()


def test_greedy_outputs_equal_one_engine(dp: Deployment, reference) -> None:  # noqa: ANN001
    for i, prompt in enumerate(["The capital of France is", "Once upon a time, there",
                                "def fibonacci(n):"]):
        reply = dp.complete(prompt, max_tokens=12)
        assert reply.status_code == 200, reply.text
        assert reply.headers[REPLICA_HEADER] in {"replica-0", "replica-1"}
        expected = reference(reference.processor.encode(prompt), 12)
        assert reply.json()["choices"][0]["text"] == expected, i
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    chat = dp.post("/v1/chat/completions", {"model": "default", "messages": messages,
                                            "max_tokens": 10, "temperature": 0})
    assert chat.status_code == 200, chat.text
    expected = reference(reference.processor.encode_chat(messages), 10)
    assert chat.json()["choices"][0]["message"]["content"] == expected
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{dp.url}/v1/completions", json=body, headers=dp.headers,
                      timeout=120) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == reference(reference.processor.encode("The capital of France is"), 12)


def test_distinct_prompts_spread_across_replicas(dp: Deployment) -> None:
    prompts = [f"Request number {i}: write a word." for i in range(8)]  # < 1 block each
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda text: dp.complete(text, max_tokens=16), prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    served = [r.headers[REPLICA_HEADER] for r in replies]
    assert set(served) == {"replica-0", "replica-1"}, served


def test_a_client_that_leaves_ends_its_request_on_the_replica(dp: Deployment) -> None:
    body = {"model": "default", "prompt": "Tell me a very long story about the sea.",
            "max_tokens": 2800, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{dp.url}/v1/completions", json=body, headers=dp.headers,
                      timeout=120) as stream:
        served = stream.headers[REPLICA_HEADER]
        events = 0
        for line in stream.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leave: closing the stream drops the connection
    wait_until(lambda: dp.replicas()[served]["in_flight"] == 0, 20, "the router to let go")
    wait_until(lambda: dp.replicas()[served]["num_running"] == 0, 20,  # 2800 tokens take longer
               "the replica to abort the request")


def test_shared_prefix_goes_to_the_replica_that_holds_it(dp: Deployment) -> None:
    prefix = "Shared system prompt. " + TEXT * 3  # ~100 tokens: 6 full blocks of 16
    first = dp.complete(prefix + "Question one?", max_tokens=4)
    assert first.status_code == 200, first.text
    holder = first.headers[REPLICA_HEADER]
    before = metric_value(dp.metrics(), "kthena_dp_routed_requests_total{", replica=holder,
                          reason="prefix")
    for question in ("Question two?", "Question three?", "Question four?"):
        reply = dp.complete(prefix + question, max_tokens=4)
        assert reply.status_code == 200, reply.text
        assert reply.headers[REPLICA_HEADER] == holder
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * 16
    after = metric_value(dp.metrics(), "kthena_dp_routed_requests_total{", replica=holder,
                         reason="prefix")
    assert after - before == 3


def test_errors_models_tokenize_and_metrics_pass_through(dp: Deployment) -> None:
    unknown = dp.complete("x", model="nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{dp.url}/v1/completions", content=b"{not json", headers={
        **dp.headers, "content-type": "application/json"}, timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert dp.complete("x", max_tokens=0).status_code == 400
    no_key = httpx.post(f"{dp.url}/v1/completions", json={"model": "default", "prompt": "x"},
                        timeout=30)
    assert no_key.status_code == 401
    assert httpx.get(f"{dp.url}/health", timeout=10).json()["replicas_up"] == 2
    models = httpx.get(f"{dp.url}/v1/models", headers=dp.headers, timeout=10).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    tokens = dp.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert tokens.json()["tokens"] == default_tokenizer().encode("Hello world")
    text = dp.post("/detokenize", {"tokens": tokens.json()["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    schema = httpx.get(f"{dp.url}/openapi.json", headers=dp.headers, timeout=10)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    from kthena_serve import __version__

    assert httpx.get(f"{dp.url}/version", headers=dp.headers, timeout=10).json() == {
        "version": __version__}
    docs = httpx.get(f"{dp.url}/docs", headers=dp.headers, timeout=10)
    assert docs.status_code == 200 and "/openapi.json" in docs.text
    text = dp.metrics()
    assert metric_value(text, "kthena_dp_replica_up{") == 2
    assert metric_value(text, "kthena_requests_total{", replica="replica-0") > 0
    assert metric_value(text, "kthena_requests_total{", replica="replica-1") > 0
    assert metric_value(text, "kthena_dp_routed_requests_total{") >= 16
    assert metric_value(text, "kthena_dp_replica_in_flight{") == 0  # every relayed answer let go


def test_replicas_take_only_the_deployment_secret(dp: Deployment) -> None:
    port = dp.replica_port("replica-0")
    direct = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{direct}/health", timeout=10).status_code == 200
    for headers in ({}, dp.headers):  # the public key is not the replicas' secret
        reply = httpx.post(f"{direct}/v1/completions", headers=headers, timeout=10,
                           json={"model": "default", "prompt": "x"})
        assert reply.status_code == 401
    cmdline = Path(f"/proc/{dp.replica_pid('replica-0')}/cmdline").read_bytes()
    assert b"KTHENA_PD_SECRET" not in cmdline and API_KEY.encode() not in cmdline


def test_a_killed_replica_leaves_the_other_serving(dp: Deployment) -> None:
    old = dp.replica_pid("replica-1")
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not _alive(old), 30, "the killed replica to be reaped")
    wait_until(lambda: dp.replica_pid("replica-1") not in (None, old), 30, "its restart")
    new = dp.replica_pid("replica-1")
    os.kill(new, signal.SIGSTOP)  # held while loading: it cannot come back during the checks
    try:
        for i in range(3):
            reply = dp.complete(f"After the kill, request {i}.", max_tokens=4)
            assert reply.status_code == 200, reply.text
            assert reply.headers[REPLICA_HEADER] == "replica-0"
        wait_until(lambda: not dp.replicas()["replica-1"]["up"], 30, "replica-1 marked down")
        assert metric_value(dp.metrics(), "kthena_dp_replica_up{", replica="replica-1") == 0
    finally:
        os.kill(new, signal.SIGCONT)
    wait_until(lambda: dp.replicas()["replica-1"]["up"], 180, "replica-1 to be back")
    back = dp.complete("Back again: a fresh prompt.", max_tokens=4)  # picked least: replica-1
    assert back.status_code == 200 and back.headers[REPLICA_HEADER] == "replica-1"


def test_all_replicas_down_is_a_clear_503() -> None:
    """The front alone (no process), over a router whose replicas are all down."""
    from fastapi.testclient import TestClient

    from kthena_serve.dp.frontend import DPFrontend, build_dp_app
    from kthena_serve.dp.serve import _routing_processor

    router = _router()
    router.mark_down("replica-0")
    router.mark_down("replica-1")
    served = {"tp": 1, "pp": 1, "dp": 2, "sp": 1, "mode": "colocated"}
    app = build_dp_app(DPFrontend(router, _routing_processor(EngineConfig()), secret="s"),
                       deployment={"served": served, "plan": None, "config": None})
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"model": "default", "prompt": "x"})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["message"].startswith("no replica is up")
        assert client.get("/health").status_code == 503
        assert client.get("/plan").json()["served"] == served
        text = client.get("/metrics").text
        assert 'kthena_deployment_info{dp="2",mode="colocated",pp="1",sp="1",tp="1"} 1.0' in text
        assert metric_value(text, "kthena_dp_replica_up{") == 0


def test_sigterm_stops_every_replica(dp: Deployment) -> None:
    processes = _descendants(dp.proc.pid)
    assert dp.replica_pid("replica-0") in processes and dp.replica_pid("replica-1") in processes
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(timeout=60) == 0
    wait_until(lambda: not any(_alive(pid) for pid in processes), 30, "no process left")


@pytest.mark.parametrize(("flags", "message"), [
    (["--dp", "0"], "kthena serve: --dp: must be at least 1"),
    (["--dp", "2", "--mode", "pd"], "kthena serve: --dp 2: not supported with --mode pd"),
    (["--dp", "2", "--kv-events", "redis://127.0.0.1:1", "--pod-name", "a.b"],
     "kthena serve: --dp 2: not supported with --kv-events"),
])
def test_kthena_serve_refuses_bad_dp_flags(flags: list[str], message: str, capsys) -> None:  # noqa: ANN001
    from kthena_core.cli import main

    assert main(["serve", *flags, "--port", "0"]) == 2  # refused before anything starts
    assert message in capsys.readouterr().err
