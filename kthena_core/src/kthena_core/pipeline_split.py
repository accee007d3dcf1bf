"""PipelineSplit: where a pipeline's stages start, and why the planner moved them.

Equal stages (``num_layers / pp`` layers each) are the default. They are unbalanced when the ends
weigh much: the last stage also runs the final norm and the LM head (vocab x hidden, read in
full for every decode step), so with a large vocabulary it is the slowest stage and sets the
pipeline's pace. The planner prices every stage of the equal split with the cost model
(`cost_model.StagePricer`); when the slowest stage is more than `UNEVEN_THRESHOLD` slower than it
would be under the best split, it proposes that split, and the plan says so::

    SmolLM2-135M, pp=2: 30 layers + LM head (49152 x 576 ~ 8 layers' weights)
    equal  (15,)   stage 0: 15 layers           stage 1: 15 layers + LM head   <- slowest
    moved  (19,)   stage 0: 19 layers           stage 1: 11 layers + LM head

The best split minimises the slowest stage: bisection on that stage's time, each probe packing
layers greedily from stage 0 on, the last stage (with the LM head) taking the rest (a stage's time
grows with every layer it takes, so the greedy packing fits whenever any split does).

A pp that does not divide the layers has no equal split: the planner takes the best split at
once (source ``"balanced"``, no equal stage times), and the plan carries its points to the
engine (``--pipeline-split-points``)::

    DeepSeek-V3, TP8 x PP4 on 4 Atlas nodes: 61 layers (3 dense, then 58 MoE) + LM head
    balanced (17, 32, 47)   17 + 15 + 15 + 14 layers: the LM head's stage gets the fewest
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kthena_core.shape import equal_split_points, stage_layer_ranges

__all__ = ["UNEVEN_THRESHOLD", "PipelineSplit", "balanced_split_points", "pinned_split",
           "propose_split"]

# Moving split points off the equal split is proposed only when it makes the slowest stage at
# least this much faster: a smaller gain is within the cost model's own error.
UNEVEN_THRESHOLD = 0.10

StageTime = Callable[[range, bool], float]  # (layers, is_last) -> seconds


@attrs.frozen
class PipelineSplit:
    """The split a plan uses, and the stage times that chose it.

    Attributes:
        points: the first layer of stages 1 .. pp - 1.
        stage_seconds: predicted decode micro-step time of each stage under ``points``.
        equal_stage_seconds: the same under the equal split (the default).
        source: ``"equal"`` (the default kept), ``"balanced"`` (the planner moved the points) or
            ``"config"`` (pinned by ``parallelism.pipeline_split_points``).
    """

    points: tuple[int, ...]
    stage_seconds: tuple[float, ...]
    equal_stage_seconds: tuple[float, ...] = ()
    source: str = "equal"

    @property
    def has_equal_split(self) -> bool:
        """Whether pp divides the layers (there is an equal split to compare with)."""
        return bool(self.equal_stage_seconds)

    @property
    def is_uneven(self) -> bool:
        """Whether the engine must be told the points (they are not the equal split's)."""
        return self.source != "equal"

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(map(len, stage_layer_ranges(num_layers, len(self.points) + 1, self.points)))

    def reason(self, num_layers: int) -> str:
        """One line on the split: its layers per stage and, when moved, why."""
        counts = "+".join(map(str, self.stage_layers(num_layers)))
        ms = "/".join(f"{t * 1e3:.2f}" for t in self.stage_seconds)
        if self.source == "config":
            return f"split at {list(self.points)} ({counts} layers; parallelism.pipeline_split_points), stage times {ms} ms"
        if self.source == "equal":
            return f"equal stages ({counts} layers), stage times {ms} ms"
        if not self.has_equal_split:
            return (f"split at {list(self.points)} ({counts} layers): pp={len(self.points) + 1} "
                    f"does not divide the {num_layers} layers, so the stages are cut where the "
                    f"slowest is fastest; stage times {ms} ms")
        equal = "/".join(f"{t * 1e3:.2f}" for t in self.equal_stage_seconds)
        gain = max(self.equal_stage_seconds) / max(self.stage_seconds) - 1
        return (f"split moved to {list(self.points)} ({counts} layers): equal stages were "
                f"unbalanced (stage times {equal} ms; the last stage also runs the LM head), now "
                f"{ms} ms, slowest stage {gain:.0%} faster")

    def to_dict(self, num_layers: int) -> dict[str, Any]:
        return {"points": list(self.points), "source": self.source,
                "stage_layers": list(self.stage_layers(num_layers)),
                "stage_seconds": list(self.stage_seconds),
                "equal_stage_seconds": list(self.equal_stage_seconds),
                "reason": self.reason(num_layers)}


def _stage_times(num_layers: int, pp: int, points: tuple[int, ...], time: StageTime) -> tuple[float, ...]:
    ranges = stage_layer_ranges(num_layers, pp, points)
    return tuple(time(r, s == pp - 1) for s, r in enumerate(ranges))


def _pack(num_layers: int, pp: int, cap: float, time: StageTime) -> tuple[int, ...] | None:
    """Points putting as many layers as fit under `cap` in each stage from stage 0 on, each
    stage at least one layer; None when the last stage (the rest, with the LM head) would then
    exceed `cap`."""
    start, points = 0, []
    for stage in range(pp - 1):
        stop = start + 1  # at least one layer, leaving one for each later stage
        if time(range(start, stop), False) > cap:
            return None
        while stop + 1 <= num_layers - (pp - 1 - stage) and time(range(start, stop + 1), False) <= cap:
            stop += 1
        points.append(stop)
        start = stop
    if time(range(start, num_layers), True) > cap:
        return None
    return tuple(points)


def balanced_split_points(num_layers: int, pp: int, time: StageTime) -> tuple[int, ...]:
    """The split points that minimise the slowest stage's `time` (to a relative 1e-9).

    Args:
        num_layers: decoder layers.
        pp: stages (1 .. num_layers).
        time: a stage's seconds for its layers (and the LM head when it is the last); must
            grow when a stage takes another layer.
    """
    hi = max(_stage_times(num_layers, pp, _any_points(num_layers, pp), time))
    lo = 0.0
    best = _pack(num_layers, pp, hi, time)
    assert best is not None
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        packed = _pack(num_layers, pp, mid, time)
        if packed is None:
            lo = mid
        else:
            hi, best = mid, packed
    return best


def _any_points(num_layers: int, pp: int) -> tuple[int, ...]:
    """A valid split to start from: equal where pp divides the layers, else near-equal."""
    if num_layers % pp == 0:
        return equal_split_points(num_layers, pp)
    return tuple(round(s * num_layers / pp) for s in range(1, pp))


def propose_split(num_layers: int, pp: int, time: StageTime,
                  threshold: float = UNEVEN_THRESHOLD) -> PipelineSplit:
    """The equal split, or the balanced one when the equal split's slowest stage is more than
    `threshold` slower than the balanced split's; the balanced one when pp does not divide the
    layers (there is no equal split; pp must not exceed them: `check_num_stages`)."""
    if num_layers % pp:
        points = balanced_split_points(num_layers, pp, time)
        return PipelineSplit(points, _stage_times(num_layers, pp, points, time), (), "balanced")
    equal = equal_split_points(num_layers, pp)
    equal_times = _stage_times(num_layers, pp, equal, time)
    kept = PipelineSplit(equal, equal_times, equal_times, "equal")
    if pp == 1:
        return kept
    points = balanced_split_points(num_layers, pp, time)
    times = _stage_times(num_layers, pp, points, time)
    if max(equal_times) <= (1 + threshold) * max(times):
        return kept
    return PipelineSplit(points, times, equal_times, "balanced")


def pinned_split(num_layers: int, pp: int, points: tuple[int, ...], time: StageTime) -> PipelineSplit:
    """The split ``parallelism.pipeline_split_points`` pins, priced like a proposed one."""
    equal = (_stage_times(num_layers, pp, equal_split_points(num_layers, pp), time)
             if num_layers % pp == 0 else ())
    return PipelineSplit(points, _stage_times(num_layers, pp, points, time), equal, "config")
