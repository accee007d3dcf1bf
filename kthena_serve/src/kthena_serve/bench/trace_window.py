"""The window of a Mooncake trace that ``kthena bench trace`` replays, and how it is scaled.

Mooncake's traces (the FAST'25 release's JSONL) hold one request per line: ``timestamp`` (ms
from the trace's start), ``input_length``, ``output_length`` and ``hash_ids``, one id per
512-token block of the prompt, so that requests starting with the same ids share that prefix.
For a small model on a small machine a window is scaled as the trace README says
(/work/shared/data/traces/README.md)::

    trace:   hash_ids [a, b, c]  input_length 1100 = 512 + 512 + 76   output 40   t = 272868 ms
    scaled:  hash_ids [a, b, c]  input_length   34 =  16 +  16 +  2   output  5   t' = (t - t0) x s

Every id becomes B tokens (vLLM's client expands it into the same B token ids every time, so
shared prefixes stay shared) and the partial last block the same fraction of B; outputs are
scaled, capped and at least 1; arrival times are rebased to the window's first request and
scaled (``time_scale``: trace ms -> replay s), and written back in ms, the format's unit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

__all__ = ["TRACE_BLOCK_TOKENS", "TraceError", "TraceScaling", "read_window", "scale_window",
           "window_stats", "write_trace"]

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces


class TraceError(ValueError):
    """The trace file or the window asked of it is unusable; the message says which line."""


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"--{attribute.name.replace('_', '-')} must be positive, got {value!r}")


def _not_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"--{attribute.name} must be 0 or more, got {value!r}")


@attrs.frozen
class TraceScaling:
    """Which requests to replay and how to shrink them (the trace README's recipe)."""

    start: int = attrs.field(default=1000, validator=_not_negative)
    count: int = attrs.field(default=160, validator=_positive)
    block_tokens: int = attrs.field(default=16, validator=_positive)
    output_scale: float = attrs.field(default=0.125, validator=_positive)
    output_cap: int = attrs.field(default=64, validator=_positive)
    time_scale: float = attrs.field(default=0.002, validator=_positive)  # trace ms -> replay s


def _check_entry(entry: object, where: str) -> dict:
    ok = (isinstance(entry, dict) and isinstance(entry.get("timestamp"), (int, float))
          and isinstance(entry.get("input_length"), int) and entry["input_length"] >= 1
          and isinstance(entry.get("output_length"), int) and entry["output_length"] >= 0
          and isinstance(entry.get("hash_ids"), list) and entry["hash_ids"]
          and all(isinstance(h, int) for h in entry["hash_ids"]))
    if not ok:
        raise TraceError(f"{where}: not a Mooncake trace request (want timestamp, "
                         f"input_length >= 1, output_length >= 0, non-empty integer hash_ids)")
    return entry  # type: ignore[return-value]


def read_window(path: Path, start: int, count: int) -> list[dict]:
    """Requests ``start`` .. ``start + count - 1`` (0-based, blank lines skipped) of a JSONL
    trace.

    Raises:
        FileNotFoundError: no file at ``path``.
        TraceError: the window runs past the file's end, or a request in it is malformed.
    """
    if not path.is_file():
        raise FileNotFoundError(f"--trace {path}: no such file (Mooncake's JSONL format, e.g. "
                                "../shared/data/traces/mooncake_synthetic_trace.jsonl)")
    with path.open(encoding="utf-8") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    if start + count > len(lines):
        raise TraceError(f"--start {start} --count {count}: the window ends at request "
                         f"{start + count - 1}, but {path} has {len(lines)} requests "
                         f"(0..{len(lines) - 1})")
    window = []
    for number, line in lines[start:start + count]:
        try:
            entry = json.loads(line)
        except ValueError as error:
            raise TraceError(f"{path}:{number}: not JSON ({error})") from None
        window.append(_check_entry(entry, f"{path}:{number}"))
    return window


def _half_up(value: float) -> int:
    return math.floor(value + 0.5)


def scale_window(window: list[dict], scaling: TraceScaling) -> list[dict]:
    """The window in the trace's format, scaled: ``timestamp`` rebased to the first request and
    multiplied by ``time_scale`` (then in replay milliseconds: ``time_scale`` maps trace ms to
    replay s); ``input_length`` (n - 1) full blocks of ``block_tokens`` plus the partial last
    block's fraction of them (at least 1 token); ``output_length`` × ``output_scale``, half up,
    capped at ``output_cap``, at least 1; ``hash_ids`` unchanged, so shared prefixes stay shared.

    Raises:
        TraceError: a timestamp earlier than the window's first.
    """
    first = window[0]["timestamp"]
    out = []
    for entry in window:
        if entry["timestamp"] < first:
            raise TraceError(f"timestamp {entry['timestamp']} is before the window's first "
                             f"({first}): the trace must be in arrival order")
        blocks = len(entry["hash_ids"])
        partial = min(max(entry["input_length"] - (blocks - 1) * TRACE_BLOCK_TOKENS, 1),
                      TRACE_BLOCK_TOKENS)
        last = max(1, _half_up(partial * scaling.block_tokens / TRACE_BLOCK_TOKENS))
        output = _half_up(entry["output_length"] * scaling.output_scale)
        out.append({"timestamp": round((entry["timestamp"] - first) * scaling.time_scale * 1000,
                                       3),
                    "input_length": (blocks - 1) * scaling.block_tokens + last,
                    "output_length": max(1, min(scaling.output_cap, output)),
                    "hash_ids": list(entry["hash_ids"])})
    return out


def write_trace(rows: list[dict], path: Path) -> None:
    """One JSON object per line, as the trace itself."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def window_stats(scaled: list[dict]) -> dict:
    """Totals of a scaled window: requests, prompt and output tokens, seconds of arrivals,
    block ids and distinct block ids."""
    ids = [h for row in scaled for h in row["hash_ids"]]
    return {"num_requests": len(scaled),
            "prompt_tokens": sum(row["input_length"] for row in scaled),
            "output_tokens": sum(row["output_length"] for row in scaled),
            "arrival_span_s": round(scaled[-1]["timestamp"] / 1000, 3),
            "num_blocks": len(ids), "num_distinct_blocks": len(set(ids))}
