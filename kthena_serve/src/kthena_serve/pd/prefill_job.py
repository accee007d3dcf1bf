"""PrefillJob: one prefill as the executor holds it (prefill.py), from submit to its future's
result.

Its ``request`` is what the one ``Scheduler`` schedules: a prompt over the decode worker's
block table (``shared_blocks``, added as *external*), or over this worker's own pool (admitted
by the scheduler: prefix match, blocks chunk by chunk). A layer-wise push (``push``) sends
each block out once its last token's K/V is written.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from kthena_serve.engine.logprobs import TokenLogprobs
    from kthena_serve.engine.model_runner import ModelRunner
    from kthena_serve.engine.request import Request
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.pd.transfer import BlockPush

__all__ = ["PrefillJob"]


@attrs.define(eq=False)
class PrefillJob:
    """One queued or running prefill (compute thread state, but ``cancelled``).

    Attributes:
        request: the scheduler's view (tokens, computed count, block table, sampling params).
        runner: the model over the pool its KV goes into (a decode worker's, or the own one).
        finish: called with (job, first token, its logprobs) once sampled; its return value
            (or a future of it: a handoff still running) is the job's result.
        shared_blocks: the decode pool's block table (``shm``); None: the own pool's.
        num_cached: prompt tokens whose KV was there before it ran (the decode worker's
            prefix for ``shm``; the own prefix cache's, set at admission, otherwise).
        in_scheduler: the scheduler holds its request (waiting or running).
        holds_blocks: set aside with its own-pool blocks still held (pinned, or handed off).
    """

    request: Request
    runner: ModelRunner
    finish: Callable[[PrefillJob, int, TokenLogprobs | None], Any]
    future: concurrent.futures.Future
    shared_blocks: tuple[int, ...] | None = None
    num_cached: int = 0
    in_scheduler: bool = False
    holds_blocks: bool = False
    started: float | None = None
    compute_s: float = 0.0
    cancelled: bool = False
    push: BlockPush | None = None  # layer-wise: its completed blocks go out as each layer runs
    push_dst: tuple[int, ...] = ()  # the decode pool's blocks for the prompt
    num_pushed: int = 0  # blocks (from the start of the prompt) pushed or not to push
    forward_end: float = 0.0  # perf_counter at the end of its latest forward

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.request.block_ids

    @property
    def is_owned(self) -> bool:
        """It computes into the own pool (blocks from the own KV manager)."""
        return self.shared_blocks is None
