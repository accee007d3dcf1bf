"""KV events for the Kthena router: which router chunks this server's KV cache holds, in Redis.

``kthena serve --kv-events redis://HOST:PORT --pod-name NAME.NAMESPACE`` starts a
``RedisKVPublisher`` over the engine's KV manager: ``router_hash`` is the router's chunk hash
and key, ``chunks`` maps our blocks to its chunks, ``publisher`` writes them (see
docs/kv_events.md). redis-py is optional (``pip install 'kthena-serve[kv-events]'``) and is
imported only when a publisher is built.
"""

from kthena_serve.kv_events.chunks import RouterChunks
from kthena_serve.kv_events.config import KVEventsConfig, KVEventsConfigError
from kthena_serve.kv_events.metrics import KVEventsCollector
from kthena_serve.kv_events.publisher import KVEventSource, KVEventsStats, RedisKVPublisher
from kthena_serve.kv_events.router_hash import (
    KEY_PREFIX,
    ChunkHash,
    chunk_hash,
    prompt_chunk_hashes,
    redis_key,
)

__all__ = [
    "KEY_PREFIX",
    "ChunkHash",
    "KVEventSource",
    "KVEventsCollector",
    "KVEventsConfig",
    "KVEventsConfigError",
    "KVEventsStats",
    "RedisKVPublisher",
    "RouterChunks",
    "chunk_hash",
    "prompt_chunk_hashes",
    "redis_key",
]
