"""Control messages between router, decode and prefill workers (JSON; no KV bytes).

::

    router ──POST /pd/generate {request}──▶ decode
                                             │ reserve blocks (own prefix cache honoured)
    decode ──POST /pd/prefill {PrefillTask}──▶ prefill ── writes K/V into those blocks
    decode ◀── {PrefillResult: first token} ──┘   (and its logprobs, if the request asked)
    router ◀── NDJSON lines of outputs ─────── decode

An output line carries only the logprobs of its new tokens (``new_logprobs``); the router
rebuilds the running list (``output_from_json(data, earlier)``), so a long generation does not
resend every earlier token's alternatives on each step.
"""

from __future__ import annotations

from typing import Any

import attrs

from kthena_serve.engine.logprobs import TokenLogprobs
from kthena_serve.engine.request import FinishReason, RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams

__all__ = ["PoolRef", "PrefillResult", "PrefillTask", "output_from_json", "output_to_json",
           "params_from_json", "params_to_json"]


@attrs.frozen
class PoolRef:
    """Where a decode worker's KV pool is: a shm name or a CUDA IPC export (same host:
    pool_share.py) and/or a Mooncake handle; ``dtype`` / ``kv_cache_dtype`` are the decode
    worker's ``EngineConfig`` values (an int8 pool's scale region is part of its layout)."""

    num_blocks: int
    block_size: int
    dtype: str
    shm_name: str | None = None
    mooncake_handle: str | None = None  # kthena_comm MemoryHandle.to_json()
    kv_cache_dtype: str = "auto"
    device_ipc: dict[str, Any] | None = None  # pool_share.CudaIpcExport.to_json() (cuda pool)
    tp: int = 1  # the decode instance's TP size: its ranks each hold their own heads' pool
    rank_shm_names: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # tp > 1: each
    # rank's /dev/shm pool, rank 0's first (pd/reshard.py)
    rank_mooncake_handles: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # tp > 1
    # over mooncake: each rank's pool as registered (MemoryHandle.to_json()), rank 0's first

    def rank_names(self) -> tuple[str, ...]:
        """Every rank's /dev/shm pool name, rank 0's first (tp 1: ``shm_name``).

        Raises:
            ValueError: no names for ``tp`` ranks (a pool registered with Mooncake instead).
        """
        names = self.rank_shm_names or ((self.shm_name,) if self.shm_name else ())
        if len(names) != self.tp:
            raise ValueError(f"the decode pool names {len(names)} /dev/shm rank pools for "
                             f"tp={self.tp}: its decode worker does not run --pd-transport shm "
                             "(over mooncake its ranks' pools are put into); start every "
                             "worker with the same --pd-transport")
        return names

    def rank_handles(self) -> tuple[str, ...]:
        """Every rank's pool as registered with Mooncake, rank 0's first (tp 1:
        ``mooncake_handle``): what a prefill worker puts each rank's heads into.

        Raises:
            ValueError: no handles for ``tp`` ranks (a pool not registered with Mooncake).
        """
        handles = self.rank_mooncake_handles or (
            (self.mooncake_handle,) if self.mooncake_handle else ())
        if len(handles) != self.tp:
            raise ValueError(f"the decode pool names {len(handles)} Mooncake rank pools for "
                             f"tp={self.tp}: its decode worker does not run --pd-transport "
                             "mooncake; start every worker with the same --pd-transport")
        return handles


@attrs.frozen
class PrefillTask:
    """Compute ``token_ids[num_cached_tokens:]`` into ``block_ids`` of ``pool``; sample one."""

    request_id: str
    token_ids: tuple[int, ...]
    num_cached_tokens: int
    block_ids: tuple[int, ...]
    params: dict[str, Any]
    pool: PoolRef
    cache_salt: str | None = None

    def check(self) -> None:
        """Raise ValueError for a task whose block table cannot hold its prompt."""
        size = self.pool.block_size
        num_tokens = len(self.token_ids)
        if not 0 <= self.num_cached_tokens < num_tokens or self.num_cached_tokens % size:
            raise ValueError(f"num_cached_tokens={self.num_cached_tokens} must be a multiple of "
                             f"{size} below the prompt length {num_tokens}")
        if len(self.block_ids) != -(-num_tokens // size):
            raise ValueError(f"{len(self.block_ids)} blocks cannot hold exactly {num_tokens} "
                             "tokens")
        if any(not 0 <= b < self.pool.num_blocks for b in self.block_ids):
            raise ValueError(f"block ids must lie in [0, {self.pool.num_blocks})")

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrefillTask:
        data = dict(data)
        data["pool"] = PoolRef(**data["pool"])
        data["token_ids"] = tuple(data["token_ids"])
        data["block_ids"] = tuple(data["block_ids"])
        return cls(**data)


def _logprobs_or_none(value: TokenLogprobs | dict | None) -> TokenLogprobs | None:
    if value is None or isinstance(value, TokenLogprobs):
        return value
    return TokenLogprobs.from_json(value)


@attrs.frozen
class PrefillResult:
    """The first token, and what the handoff cost (for metrics)."""

    request_id: str
    first_token_id: int
    num_computed_tokens: int
    compute_s: float
    handoff_s: float  # from the end of its last forward to the KV in the decode pool (0: shm)
    handoff_bytes: int  # KV bytes that crossed a wire or a copy (0 for zero copy)
    num_prefill_cached_tokens: int = 0  # tokens the prefill worker's own cache supplied
    first_token_logprobs: TokenLogprobs | None = attrs.field(default=None,
                                                           converter=_logprobs_or_none)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        if self.first_token_logprobs is not None:
            data["first_token_logprobs"] = self.first_token_logprobs.to_json()
        return data


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    data = attrs.asdict(params)
    data["stop"] = list(params.stop)
    data["stop_token_ids"] = list(params.stop_token_ids)
    return data


def params_from_json(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**data)


def output_to_json(out: RequestOutput) -> dict[str, Any]:
    """The output as JSON, with the logprobs of its new tokens only (``new_logprobs``)."""
    data = attrs.asdict(out, recurse=False)
    data["finish_reason"] = out.finish_reason.value if out.finish_reason else None
    del data["logprobs"]
    new = out.new_logprobs
    data["new_logprobs"] = None if new is None else [e.to_json() for e in new]
    return data


def output_from_json(data: dict[str, Any],
                     earlier: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
    """Read ``output_to_json``; ``earlier``: the logprobs of the previous line of this request."""
    data = dict(data)
    reason = data.get("finish_reason")
    data["finish_reason"] = FinishReason(reason) if reason else None
    data["new_token_ids"] = tuple(data["new_token_ids"])
    data["token_ids"] = tuple(data["token_ids"])
    new = data.pop("new_logprobs", None)
    data["logprobs"] = None if new is None else (
        (earlier or ()) + tuple(TokenLogprobs.from_json(e) for e in new))
    return RequestOutput(**data)
