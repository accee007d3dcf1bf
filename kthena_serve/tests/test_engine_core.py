"""The engine in a process of its own (``EngineCoreClient``): the same tokens as the engine in
process, the same errors, nothing left behind, and no stream left hanging when either process
dies.

Every engine here is a real spawned process over a tiny random checkpoint written to the test's
temp dir; the HTTP ones are the real app on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from _serve_process import start_serve, stop
from _tiny import finish_all, greedy_text, tiny_checkpoint
from test_backpressure import _slow_reader

from kthena_serve.engine import LLMEngine
from kthena_serve.engine.admission import OverloadedError
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import EngineDeadError
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.engine_core import EngineCoreClient
from kthena_serve.model.errors import CheckpointError
from kthena_serve.server import BackgroundServer, build_app

MODEL = "tiny"


def _config(folder, **options) -> EngineConfig:  # noqa: ANN001
    settings = {"model": str(folder), "dtype": "float32", "num_kv_blocks": 256, "block_size": 4,
                "max_num_batched_tokens": 64, "max_num_seqs": 8, "num_threads": 1,
                "kernels": "native"}
    settings.update(options)
    return EngineConfig(**settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("engine-core") / "tiny")


@pytest.fixture(scope="module")
def shared(checkpoint):
    """One engine process for the tests that leave it running (each counts from its own start)."""
    client = EngineCoreClient(_config(checkpoint)).start()
    yield client
    process = client._process
    client.shutdown()
    assert process.exitcode == 0 and not client.is_alive
    assert process not in multiprocessing.active_children()


def _wait(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """The live processes ``pid`` spawned with multiprocessing (its resource tracker left out:
    only those running ``spawn_main``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] == "Z" or int(fields[1]) != pid:
            continue
        with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
            if b"spawn_main" in cmdline.read():
                found.append(int(entry))
    return found


def _long(client: EngineCoreClient, request_id: str, max_tokens: int = 900):  # noqa: ANN202
    """A 10-token prompt asking for ``max_tokens`` tokens, EOS ignored."""
    return client.make_request(request_id, list(range(100, 110)), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))


async def _collect(client: EngineCoreClient, request_id: str, prompt: list[int],
                   max_tokens: int) -> str:
    request = client.make_request(request_id, prompt, SamplingParams(temperature=0,
                                                                     max_tokens=max_tokens))
    client.check_admission([request])
    text = ""
    async for out in client.generate(request):
        text = out.text
    return text


def test_streams_the_tokens_the_engine_makes_in_process_and_frees_every_block(checkpoint, shared):
    reference = LLMEngine.from_config(_config(checkpoint))
    prompts = [reference.processor.encode(text) for text in
               ("The capital of France is", "Once upon a time", "1, 2, 3, 4,")]
    expected = [greedy_text(reference, ids, max_tokens=24) for ids in prompts]
    reference.close()

    client = shared
    assert client.is_alive and client._process.is_alive()
    assert client.processor.limits.num_kv_blocks == 256
    before = client.stats().num_generated_tokens

    async def run_all() -> list[str]:
        return await asyncio.gather(*(_collect(client, f"r{i}", ids, 24)
                                      for i, ids in enumerate(prompts)))

    assert asyncio.run(run_all()) == expected  # three at once, batched, token for token
    stats = client.stats()
    assert stats.num_generated_tokens - before == 3 * 24
    assert stats.kv.num_used_blocks == 0 and stats.kv.num_running_requests == 0
    assert stats.num_leaked_blocks == 0
    assert stats.queue is not None and stats.queue.num_requests == 0


def test_a_structured_output_request_matches_the_engine_in_process(checkpoint, shared):
    """The grammar compiled in the API process travels as xgrammar's JSON; the engine process
    constrains with it: the same tokens as an in-process engine compiling it itself."""
    config = _config(checkpoint)
    spec = StructuredOutputsParams(regex="(yes|no), [a-z]{3,8}!")
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=spec)
    reference = LLMEngine.from_config(config)
    ids = reference.processor.encode("Answer:")
    reference.add_request("ref", ids, params)
    expected = finish_all(reference)["ref"].text
    reference.close()
    assert re.fullmatch("(yes|no), [a-z]{3,8}!", expected)

    client = shared

    async def constrained() -> str:
        request = client.make_request("c", ids, params)
        client.processor.compile_grammar(request.params)  # as the server does, off the loop
        text = ""
        async for out in client.generate(request):
            text = out.text
        return text

    assert asyncio.run(constrained()) == expected
    assert client.processor.grammars.num_compiled == 1


def test_a_bad_model_fails_start_with_the_loaders_error_and_leaves_no_process(tmp_path):
    before = set(multiprocessing.active_children())
    client = EngineCoreClient(_config(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="missing"):
        client.start()
    assert not client.is_alive and client._process is None
    assert set(multiprocessing.active_children()) == before  # none started
    with pytest.raises(EngineDeadError, match="not started"):
        client.processor  # noqa: B018


def test_the_options_are_checked_before_anything_starts(tmp_path):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="max_stream_lead must be >= 2, got 1"):
        EngineCoreClient(_config(tmp_path), max_stream_lead=1)
    with pytest.raises(ValueError, match="stall_timeout must be > 0 seconds or None, got 0"):
        EngineCoreClient(_config(tmp_path), stall_timeout=0)
    assert set(multiprocessing.active_children()) == before


def test_the_admission_bound_refuses_in_the_api_process(checkpoint):
    client = EngineCoreClient(_config(checkpoint, max_queued_tokens=40)).start()
    try:
        ids = list(range(100, 130))
        first = client.make_request("a", ids, SamplingParams(max_tokens=4))
        client.check_admission([first])
        second = client.make_request("b", ids, SamplingParams(max_tokens=4))
        with pytest.raises(OverloadedError):
            client.check_admission([second])  # 30 queued + 30 > 40
        client.abort("a")  # never streamed: its place goes back
        client.check_admission([second])
        client.abort("b")
    finally:
        client.shutdown()


