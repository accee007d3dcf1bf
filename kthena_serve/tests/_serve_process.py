"""``kthena serve`` as a child process of a test: started up to its curl line, and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start_serve(*args: str, timeout: float = 240,
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
    """Run ``kthena serve ARGS`` (unbuffered, without the environment's API key) and wait for
    the curl line it prints once it serves. Returns (the process, its base URL without
    ``/v1/...``, what it printed so far); the caller stops the process. One that exits or
    prints no curl line within ``timeout`` is killed and the test fails with its output.
    ``env``: the child's environment (default: this process's)."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    env.pop("KTHENA_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "kthena_core.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if line.startswith("curl "):
            return proc, line.split()[1].rsplit("/v1/", 1)[0], "".join(seen)
    proc.kill()
    proc.wait()
    raise AssertionError("kthena serve printed no curl line:\n" + "".join(seen)[-4000:])


def reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it still runs, wait for it, and close its stdout."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM ``proc`` (a server drains and exits), wait up to ``timeout`` s, then ``reap`` it
    (killed if it is still running)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    finally:
        reap(proc)
