"""Two "hosts" for PD tests: ``kthena_serve.bench.netns.two_namespaces``, skipping the test (with the
reason) where namespaces cannot be made.

    with two_host_network("kc", 214) as (ns_a, ns_b, addr_a, addr_b):
        ...  # ip netns exec ns_a ...; addr_b is reachable from ns_a
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kthena_serve.bench.netns import NetnsUnavailable, netns_reason, two_namespaces

__all__ = ["netns_reason", "two_host_network"]


@contextlib.contextmanager
def two_host_network(tag: str, subnet: int) -> Iterator[tuple[str, str, str, str]]:
    """``two_namespaces(tag, subnet)``, or a skip saying why it cannot be made."""
    try:
        with two_namespaces(tag, subnet) as names:
            yield names
    except NetnsUnavailable as reason:
        pytest.skip(str(reason))