def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks(shared):
    client = shared
    before = client.stats().num_generated_tokens

    async def leave_early() -> int:
        seen = 0
        async for _ in client.generate(_long(client, "long")):
            seen += 1
            if seen == 3:
                break
        return seen

    assert asyncio.run(leave_early()) == 3
    _wait(lambda: client.stats().kv.num_running_requests == 0, 30, "the request ended")
    stats = client.stats()
    assert stats.kv.num_used_blocks == 0 and stats.num_leaked_blocks == 0
    assert stats.num_generated_tokens - before < 900


def test_shutdown_ends_a_live_stream_with_engine_dead(checkpoint):
    client = EngineCoreClient(_config(checkpoint)).start()

    async def stream_until_shutdown() -> str:
        request = _long(client, "s")
        with pytest.raises(EngineDeadError, match="shut down") as caught:
            async for out in client.generate(request):
                if len(out.token_ids) == 2:
                    await asyncio.to_thread(client.shutdown)
        return str(caught.value)

    try:
        assert "shut down" in asyncio.run(stream_until_shutdown())
    finally:
        client.shutdown()
    assert client._process.exitcode == 0


def test_a_dead_engine_process_fails_the_streams_and_the_client_reports_it(checkpoint):
    client = EngineCoreClient(_config(checkpoint)).start()
    server = BackgroundServer(build_app(client, model_name=MODEL)).start()
    pid = client._process.pid
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        async def stream_until_killed() -> None:
            request = _long(client, "k")
            async for out in client.generate(request):
                if len(out.token_ids) == 2:
                    os.kill(pid, signal.SIGKILL)

        with pytest.raises(EngineDeadError, match="retry it"):
            asyncio.run(stream_until_killed())
        _wait(lambda: not client.is_alive, 10, "the client saw the engine die")

        async def one_more() -> None:
            await _collect(client, "after", [100, 101], 2)

        with pytest.raises(EngineDeadError, match="not running"):
            asyncio.run(one_more())
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 503 and "engine is not running" in health.text
    finally:
        server.stop()
        client.shutdown()
    assert not _alive(pid)


def test_signals_to_the_process_group_leave_the_draining_to_the_api_process(shared):
    """SIGINT and SIGTERM sent to the engine process (as a terminal or a process manager sends
    them to the whole group) do not stop it: the request in flight finishes."""
    client = shared

    async def stream_through_signals() -> int:
        count = 0
        async for out in client.generate(_long(client, "g", max_tokens=40)):
            count = len(out.token_ids)
            if count == 2:
                os.kill(client._process.pid, signal.SIGTERM)
                os.kill(client._process.pid, signal.SIGINT)
        return count

    assert asyncio.run(stream_through_signals()) == 40
    assert client.is_alive


def test_the_engine_process_ends_when_the_api_process_is_killed(checkpoint, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from kthena_serve.engine_core import EngineCoreClient
        from kthena_serve.engine.config import EngineConfig
        client = EngineCoreClient(EngineConfig(model={str(checkpoint)!r}, dtype="float32",
                                               num_kv_blocks=64, num_threads=1,
                                               kernels="native")).start()
        print(client._process.pid, flush=True)
        time.sleep(600)
    """)
    api = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(api.stdout.readline())
        assert _alive(engine_pid)
        api.kill()
        api.wait(timeout=30)
        _wait(lambda: not _alive(engine_pid), 30, "the engine process ended")
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
        api.stdout.close()


def test_a_stalled_reader_is_aborted_in_the_engine_process(checkpoint):
    client = EngineCoreClient(_config(checkpoint, num_kv_blocks=2048, max_num_batched_tokens=256),
                              max_stream_lead=8, stall_timeout=1.0).start()
    server = BackgroundServer(build_app(client, model_name=MODEL)).start()
    try:
        sock = _slow_reader(server.url)
        try:
            _wait(lambda: client.num_stalled == 1, 60, "the stalled request was aborted")
            _wait(lambda: client.stats().kv.num_used_blocks == 0, 30, "its blocks were freed")
            assert client.stats().num_generated_tokens < 600
        finally:
            sock.close()
        with httpx.Client(base_url=server.url, timeout=60) as http:  # others are served
            other = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                       "max_tokens": 5, "ignore_eos": True})
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 5
    finally:
        server.stop()
        client.shutdown()


def test_kthena_serve_runs_one_engine_process_and_stops_it(checkpoint):
    proc, url, _ = start_serve("--model", str(checkpoint), "--served-model-name", MODEL,
                               "--port", "0")
    try:
        engines = _children(proc.pid)
        assert len(engines) == 1
        with httpx.Client(base_url=url, timeout=60) as http:
            reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                       "max_tokens": 4, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
            metrics = http.get("/metrics").text
        assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 4.0' in metrics
    finally:
        stop(proc)
    assert proc.returncode == 0
    _wait(lambda: not any(_alive(pid) for pid in engines), 30, "the engine process ended")


def test_no_engine_process_keeps_the_engine_on_a_thread(checkpoint):
    proc, url, _ = start_serve("--model", str(checkpoint), "--served-model-name", MODEL,
                               "--port", "0", "--no-engine-process")
    try:
        assert _children(proc.pid) == []
        with httpx.Client(base_url=url, timeout=60) as http:
            reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                       "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200 and json.loads(reply.text)["usage"]["completion_tokens"] == 4
    finally:
        stop(proc)
    assert proc.returncode == 0
