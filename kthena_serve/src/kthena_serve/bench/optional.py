"""The benchmarks' optional packages: matplotlib (plots) and transformers (the baseline).

A plain ``pip install ./kthena_serve`` has neither; ``pip install "./kthena_serve[bench]"``
brings both. A benchmark without one goes on without what it gives and says so in one line on
stderr; the JSON is printed either way.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

__all__ = ["BENCH_EXTRA", "draw", "is_available", "note_missing", "plot_or_note"]

BENCH_EXTRA = '"./kthena_serve[bench]"'


def is_available(name: str) -> bool:
    """Whether ``import name`` finds the package (checked without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or half-removed install counts as absent
        return False


def note_missing(command: str, name: str, instead: str) -> None:
    """Print the one line of a run that goes on without ``name``: what it does instead and
    how to install it."""
    print(f"{command}: {name} is not installed: {instead}; `pip install {name}` (or "
          f"`pip install {BENCH_EXTRA}`) adds it", file=sys.stderr, flush=True)


def plot_or_note(command: str, path: str | None) -> str | None:
    """``path`` if a plot can be drawn there, else None after the one line naming the install
    (``path`` None or '': no plot asked for, nothing printed). Benchmarks call it before they
    measure, so the note comes first and the JSON is never lost to a missing plotter."""
    if not path:
        return None
    if is_available("matplotlib"):
        return path
    note_missing(command, "matplotlib", f"the plot {path} is skipped")
    return None


def draw(command: str, plot: Callable[[], object]) -> bool:
    """Run ``plot()``; a matplotlib that fails to import is the one line, not a traceback.
    Returns whether it drew."""
    try:
        plot()
    except ImportError as error:
        note_missing(command, (error.name or "matplotlib").split(".")[0], "the plot is skipped")
        return False
    return True
