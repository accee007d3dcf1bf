"""EngineClient: the one seam the OpenAI app, its metrics and the CLI talk to.

::

    server/app.py, server/metrics.py, cli.py
                 │  EngineClient: limits · encode(_chat) · check · token_bytes
                 │                generate · abort(_all) · stats
       ┌─────────┴──────────────┐
    AsyncLLM (in process)     RemoteEngine (PD router: workers over HTTP)

Both implementations validate with the same ``InputProcessor``, so a request gets the same
answer whichever serves it. ``EngineStats`` is plain data: a PD router sums its workers'.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from kthena_serve.request import EngineRequest, RequestOutput
from kthena_serve.sampling_params import SamplingParams
from mooncake_kv import KVCacheStats

__all__ = ["EngineClient", "EngineLimits", "EngineStats"]

_KV_FIELDS = tuple(f.name for f in attrs.fields(KVCacheStats))


@attrs.frozen
class EngineLimits:
    """What a client may ask of an engine.

    Attributes:
        max_model_len: prompt + output tokens at most.
        vocab_size: token ids lie in ``[0, vocab_size)``.
        max_n: choices per API call at most.
        num_kv_blocks, block_size: the KV pool (summed over PD decode workers).
    """

    max_model_len: int
    vocab_size: int
    max_n: int
    num_kv_blocks: int
    block_size: int


@attrs.frozen
class EngineStats:
    """Counters since start, a queue snapshot, and the KV manager's stats."""

    num_steps: int
    num_computed_prompt_tokens: int  # prompt (and recomputed) tokens actually run
    num_generated_tokens: int
    num_preemptions: int
    num_waiting: int
    num_running: int
    kv: KVCacheStats

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineStats:
        fields = dict(data)
        fields["kv"] = KVCacheStats(**fields["kv"])
        return cls(**fields)

    @classmethod
    def total(cls, parts: Sequence[EngineStats], block_size: int, *,
              kv_from: Sequence[EngineStats] | None = None) -> EngineStats:
        """The sum of several engines' stats (a PD or data-parallel deployment).

        Args:
            parts: every engine's stats; their counters are summed.
            block_size: the deployment's block size.
            kv_from: the engines whose KV pools serve requests (default ``parts``); PD prefill
                workers compute into decode workers' pools, so their KV is not counted twice.
        """
        counters = {f.name: sum(getattr(p, f.name) for p in parts)
                    for f in attrs.fields(cls) if f.name != "kv"}
        pools = parts if kv_from is None else kv_from
        kv = {name: sum(getattr(p.kv, name) for p in pools) for name in _KV_FIELDS}
        kv["block_size"] = block_size
        return cls(**counters, kv=KVCacheStats(**kv))


@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP app needs of an engine, in process or remote."""

    @property
    def is_alive(self) -> bool: ...

    def limits(self) -> EngineLimits: ...

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt; token-id prompts are checked against the vocabulary."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the model's chat template applied, with the generation prompt."""
        ...

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """The resolved output budget; raises InvalidRequestError for what the engine refuses."""
        ...

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for (logprobs name their tokens with these)."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a validated request's outputs; leaving early aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self, message: str) -> None:
        """End every request in flight; each stream fails with ``EngineDeadError(message)``."""
        ...

    def stats(self) -> EngineStats: ...
