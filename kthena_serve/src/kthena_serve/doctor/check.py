"""One line of ``kthena doctor``'s checklist, and the checklist as text or JSON.

::

    ok    kv_usage         12 of 256 blocks in use (5%), 30 cached; 2 running, 0 waiting
    FAIL  kv_leaks         3 block reference(s) held by 1 request(s) the engine no longer has
                           fix: a request ended without KVCacheManager.free: ...
    1 ok, 0 warn, 1 fail, 0 skip
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["VERDICTS", "Check", "DoctorError", "exit_status", "format_checks", "checks_json"]

VERDICTS = ("ok", "warn", "fail", "skip")


class DoctorError(ValueError):
    """Bad input to ``kthena doctor`` (an unreachable server, a refused API key, a config that
    does not load); the message names what was wrong."""


def _verdict(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in VERDICTS:
        raise ValueError(f"verdict {value!r}: expected one of {', '.join(VERDICTS)}")


@attrs.frozen
class Check:
    """One checked thing.

    Attributes:
        name: what was checked (``kv_leaks``, ``hccl_env`` ...).
        verdict: ``ok``, ``warn``, ``fail``, or ``skip`` (``value`` then says why).
        value: what was measured, in words and numbers.
        fix: what to do about a warn or fail ("" when nothing).
    """

    name: str
    verdict: str = attrs.field(validator=_verdict)
    value: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return attrs.asdict(self)


def exit_status(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0."""
    return 1 if any(c.verdict == "fail" for c in checks) else 0


def format_checks(checks: Sequence[Check]) -> str:
    """The checklist: a line per check, its fix indented below a warn or fail."""
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for check in checks:
        mark = check.verdict.upper() if check.verdict == "fail" else check.verdict
        lines.append(f"{mark:<5} {check.name:<{width}}  {check.value}")
        if check.fix and check.verdict in ("warn", "fail"):
            lines.append(f"{'':<5} {'':<{width}}  fix: {check.fix}")
    counts = {v: sum(c.verdict == v for c in checks) for v in VERDICTS}
    lines.append(", ".join(f"{n} {v}" for v, n in counts.items()))
    return "\n".join(lines)


def checks_json(checks: Sequence[Check], **about: Any) -> str:
    """One JSON object: ``{"checks": [...], "num_failed": N, ...about}``."""
    return json.dumps({**about, "checks": [c.to_dict() for c in checks],
                       "num_failed": sum(c.verdict == "fail" for c in checks)})
