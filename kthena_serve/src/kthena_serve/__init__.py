"""kthena_serve: the reference engine and OpenAI-compatible server over the other four layers.

* ``LLM(model=..., **engine_config).generate(prompts, SamplingParams(...))``: offline Python API;
* ``AsyncLLM``: the engine on a background thread with per-request async streams;
* ``EngineCoreClient``: the same streams over an engine in a process of its own (what ``kthena
  serve`` runs for one colocated rank);
* ``LLMEngine``: ``step()`` = schedule -> run -> postprocess, continuous batching with chunked
  prefill, prefix reuse and preemption through mooncake_kv;
* ``kthena serve``: the command line (see docs/kthena_serve.md);
* ``kthena_serve.bench``: every benchmark (``kthena bench serve``, ``soak``, ``layouts``, ``kv``,
  ``python -m kthena_serve.bench.pd`` ...); the serving modules never import it;
* ``load_config`` -> ``DistributedModel`` -> ``launch_distributed_inference``: the source
  article's Python entry points, over ``LLM`` and ``kthena serve --config``.

Names are imported lazily so ``import kthena_serve`` stays cheap (no torch until used). The
import leaves the process as it was (``os.environ`` included): OpenMP's wait policy is decided
by the entry points, ``LLM(...)`` among them, before torch loads (``kthena_serve.engine.threads``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kthena_core.lazy import lazy_exports

try:
    __version__ = version("kthena-serve")  # the installed package's metadata
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LLM": "llm", "AsyncLLM": "async_engine", "EngineCoreClient": "engine_core",
    "LLMEngine": "engine.llm_engine",
    "EngineStats": "engine.stats", "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_output",
    "RequestOutput": "engine.request", "FinishReason": "engine.request",
    "TokenLogprobs": "engine.logprobs", "InvalidRequestError": "engine.errors",
    "EngineDeadError": "engine.errors", "OverloadedError": "engine.errors",
    "DistributedModel": "distributed", "DistributedArgumentError": "distributed",
    "launch_distributed_inference": "distributed", "load_config": "distributed",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
