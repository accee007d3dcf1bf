"""The engine flags ``kthena serve`` and ``python -m kthena_serve.pd.serve`` share, and the
lines they print; one home so the colocated and PD entry points cannot drift apart."""

from __future__ import annotations

import argparse
import json
import os
import shlex

__all__ = ["DEFAULT_MODEL_NAME", "SHUTDOWN_MESSAGE", "add_engine_args", "add_kv_events_args",
           "add_public_metrics_arg", "curl_line", "engine_config", "kv_events_config",
           "model_name"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHUTDOWN_MESSAGE = ("the server shut down before this request finished; retry it on another "
                    "replica")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every ``EngineConfig`` knob a user sets from the command line."""
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct) or a Hugging Face checkpoint folder")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="tokens computed per step (prefill chunks + decodes)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size, e.g. 512MiB, 2GiB")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV pool dtype: 'auto' (= --dtype) or 'int8' (int8 K/V with a "
                             "float32 scale per token per KV head: ~1.9x the blocks of bf16 in "
                             "the same --kv-cache-memory; the model still computes in --dtype)")
    parser.add_argument("--quantization", default=None, choices=("int8",),
                        help="int8: weight-only int8 matmul weights (one scale per output "
                             "channel; decode reads half bf16's bytes); default: --dtype")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda[:N] or npu[:N] (only cpu is verified on hardware)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one core each)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel stages (layers split into PP stages, each of "
                             "--tp ranks; tp x pp processes)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn prefix reuse off")
    parser.add_argument("--prefix-index", default="hash", choices=("hash", "radix"),
                        help="prefix index of the KV manager: hash chain or radix tree")
    parser.add_argument("--hash-algorithm", default="xxh3_128", choices=("xxh3_128", "sha256"),
                        help="block-hash digest (one per deployment)")
    parser.add_argument("--kv-offload", default=None,
                        metavar="host=SIZE[,store=mooncake@HOST:PORT]",
                        help="tiers below the KV pool: committed blocks are copied to host "
                             "memory in the background and promoted back on a prefix hit "
                             "instead of recomputed; blocks the host tier pushes out go to the "
                             "Mooncake Store of that mooncake_master (shared by every engine "
                             "pointed at it); write=through sends every block to the store at "
                             "once. Also segment=SIZE (RAM lent to the store, default "
                             "64MiB), queue=N (offload queue bound, default 256), "
                             "timeout=SECONDS (a promotion's wait, default 5); "
                             "see docs/kthena_serve.md")
    parser.add_argument("--chat-special-tokens", default="text", choices=("text", "control"),
                        help="special tokens typed in chat content: text (no forged turns, "
                             "default) or control tokens")


def add_public_metrics_arg(parser: argparse.ArgumentParser, credential: str) -> None:
    """``--public-metrics`` (``kthena serve``, the PD router, PD workers): /metrics without
    ``credential``, as vLLM's --api-key guards only /v1; everything else still needs it."""
    parser.add_argument("--public-metrics", action="store_true",
                        help=f"serve GET /metrics without {credential} (the Kthena router and "
                             "Prometheus scrape without credentials; it shows totals only, see "
                             "docs/security.md); every other route still needs it")


_FLAGS = {"enable_prefix_caching": "--no-prefix-caching"}  # where the flag is not --<field>


def engine_config(args: argparse.Namespace):  # noqa: ANN201
    """The ``EngineConfig`` the flags describe.

    Raises:
        ValueError: a flag's value is refused; the message starts with the flag, then says
            what the config field takes (``--dtype: EngineConfig.dtype must be ...``).
    """
    from kthena_serve.config import ConfigError, EngineConfig

    try:
        return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                            max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                            max_model_len=args.max_model_len, tp=args.tp,
                            pp=getattr(args, "pp", 1),
                            num_kv_blocks=getattr(args, "num_kv_blocks", None),
                            enable_prefix_caching=not args.no_prefix_caching,
                            prefix_index=args.prefix_index, hash_algorithm=args.hash_algorithm,
                            kv_cache_dtype=args.kv_cache_dtype,
                            quantization=getattr(args, "quantization", None),
                            kv_offload=_kv_offload_arg(args),
                            chat_special_tokens=args.chat_special_tokens)
    except ConfigError as error:
        flag = _FLAGS.get(error.field, "--" + error.field.replace("_", "-"))
        raise ValueError(f"{flag}: {error}") from None


