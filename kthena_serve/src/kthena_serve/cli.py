"""``kthena serve`` and ``kthena bench serve``: registered on kthena_core's CLI by entry points.

This is the one place in kthena_serve that reads argv and the environment
(``KTHENA_API_KEY``; ``OMP_WAIT_POLICY`` is set here before torch is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

__all__ = ["register_bench", "register_serve"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct) or a Hugging Face checkpoint folder")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="tokens computed per step (prefill chunks + decodes)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size, e.g. 512MiB, 2GiB")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one core each)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn prefix reuse off")


def _engine_config(args: argparse.Namespace):  # noqa: ANN202
    from kthena_serve.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_model_len=args.max_model_len, tp=args.tp,
                        enable_prefix_caching=not args.no_prefix_caching)


def _prepare_process() -> None:
    """OpenMP reads its wait policy once, when torch loads: set it first (see threads.py)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ---- kthena serve -------------------------------------------------------------------------------
def register_serve(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kthena.commands``): add ``kthena serve``."""
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    _engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("KTHENA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default $KTHENA_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--mode", default="colocated", choices=("colocated", "pd"),
                        help="pd: separate prefill and decode worker processes behind a router")
    from kthena_serve.pd.serve import add_pd_args

    add_pd_args(parser)
    parser.set_defaults(func=_cmd_serve)


def curl_line(host: str, port: int, model_name: str, with_key: bool) -> str:
    """A chat request that works against the server just started."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    body = {"model": model_name, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}
    auth = ' -H "Authorization: Bearer $KTHENA_API_KEY"' if with_key else ""
    return (f"curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json'"
            f"{auth} -d {shlex.quote(json.dumps(body))}")


def _cmd_serve(args: argparse.Namespace) -> int:
    _prepare_process()
    if getattr(args, "mode", "colocated") == "pd":
        from kthena_serve.pd.serve import engine_fields, run_pd

        return run_pd(args, engine_fields(args), args.served_model_name or _model_name(args.model))
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.server import build_app, run_server

    config = _engine_config(args)
    name = args.served_model_name or _model_name(args.model)
    print(f"kthena serve: loading {args.model} ...", file=sys.stderr, flush=True)
    engine = AsyncLLM.from_config(config).start()
    app = build_app(engine, model_name=name, aliases={args.model, "default"} - {name},
                    api_key=args.api_key)

    def ready(port: int) -> None:
        print(f"kthena serve: {name} on http://{args.host}:{port} "
              f"(max_model_len={engine.engine.max_model_len}, "
              f"kv blocks={engine.engine.kv.num_blocks}). Try:", flush=True)
        print(curl_line(args.host, port, name, bool(args.api_key)), flush=True)

    try:
        run_server(app, host=args.host, port=args.port, on_ready=ready)
    finally:
        engine.shutdown()
    return 0


def _model_name(model: str) -> str:
    if model == "default":
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)) or model


# ---- kthena bench serve -------------------------------------------------------------------------
def register_bench(subparsers: argparse._SubParsersAction) -> None:
    """Entry point: add ``kthena bench serve`` (sharing ``kthena bench`` with other layers)."""
    bench = subparsers.choices.get("bench") or subparsers.add_parser(
        "bench", help="benchmarks (JSON on stdout)")
    children = next((a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None)
    if children is None:
        children = bench.add_subparsers(dest="bench_command", required=True)
    parser = children.add_parser("serve", help="engine throughput, latency and prefix reuse "
                                 "vs Hugging Face transformers; writes a PNG plot")
    _engine_args(parser)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--cases", default="a,b,c", help="subset of a,b,c")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--plot", default="bench_serve.png", help="PNG path ('' for none)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    parser.set_defaults(func=_cmd_bench_serve)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    _prepare_process()
    from kthena_serve.bench import BenchOptions, run_bench

    options = BenchOptions(runs=args.runs, cases=tuple(c.strip() for c in args.cases.split(",")),
                           hf_baseline=not args.no_hf, plot=args.plot or None,
                           num_threads=args.threads)
    result = run_bench(_engine_config(args), options)
    print(json.dumps(result))
    return 0
