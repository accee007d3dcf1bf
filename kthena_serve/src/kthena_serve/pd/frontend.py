"""The router's OpenAI front: the unchanged server app over a ``RemoteEngine``.

``RemoteEngine`` has the surface of ``AsyncLLM`` that ``server.build_app`` uses (encode, check,
generate, stats, is_alive, and ``.engine`` with tokenizer, config, max_model_len, kv), so the
OpenAI API, its validation, SSE and error bodies are the very same code as ``kthena serve``.
``generate`` asks the ``Router`` for workers and streams the decode worker's NDJSON outputs;
times are re-stamped here, on the client's side of the wire.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

import attrs
import httpx
from fastapi import FastAPI

from kthena_serve.config import EngineConfig
from kthena_serve.engine import EngineStats, LLMEngine
from kthena_serve.errors import EngineDeadError, InvalidRequestError
from kthena_serve.pd.protocol import output_from_json, params_to_json
from kthena_serve.pd.router import Router
from kthena_serve.request import RequestOutput
from kthena_serve.sampling_params import SamplingParams
from mooncake_kv import KVCacheStats

__all__ = ["RemoteEngine", "build_router_app"]

_KV_FIELDS = [f.name for f in attrs.fields(KVCacheStats)]


class _ClusterKV:
    def __init__(self, router: Router) -> None:
        self.router = router

    def stats(self) -> KVCacheStats:
        total = dict.fromkeys(_KV_FIELDS, 0)
        for worker in self.router.workers.values():
            if worker.role == "decode" and worker.kv:
                for name in _KV_FIELDS:
                    total[name] += worker.kv.get(name, 0)
        total["block_size"] = self.router.block_size
        return KVCacheStats(**total)


class _Facade:
    """What the app reads from ``engine.engine``."""

    def __init__(self, router: Router, tokenizer, config: EngineConfig) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self.config = config
        self.kv = _ClusterKV(router)
        self.router = router
        self.vocab_size = getattr(tokenizer, "vocab_size", None)

    @property
    def max_model_len(self) -> int:
        lens = [w.max_model_len for w in self.router.workers.values() if w.max_model_len]
        return min(lens) if lens else (self.config.max_model_len or 2048)


class RemoteEngine:
    """``AsyncLLM``'s surface, served by PD workers through a ``Router``."""

    def __init__(self, router: Router, tokenizer, config: EngineConfig) -> None:  # noqa: ANN001
        self.router = router
        self.engine = _Facade(router, tokenizer, config)
        self._client: httpx.AsyncClient | None = None

    @property
    def is_alive(self) -> bool:
        return bool(self.router.up("decode"))

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise InvalidRequestError("prompt token ids must be non-negative ints", "prompt")
        return ids

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        return LLMEngine.resolve_max_tokens(self.engine, len(prompt_ids), params)  # type: ignore[arg-type]

    def stats(self) -> EngineStats:
        decodes = [w for w in self.router.workers.values() if w.role == "decode"]
        return EngineStats(0, 0, 0, 0, sum(w.num_waiting for w in decodes),
                           sum(w.num_running for w in decodes), self.engine.kv.stats())

    def abort(self, request_id: str) -> None:
        """Closing the stream to the decode worker aborts the request there."""

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=2.0))
        return self._client

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       *, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        try:
            decision = self.router.choose(prompt_ids, cache_salt)
        except LookupError as error:
            raise EngineDeadError(f"no worker can take the request: {error}") from None
        decode = decision.decode
        body = {"request_id": request_id, "prompt_ids": list(prompt_ids),
                "params": params_to_json(params), "cache_salt": cache_salt,
                "prefill_url": decision.prefill.url if decision.prefill else None}
        arrival, first = time.perf_counter(), None
        try:
            async with self._http().stream("POST", f"{decode.url}/pd/generate", json=body) as r:
                if r.status_code != 200:
                    message = (await r.aread()).decode(errors="replace")[:500]
                    if r.status_code == 400:
                        raise InvalidRequestError(_message(message))
                    raise EngineDeadError(f"decode worker {decode.name}: {_message(message)}")
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    item = json.loads(line)
                    if "error" in item:
                        if item["error"].get("code") == "kv_handoff_failed" and decision.prefill:
                            # Passive health: stop routing to the prefill worker until a poll
                            # of its (possibly restarted) process says it is up again.
                            self.router.mark_down(decision.prefill.name)
                        raise EngineDeadError(item["error"]["message"])
                    out = output_from_json(item["output"])
                    now = time.perf_counter()
                    first = first or (now if out.token_ids else None)
                    out = attrs.evolve(out, arrival_time=arrival, first_token_time=first,
                                       finish_time=now if out.finished else None)
                    yield out
                    if out.finished:
                        return
        except httpx.TransportError as error:
            self.router.mark_down(decode.name)
            raise EngineDeadError(f"decode worker {decode.name} failed mid-request "
                                  f"({type(error).__name__}); retry the request") from None
        raise EngineDeadError(f"decode worker {decode.name} ended the stream early")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text


class _Forward:
    """Collector that yields another registry's metrics (router metrics on the app's /metrics)."""

    def __init__(self, registry) -> None:  # noqa: ANN001
        self.registry = registry

    def collect(self):  # noqa: ANN201
        yield from self.registry.collect()


def build_router_app(remote: RemoteEngine, *, model_name: str, aliases: set[str] | None = None,
                     api_key: str | None = None) -> FastAPI:
    """The OpenAI app over the cluster, plus ``GET /pd/workers``."""
    from kthena_serve.server import build_app

    app = build_app(remote, model_name=model_name, aliases=aliases, api_key=api_key)  # type: ignore[arg-type]
    app.state.api.metrics.registry.register(_Forward(remote.router.metrics.registry))

    @app.get("/pd/workers")
    async def workers() -> dict:
        return {name: {"role": w.role, "url": w.url, "up": w.is_up, "load": w.load,
                       "kv_usage": w.kv_usage}
                for name, w in remote.router.workers.items()}

    return app
