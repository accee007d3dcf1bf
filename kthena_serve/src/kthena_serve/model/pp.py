"""Pipeline parallelism as a plan applied from outside the model, like `TensorParallel`.

`PipelineStage` says which stage this process is and which decoder layers it holds; the rule for
the split (contiguous stages, equal by default or cut at explicit split points) is kthena_core's
(`kthena_core.shape.stage_layer_range`), so the planner's layer check and the engine's split
cannot disagree::

    30 layers, pp=2       stage 0: embedding + layers 0..14 ──(hidden, residual)──▶
                          stage 1: layers 15..29 + final norm + LM head ──▶ logits

    split_points (19,)    stage 0: embedding + layers 0..18 ──▶ stage 1: layers 19..29 + LM head

The first stage embeds the tokens, the last computes logits (a tied LM head means the last stage
loads the embedding table too); a middle stage turns a (hidden, residual) pair into the next one.
Nothing here sends tensors: the runner (kthena_serve.engine.parallel_runner) moves them between stages.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kthena_core.shape import LayerSplitError, stage_layer_range
from kthena_serve.model.errors import TensorParallelError

__all__ = ["PipelineStage"]


@attrs.frozen
class PipelineStage:
    """Stage ``rank`` of ``size``, holding decoder layers ``layers`` (global indices)."""

    rank: int
    size: int
    layers: range

    @classmethod
    def of(cls, num_layers: int, size: int = 1, rank: int = 0,
           split_points: Sequence[int] | None = None) -> PipelineStage:
        """Stage `rank` of `size` over `num_layers` layers, equal stages or cut at
        `split_points` (the first layer of stages 1 .. size - 1).

        Raises:
            TensorParallelError: `size` does not divide the layers (no split points), the split
                points do not cut them into `size` non-empty stages, or `rank` is out of range;
                the message says what is allowed.
        """
        try:
            return cls(rank, size, stage_layer_range(num_layers, size, rank, split_points))
        except LayerSplitError as e:
            raise TensorParallelError(f"pipeline parallelism: {e}") from None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds(self, layer: int) -> bool:
        return layer in self.layers
