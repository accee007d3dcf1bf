"""``kthena doctor``'s kernel-cache lines: the kernel choices measured on this host and kept
under ``<cache dir>/kernels/`` (`mooncake_ops.selection.cached_choices`), one line each::

    ok    kernel_cache:3f9a1c2e  matmul decode native-packed-bf16 (runner-up x1.46), prefill
                                 native-packed-bf16 (runner-up x1.12); decode attention native
                                 (runner-up x24.6), prefill attention native (runner-up x10.3);
                                 timed 3 h ago at load 0.4 on 2 cores: final

(one line in the checklist, wrapped here). "runner-up x1.46": the next-fastest candidate took
1.46 times the winner's time (`KernelChoice.margins`). A choice timed on a busy machine is a
warning: it is provisional, and the next start times it again. No cached choice is one skip
line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kthena_serve.doctor.check import Check

if TYPE_CHECKING:  # at run time it is imported with torch, only when the doctor runs
    from mooncake_ops.selection import KernelChoice

__all__ = ["kernel_cache_checks"]

_ATTENTION = (("decode attention", "paged_decode_attention"),
              ("prefill attention", "paged_prefill_attention"))


def kernel_cache_checks(cache_dir: str | os.PathLike[str], *,
                        now: float | None = None) -> list[Check]:
    """A line per kernel choice cached under ``cache_dir``, or one line saying there is none.

    Args:
        cache_dir: the cache folder (``kthena_core.cache_dir.default_cache_dir()``).
        now: the time to age the choices against (default: now).

    Returns:
        ``kernel_cache:<key prefix>`` checks: ok for a final choice, warn for a provisional
        one; a single ``kernel_cache`` skip when nothing readable is cached.
    """
    from mooncake_ops.selection import cached_choices

    choices = cached_choices(cache_dir)
    if not choices:
        return [Check("kernel_cache", "skip", f"no kernel choice cached in {cache_dir}/kernels "
                      "(`kthena serve --kernels auto` times and caches one)")]
    when = time.time() if now is None else now
    return [_choice_check(choice, when) for choice in choices]


def _choice_check(choice: KernelChoice, now: float) -> Check:
    margins = choice.margins()
    decode, prefill = choice.linear_decode or "F.linear", choice.linear_prefill or "F.linear"
    matmul = (f"matmul decode {_picked(decode, 'matmul_decode', margins)}, "
              f"prefill {_picked(prefill, 'matmul_prefill', margins)}")
    attention = ", ".join(f"{label} {_picked(choice.attention.get(op, 'default'), op, margins)}"
                          for label, op in _ATTENTION)
    value = f"{matmul}; {attention}; {_when(choice, now)}"
    name = f"kernel_cache:{choice.key[:8]}"
    if choice.provisional:
        return Check(name, "warn", value, "it runs until the next start, which times it "
                     "again: start when this host is quieter (a 1-minute load at most half "
                     "its cores)")
    return Check(name, "ok", value)


def _picked(name: str, family: str, margins: Mapping[str, float | None]) -> str:
    """``native (runner-up x1.46)``: the chosen candidate and how close the next one was."""
    if family not in margins:
        return f"{name} (not timed)"
    margin = margins[family]
    return f"{name} ({'no runner-up' if margin is None else f'runner-up x{margin:.2f}'})"


def _when(choice: KernelChoice, now: float) -> str:
    if choice.measured_at_s is None:
        return "timed before load was recorded: final"
    state = "provisional (timed again at the next start)" if choice.provisional else "final"
    under = choice.timed_under() or "an unknown load"
    return f"timed {_age(now - choice.measured_at_s)} at {under}: {state}"


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)  # a clock set back reads as just now
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"
