"""Two gloo ranks as two Python processes, for the tests that run a model over TP=2."""

from __future__ import annotations

import os
from collections.abc import Callable

from _support import run_gloo_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def run_two_ranks(argv: Callable[[int, str], list[str]], *, timeout: float = 300) -> list[str]:
    """``_support.run_gloo_ranks`` over ranks 0 and 1, with this folder importable (test_parity's
    worker, written to a temporary folder, imports its helpers); both must exit 0. Returns
    their logs."""
    return run_gloo_ranks(argv, 2, timeout=timeout, pythonpath=[HERE])
