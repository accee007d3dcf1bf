"""Two "hosts" for PD tests: ``kthena_serve.bench.netns.two_namespaces``, skipping the test (with the
reason) where namespaces cannot be made; and a helper script of this folder run on the first.

    with two_host_network("kc", 214) as (ns_a, ns_b, addr_a, addr_b):
        ...  # ip netns exec ns_a ...; addr_b is reachable from ns_a
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import subprocess_env

from kthena_serve.bench.netns import NetnsUnavailable, netns_reason, two_namespaces

__all__ = ["netns_reason", "run_in_first_host", "two_host_network"]


@contextlib.contextmanager
def two_host_network(tag: str, subnet: int) -> Iterator[tuple[str, str, str, str]]:
    """``two_namespaces(tag, subnet)``, or a skip saying why it cannot be made."""
    try:
        with two_namespaces(tag, subnet) as names:
            yield names
    except NetnsUnavailable as reason:
        pytest.skip(str(reason))


def run_in_first_host(hosts: tuple[str, str, str, str], helper: str, prompts: list[list[int]],
                      timeout: float) -> dict:
    """Run this folder's ``helper`` script in the first namespace of ``hosts`` (what
    ``two_host_network`` yields) as ``python HELPER NS_B ADDR_A ADDR_B PROMPTS_JSON``, with
    ``_support`` importable; it must exit 0 within ``timeout`` s. Returns its last output line,
    a JSON object."""
    ns_a, ns_b, addr_a, addr_b = hosts
    done = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable,
                           str(Path(__file__).with_name(helper)), ns_b, addr_a, addr_b,
                           json.dumps(prompts)],
                          capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
