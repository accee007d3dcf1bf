"""PrefillJob: one prefill as the executor's queue holds it (prefill.py), from submit to its
future's result; and the row the sampler reads for its first token.

A job's block table is the decode worker's (``shm``: given with the task) or its own pool's
(admitted at its first step: prefix match, then the rest allocated). ``num_computed`` counts the
prompt tokens with KV (the cached prefix included); a layer-wise push (``push``) sends each
block out once its last token's K/V is written.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from kthena_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kthena_serve.logprobs import TokenLogprobs
    from kthena_serve.model_runner import ModelRunner
    from kthena_serve.pd.transfer import BlockPush

__all__ = ["FirstTokenRow", "PrefillJob"]


@attrs.frozen
class FirstTokenRow:
    """What the sampler reads for a prompt's first token (no engine request exists here)."""

    request_id: str
    params: SamplingParams
    output_token_ids: tuple[int, ...] = ()


@attrs.define(eq=False)
class PrefillJob:
    """One queued or running prefill (compute thread state, but ``cancelled``)."""

    rid: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    runner: ModelRunner
    finish: Callable[[PrefillJob, int, TokenLogprobs | None], Any]  # -> the future's result
    future: concurrent.futures.Future
    block_ids: tuple[int, ...] | None = None  # None: own pool, not admitted yet
    num_computed: int = 0  # tokens with KV (cached prefix included)
    num_cached: int = 0
    cache_salt: str | None = None
    started: float | None = None
    compute_s: float = 0.0
    is_owned: bool = False  # computes into the own pool (blocks from the own KV manager)
    cancelled: bool = False
    push: BlockPush | None = None  # layer-wise: its completed blocks go out as each layer runs
    push_dst: tuple[int, ...] = ()  # the decode pool's blocks for the prompt
    num_pushed: int = 0  # blocks (from the start of the prompt) pushed or not to push
    forward_end: float = 0.0  # perf_counter at the end of its latest forward
