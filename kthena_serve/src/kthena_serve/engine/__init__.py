"""The engine room: ``LLMEngine`` and the parts it is assembled from. Nothing here imports the
rooms that serve it (server, pd, dp, cluster, kv_events, bench, doctor, spec, cli,
distributed, async_engine, client): an import-linter contract in pyproject.toml keeps it so.

``step()`` is schedule -> run -> postprocess. ``LLMEngine.from_config`` builds the defaults::

    LLMEngine (llm_engine.py)
      ── build_runner, create_kv_manager   the runner over its pool and the KV manager (assembly)
      ── InputProcessor (input_processor)  tokenise + validate once (EngineRequest, request);
      │                                    grammars compiled (grammar, structured_output)
      ── Scheduler (scheduler, scheduled)  continuous batching; PD verbs reserve / admit_prefilled
      │     ├─ KVCacheManager               mooncake_kv: index kind, hash algorithm, block size
      │     ├─ offload tiers (kv_offload)   host memory, Mooncake Store below the pool
      │     ├─ promotions (promotion)       prefixes copied back up from the tiers, then run
      │     └─ prefill budget (step_cost)   target_step_ms: fed every step's time (step_times)
      ── runner (model_runner)             ModelRunner over a KVPool (host, shm, device), or
      │                                    tp x pp ranks (parallel_runner, placement, threads)
      ── Sampler (sampler, logprobs)       on the runner's device; a GrammarMatcher per
      │                                    structured request fills the token bitmask
      ── OutputStream (output_stream)      incremental detokenising, stop strings
      ── admission (admission, kv_outlook) the queue bound and KV outlook the server checks first

    config (EngineConfig, ConfigError) · sampling_params · errors · sizes · stats (EngineStats)

``LLMEngine``, ``build_runner`` and ``create_kv_manager`` are imported on first use, so reading
``kthena_serve.engine.config`` does not load torch's model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kthena_serve.engine.assembly import build_runner, create_kv_manager
    from kthena_serve.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine", "build_runner", "create_kv_manager"]

_HOMES = {"LLMEngine": "llm_engine", "build_runner": "assembly", "create_kv_manager": "assembly"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"kthena_serve.engine.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'kthena_serve.engine' has no attribute {name!r}")
