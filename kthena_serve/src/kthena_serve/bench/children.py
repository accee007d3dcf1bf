"""A benchmark's server child: its own process group, a log file, ``/health``, one warm-up.

``kthena bench trace`` runs ``vllm serve``, ``llama-server`` and ``kthena serve`` this way, and
``kthena bench serve --peer llama.cpp`` runs ``llama-server`` so. Leaving the context ends the
whole group (a server's engine processes included) on success, error or interrupt alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kthena_serve.bench.peer import kill_group

__all__ = ["ServerChild", "http_status", "wait_ready", "warm_up"]


class ServerChild:
    """A child in its own process group; its output to a log file. Use as a context manager:
    leaving it ends the whole group, SIGTERM first and, after ``grace_s``, SIGKILL."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path,
                 grace_s: float = 30.0, who: str = "kthena bench") -> None:
        self.name, self.argv, self.log_path, self.grace_s = name, argv, log, grace_s
        print(f"{who}: {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
        self._log = log.open("w", encoding="utf-8")
        try:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=log.parent)
        except OSError:
            self._log.close()
            raise

    def __enter__(self) -> ServerChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the group, up to ``grace_s`` for it to exit, then SIGKILL (idempotent)."""
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped group cannot act on SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=self.grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        finally:
            kill_group(self.proc)  # what SIGTERM left, engine processes included
            self._log.close()

    def tail(self, lines: int = 30) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.name} {what}; its last output ({self.log_path}):\n"
                            f"{self.tail()}")


def http_status(url: str, body: dict | None = None, timeout: float = 5.0) -> int:
    """POST ``body`` as JSON (GET without one) to ``url``; the status, the answer read and
    dropped."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()
        return response.status


def wait_ready(server: ServerChild, base_url: str, timeout_s: float) -> float:
    """Seconds until ``/health`` answers 200.

    Raises:
        RuntimeError: the server exited first, or ``timeout_s`` passed.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.proc.poll() is not None:
            raise server.fail(f"exited with {server.proc.returncode} before it was ready")
        try:
            if http_status(f"{base_url}/health", timeout=2.0) == 200:
                return time.monotonic() - start
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise server.fail(f"did not answer {base_url}/health within {timeout_s:.0f} s")


def warm_up(server: ServerChild, base_url: str, model_name: str) -> float:
    """One short greedy completion (the same for every server); its seconds."""
    start = time.monotonic()
    try:
        http_status(f"{base_url}/v1/completions",
                    {"model": model_name, "prompt": "Hello, my name is", "max_tokens": 8,
                     "temperature": 0}, timeout=300.0)
    except (OSError, urllib.error.URLError) as error:
        raise server.fail(f"failed its warm-up request ({error})") from None
    return time.monotonic() - start
