"""A PD test that fails on purpose, to show the end-of-run leak check (root conftest.py).

Skipped unless ``KTHENA_LEAK_DEMO`` is set:

    KTHENA_LEAK_DEMO=clean pytest kthena_serve/tests/test_leak_demo.py
        the test fails once the server is up; its finally stops the server, and the leak
        check finds nothing: one failure, no teardown error
    KTHENA_LEAK_DEMO=leak pytest kthena_serve/tests/test_leak_demo.py
        the same test without its finally: the leak check fails the run, listing the router,
        both workers and their /dev/shm pool and temp folder, then kills and removes them
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _serve_process import stop

MODE = os.environ.get("KTHENA_LEAK_DEMO", "")
pytestmark = pytest.mark.skipif(MODE not in ("clean", "leak"),
                                reason="a demonstration: set KTHENA_LEAK_DEMO=clean or leak")


def _start_pd() -> subprocess.Popen:
    kthena = Path(sys.executable).with_name("kthena")
    proc = subprocess.Popen([str(kthena), "serve", "--mode", "pd", "--port", "0",
                             "--kv-cache-memory", "32MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("kthena serve --mode pd exited")
        if re.search(r"on http://\S+", line):
            return proc
    raise RuntimeError("kthena serve --mode pd: no ready line")


def test_a_pd_test_that_fails_on_purpose():
    proc = _start_pd()
    try:
        raise AssertionError("failing on purpose, with the PD server up")
    finally:
        if MODE == "clean":
            stop(proc)
