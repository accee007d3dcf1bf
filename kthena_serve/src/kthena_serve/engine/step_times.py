"""Where the engine thread's time goes: seconds per phase of a step, and idle, since start.

One ``LLMEngine.step()`` is timed in three parts; ``AsyncLLM`` adds the time its thread waits
with nothing runnable::

    │ schedule │ forward (prefill if any prompt token ran, else decode) │ sampling │ idle ... │
    └─ scheduler.schedule()                                  postprocess ┘  wakeup.wait ┘

``sampling`` is the whole postprocess: sampling, logprobs, stop checks and detokenising. These
are the ``kthena_step_seconds_total{phase}`` counters ``kthena doctor`` splits step time by.
``StepClock`` is the engine's stopwatch that marks a step's phases and adds them up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

__all__ = ["PHASES", "StepClock", "StepTimes"]

PHASES = ("schedule", "prefill", "decode", "sampling", "idle")


@attrs.frozen
class StepTimes:
    """Seconds spent per phase since start (counters; see the module docs).

    Attributes:
        schedule_s: in ``Scheduler.schedule``.
        prefill_s: forwards of steps that ran prompt tokens (chunked prefill mixes decode rows
            in; such a step counts here).
        decode_s: forwards of decode-only steps.
        sampling_s: postprocessing a step: sampling, logprobs, stop checks, detokenising.
        idle_s: the engine thread waiting for work (``AsyncLLM`` only).
    """

    schedule_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sampling_s: float = 0.0
    idle_s: float = 0.0

    def seconds(self, phase: str) -> float:
        """The seconds of one of ``PHASES``."""
        return getattr(self, f"{phase}_s")

    def after_step(self, *, schedule_s: float, forward_s: float, sampling_s: float,
                   has_prefill: bool) -> StepTimes:
        """These times plus one step's."""
        return attrs.evolve(
            self, schedule_s=self.schedule_s + schedule_s,
            prefill_s=self.prefill_s + (forward_s if has_prefill else 0.0),
            decode_s=self.decode_s + (0.0 if has_prefill else forward_s),
            sampling_s=self.sampling_s + sampling_s)

    @classmethod
    def total(cls, parts: Sequence[StepTimes]) -> StepTimes:
        """The per-phase sum over several engines (a PD or data-parallel deployment)."""
        return cls(**{f"{p}_s": sum(t.seconds(p) for t in parts) for p in PHASES})


class StepClock:
    """Marks the phases of each ``LLMEngine.step()`` with ``time.perf_counter`` and adds them
    up in ``times``: ``start``, ``scheduled``, ``forwarded``, ``stop``, in that order."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self._started = self._scheduled = self._forwarded = 0.0
        self._has_prefill = False

    def start(self) -> None:
        """A step begins: scheduling from now."""
        self._started = time.perf_counter()

    def scheduled(self, *, has_prefill: bool) -> None:
        """Scheduling is done; the forward from now (a prefill one if any prompt token runs)."""
        self._scheduled = time.perf_counter()
        self._has_prefill = has_prefill

    def forwarded(self) -> None:
        """The forward is done; sampling (the whole postprocess) from now."""
        self._forwarded = time.perf_counter()

    def stop(self) -> float:
        """The step is done: its phases go into ``times``. Returns its forward and sampling
        seconds (what each decode in it waited for)."""
        ended = time.perf_counter()
        self.times = self.times.after_step(
            schedule_s=self._scheduled - self._started, forward_s=self._forwarded - self._scheduled,
            sampling_s=ended - self._forwarded, has_prefill=self._has_prefill)
        return ended - self._scheduled
