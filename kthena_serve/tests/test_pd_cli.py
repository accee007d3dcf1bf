"""``kthena serve --mode pd`` end to end: starts, serves the OpenAI API, stops without leaks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kthena_serve.pd.embedded import shm_pools


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _stream_events(url: str, box: dict) -> None:
    body = {"model": "default", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True, "prompt": "Tell me a very long story about the sea."}
    events = []
    box["events"] = events
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        box["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                box["count"] = len(events)


def test_kthena_serve_mode_pd() -> None:
    """Serves, and on SIGTERM drains: a running stream ends with an error event and [DONE]
    once --shutdown-timeout passes, new requests get 503, and nothing is left behind."""
    import json
    import threading

    kthena = Path(sys.executable).with_name("kthena")
    proc = subprocess.Popen([str(kthena), "serve", "--mode", "pd", "--prefill", "1", "--decode",
                             "1", "--port", "0", "--kv-cache-memory", "32MiB", "--pd-threshold",
                             "8", "--shutdown-timeout", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "kthena serve --mode pd exited"
            match = re.search(r"on (http://\S+) \(", line)
            url = match.group(1) if match else None
        assert url, "no ready line"
        workers = _children(proc.pid)
        assert len(workers) == 2
        body = {"model": "default", "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        pools = [p for p in shm_pools() if any(f".{w}." in p for w in workers)]
        assert len(pools) == 1  # the decode worker's pool
        box: dict = {"count": 0}
        streaming = threading.Thread(target=_stream_events, args=(url, box))
        streaming.start()
        deadline = time.monotonic() + 60
        while box["count"] < 3 and streaming.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert box["count"] >= 3, box  # streaming when the signal comes
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.get(f"{url}/v1/models", timeout=10)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        streaming.join(60)
        events = box["events"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert not [p for p in shm_pools() if any(f".{w}." in p for w in workers)]
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_pd_with_tensor_parallel_across_hosts_resolves_on_cpu_only(capsys) -> None:  # noqa: ANN001
    """TP PD workers hand KV off across hosts over mooncake (each rank's heads put:
    pd/reshard_put.py); their ranks' pools are /dev/shm files, so another device is refused."""
    import pytest

    from kthena_core.cli import main
    from kthena_serve.spec import ServeSpec

    spec = ServeSpec.resolve({"mode": "pd", "tp": 2, "pd_transport": "mooncake"})
    assert (spec.pd.transport.value, spec.engine.tp) == ("mooncake", 2)
    spec = ServeSpec.resolve({"mode": "pd", "decode_tp": 2, "pd_transport": "mooncake"})
    assert spec.pd.role_tp("decode", spec.engine.tp) == 2
    with pytest.raises(ValueError, match="--tp 2 with --device cuda: TP PD workers run on cpu"):
        ServeSpec.resolve({"mode": "pd", "tp": 2, "pd_transport": "mooncake", "device": "cuda"})
    assert main(["serve", "--prefill-tp", "2", "--port", "0"]) == 2
    assert "--prefill-tp 2: PD worker settings, for --mode pd only" in capsys.readouterr().err


def test_pd_with_pipeline_parallel_is_refused_clearly(capsys) -> None:  # noqa: ANN001
    from kthena_core.cli import main

    assert main(["serve", "--mode", "pd", "--pp", "2", "--port", "0"]) == 2
    assert "--pp 2 is not supported in PD mode" in capsys.readouterr().err