def _kv_offload_arg(args: argparse.Namespace) -> str | None:
    value = getattr(args, "kv_offload", None)
    if value is not None and getattr(args, "mode", "colocated") == "pd":
        raise ValueError("--kv-offload: not supported with --mode pd yet (prefill workers "
                         "write into the decode workers' pools); run it colocated or with --dp")
    return value


def curl_line(host: str, port: int, model_name: str, with_key: bool) -> str:
    """A chat request that works against the server just started."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    body = {"model": model_name, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}
    auth = ' -H "Authorization: Bearer $KTHENA_API_KEY"' if with_key else ""
    return (f"curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json'"
            f"{auth} -d {shlex.quote(json.dumps(body))}")


def model_name(model: str) -> str:
    """The id clients send for ``--model`` (the folder name, or SmolLM2's for the default)."""
    if model == "default":
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)) or model


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    """The flags of KV-cache-aware routing data for the Kthena router (docs/kv_events.md)."""
    parser.add_argument("--kv-events", default=None, metavar="redis://HOST:PORT",
                        help="publish the KV cache's router chunks to this Redis (the Kthena "
                             "router's kvcache-aware plugin reads it); needs --pod-name")
    parser.add_argument("--pod-name", default=None, metavar="NAME.NAMESPACE",
                        help="this server's owner name in those keys: its pod's name and "
                             "namespace, as the router names candidate pods")
    parser.add_argument("--kv-events-chunk-size", type=int, default=16,
                        help="tokens per router chunk (the plugin's blockSizeToHash)")
    parser.add_argument("--kv-events-max-chunks", type=int, default=128,
                        help="leading chunks the router matches (the plugin's maxBlocksToMatch)")


_KV_EVENTS_FLAGS = {"redis_url": "--kv-events", "pod": "--pod-name",
                    "chunk_size": "--kv-events-chunk-size",
                    "max_chunks": "--kv-events-max-chunks", "model": "--served-model-name"}


def kv_events_config(args: argparse.Namespace, served_model: str):  # noqa: ANN201
    """The ``KVEventsConfig`` the flags describe, or None without ``--kv-events``.

    Raises:
        ValueError: a refused value or combination; the message starts with the flag.
    """
    from kthena_serve.kv_events.config import KVEventsConfig, KVEventsConfigError

    if args.kv_events is None:
        for flag, value, default in (("--pod-name", args.pod_name, None),
                                     ("--kv-events-chunk-size", args.kv_events_chunk_size, 16),
                                     ("--kv-events-max-chunks", args.kv_events_max_chunks, 128)):
            if value != default:
                raise ValueError(f"{flag} takes effect only with --kv-events redis://HOST:PORT")
        return None
    if args.pod_name is None:
        raise ValueError("--kv-events: needs --pod-name NAME.NAMESPACE, the owner name the "
                         "router looks for")
    if getattr(args, "mode", "colocated") == "pd":
        raise ValueError("--kv-events: not supported with --mode pd (the decode workers of one "
                         "pod would share one owner name); run it colocated")
    if getattr(args, "no_prefix_caching", False):
        raise ValueError("--kv-events: nothing is cached with --no-prefix-caching, so there "
                         "is nothing to announce; drop one of them")
    try:
        return KVEventsConfig(redis_url=args.kv_events, pod=args.pod_name, model=served_model,
                              chunk_size=args.kv_events_chunk_size,
                              max_chunks=args.kv_events_max_chunks)
    except KVEventsConfigError as error:
        raise ValueError(f"{_KV_EVENTS_FLAGS[error.field]}: {error}") from None
