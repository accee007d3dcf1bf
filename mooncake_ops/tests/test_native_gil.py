"""The native kernels run with the GIL released: while one runs on a thread, other Python
threads run (a server's event loop answers HTTP while the engine thread computes a step).

Not a timing assertion: the interpreter's switch interval is raised to a minute for the test, so
a thread gives up the GIL only where it blocks (a sleep, or a kernel that releases it). The
stamping thread sleeps between stamps; the kernel thread never blocks in Python. So with the GIL
held through the kernels no stamp can fall between the kernels' start and end, and any stamp
there shows the release."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from mooncake_ops.backends import native


def _stamps_inside(call) -> tuple[int, float]:  # noqa: ANN001
    """Run ``call`` on a worker thread while this thread stamps the clock; (stamps strictly
    inside the call, the call's seconds)."""
    span: list[float] = []
    started = threading.Event()

    def worker() -> None:
        started.set()
        span.append(time.perf_counter())
        call()
        span.append(time.perf_counter())

    stamps: list[float] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        while thread.is_alive():
            stamps.append(time.perf_counter())
            time.sleep(0.001)  # blocks: the kernel thread can take the GIL back
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    start, end = span
    return sum(1 for t in stamps if start < t < end), end - start


def test_a_long_native_matmul_lets_other_threads_run():
    module = native._load()
    if module is None:
        pytest.skip("no native build loaded here (reference ops run)")
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    if hasattr(module, "bf16_linear") and module.bf16_linear_supported():
        weight = module.bf16_pack_weight(torch.randn(1536, 576, generator=g).to(torch.bfloat16))
        x = torch.randn(2048, 576, generator=g).to(torch.bfloat16)

        def call() -> None:
            for _ in range(8):
                assert module.bf16_linear(x, weight, None) is not None
    else:  # the AVX2 build: its dense matmul of few rows, many times
        weight = torch.randn(1536, 576, generator=g)
        x = torch.randn(4, 576, generator=g)

        def call() -> None:
            for _ in range(400):
                module.dense_linear(x, weight, None)

    inside, seconds = _stamps_inside(call)
    assert inside > 0, f"no other Python thread ran during {seconds * 1e3:.0f} ms of kernels"