def test_a_pd_worker_spec_it_cannot_run_is_refused_by_name() -> None:
    """What `kthena deploy k8s` renders for a role: a PP role, or a TP role on a device, is
    refused at start, naming the setting; a TP role (shm or mooncake) takes its role's size."""
    import argparse
    import json

    import pytest

    from kthena_serve.pd.worker import _spec

    def spec(role: str, engine: dict, pd: dict):  # noqa: ANN202
        data = {"engine": engine, "mode": "pd", "pd": pd}
        return _spec(argparse.Namespace(spec=json.dumps(data), role=role))

    with pytest.raises(ValueError, match="a PD worker of pp=2 is not run"):
        spec("decode", {"pp": 2}, {})
    assert spec("prefill", {}, {"transport": "mooncake", "prefill_tp": 4}).engine.tp == 4
    with pytest.raises(ValueError, match="a PD worker of tp=2 runs its ranks as spawned"):
        spec("decode", {"ranks_from": "env"}, {"transport": "mooncake", "decode_tp": 2})
    assert spec("prefill", {"tp": 2}, {"decode_tp": 4}).engine.tp == 2
    assert spec("decode", {"tp": 2}, {"decode_tp": 4}).engine.tp == 4


def test_shared_pool_with_pipeline_parallel_is_refused() -> None:
    import pytest

    from kthena_serve.engine import build_runner
    from kthena_serve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="shared KV pool with pp=2 is not supported"):
        build_runner(EngineConfig(pp=2, num_kv_blocks=8), shared_pool=True)


def _ready_folder(pid: int) -> Path:
    """The launcher's folder of a worker: the parent of the ``--ready-file`` on its command
    line (so the test counts only what its own server made, not other servers' folders)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--ready-file") + 1].decode()).parent


def test_sigkilled_router_leaves_no_workers_shm_or_temp_folder() -> None:
    """SIGKILL of `kthena serve --mode pd`: the workers get SIGTERM from the kernel
    (PR_SET_PDEATHSIG), clean up their pool and remove the launcher's kthena-pd-* folder."""
    kthena = Path(sys.executable).with_name("kthena")
    proc = subprocess.Popen([str(kthena), "serve", "--mode", "pd", "--port", "0",
                             "--kv-cache-memory", "32MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "kthena serve --mode pd exited"
            if line.startswith("curl "):
                break
        workers = _children(proc.pid)
        folders = {_ready_folder(pid) for pid in workers}
        assert len(workers) == 2 and len(folders) == 1
        assert next(iter(folders)).name.startswith("kthena-pd-")
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
                any(os.path.exists(f"/proc/{pid}") for pid in workers) or any(
                    f.exists() for f in folders)):
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
        assert not any(f.exists() for f in folders)
        assert not [p for p in shm_pools() if any(f".{w}." in p for w in workers)]
    finally:  # a failed assertion must not leave the server or its workers running
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        for pid in workers:  # still ours only while its command line is a PD worker's
            with contextlib.suppress(OSError):
                if b"kthena_serve.pd.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def test_bad_start_up_settings_are_one_line_in_every_mode(capsys) -> None:  # noqa: ANN001
    """Refused before anything starts: a port that is not one, a PD timeout of 0, PD worker
    counts outside PD mode (they were silently ignored)."""
    from kthena_core.cli import main

    cases = [
        (["--port", "70000"], "--port: 70000 is not a TCP port; allowed 0 to 65535"),
        (["--mode", "pd", "--port", "70000"], "--port: 70000 is not a TCP port"),
        (["--dp", "2", "--port", "-1"], "--port: -1 is not a TCP port"),
        (["--mode", "pd", "--pd-timeout", "0", "--port", "0"],
         "--pd-timeout: must be more than 0 seconds"),
        (["--prefill", "2", "--port", "0"], "--prefill 2: PD worker settings, for --mode pd only"),
        (["--dp", "2", "--decode", "3", "--port", "0"], "--decode 3: PD worker settings"),
    ]
    for argv, message in cases:
        assert main(["serve", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_a_worker_that_refuses_its_settings_is_one_line_and_leaves_nothing() -> None:
    """A pool that holds no KV block: the worker says so in one line, the launcher in one more,
    exit 1, and every process it started is gone (PD and DP)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    for mode in (["--mode", "pd", "--prefill", "1", "--decode", "1"], ["--dp", "2"]):
        done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve", *mode,
                               "--kv-cache-memory", "1KiB", "--port", "0"],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 1, (mode, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert "error: kv_cache_memory=1024 bytes holds no KV block" in done.stderr
        assert "before it was ready" in done.stderr
