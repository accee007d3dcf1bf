"""A client that stops reading: its request pauses (no tokens pile up), others go on, it resumes
when the client reads again, and a stall past the timeout frees its blocks.

Real HTTP on 127.0.0.1: a raw socket with a small receive buffer plays the slow reader.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from _tiny import tiny_engine

from kthena_serve.async_engine import STALLED_MESSAGE, AsyncLLM
from kthena_serve.server import BackgroundServer, build_app

MODEL = "tiny"
MAX_TOKENS = 1200
BODY = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": True}


def _serve(**options):
    core = tiny_engine(num_kv_blocks=2048, max_num_batched_tokens=256, max_num_seqs=8)
    engine = AsyncLLM(core, max_stream_lead=8, **options).start()
    server = BackgroundServer(build_app(engine, model_name=MODEL)).start()
    return core, engine, server


def _slow_reader(url: str) -> socket.socket:
    """Sends the streaming request and reads nothing (4 KiB receive buffer)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(BODY).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def _settled_generated(engine: AsyncLLM, timeout: float = 30.0) -> int:
    """The generated-token count once it stops moving for a second."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        now = engine.stats().num_generated_tokens
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"generation never paused ({last} tokens)")


def _text_of(raw: bytes) -> tuple[str, bool]:
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), done


@pytest.fixture
def served():
    core, engine, server = _serve(stall_timeout=None)
    yield core, engine, server
    server.stop()
    engine.shutdown()


def test_a_reader_that_stops_pauses_only_its_request_and_resumes(served):
    core, engine, server = served
    with httpx.Client(base_url=server.url, timeout=120) as http:
        expected = _text_of(http.post("/v1/completions", json=BODY).content)[0]
    before = engine.stats().num_generated_tokens

    sock = _slow_reader(server.url)
    try:
        paused_at = _settled_generated(engine) - before
        # socket buffers (~56 KiB) plus the lead: a few hundred tokens, not all of them
        assert 0 < paused_at < MAX_TOKENS // 2, paused_at
        assert engine.stats().kv.num_running_requests == 1  # paused, blocks held
        with httpx.Client(base_url=server.url, timeout=60) as http:  # others are not held up
            other = http.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 20})
        assert other.status_code == 200
        assert other.json()["usage"]["completion_tokens"] == 20

        raw = b""
        sock.settimeout(60)
        while not raw.endswith(b"data: [DONE]\r\n\r\n") and b"data: [DONE]" not in raw[-64:]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    finally:
        sock.close()
    body = raw.split(b"\r\n\r\n", 1)[1]
    text, done = _text_of(_unchunk(body))
    assert done and text == expected  # resumed where it paused: same greedy answer
    assert engine.stats().num_generated_tokens - before == MAX_TOKENS + 20
    core.kv.check_invariants()


def _unchunk(body: bytes) -> bytes:
    """Decode HTTP/1.1 chunked transfer encoding."""
    out, rest = b"", body
    while rest:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def test_a_stalled_reader_is_aborted_and_its_blocks_freed():
    core, engine, server = _serve(stall_timeout=1.0)
    try:
        sock = _slow_reader(server.url)
        try:
            deadline = time.monotonic() + 30
            while engine.num_stalled == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert engine.num_stalled == 1
            deadline = time.monotonic() + 10
            while engine.stats().kv.num_used_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.stats().kv.num_used_blocks == 0
            assert engine.stats().num_generated_tokens < MAX_TOKENS // 2
        finally:
            sock.close()
        core.kv.check_invariants()
    finally:
        server.stop()
        engine.shutdown()


def test_backpressure_options_are_checked():
    core = tiny_engine()
    with pytest.raises(ValueError, match="max_stream_lead must be >= 2, got 1"):
        AsyncLLM(core, max_stream_lead=1)
    with pytest.raises(ValueError, match="stall_timeout must be > 0 seconds or None, got 0"):
        AsyncLLM(core, stall_timeout=0)
    assert STALLED_MESSAGE.startswith("the client read nothing")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_serve_refuses_a_bad_stall_timeout(value):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve",
                          "--stream-stall-timeout", value], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert (f"argument --stream-stall-timeout: must be a positive number of seconds, "
            f"got '{value}'") in out.stderr


def test_pd_mode_refuses_the_colocated_stall_timeout():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve", "--mode", "pd",
                          "--stream-stall-timeout", "30"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "--stream-stall-timeout applies to colocated serving" in out.stderr
