"""Issue 52's three serving workloads against ``kthena serve`` or ``llama-server``, one JSON line.

Usage (the project's venv; for llama.cpp, after ``bash benchmarks/peers/build_llama_cpp.sh``)::

    .venv/bin/python benchmarks/peers/serving_workloads.py --system kthena [--quantization gguf]
    .venv/bin/python benchmarks/peers/serving_workloads.py --system llama.cpp --peer-quant Q8_0

    (1) batch 1: 4 requests x (128 prompt, 128 output) tokens, one at a time   -> TPOT p50
    (2) 64 requests x (128 prompt, 64 output), 32 in flight                     -> output tok/s
    (3) 16 requests x (1024 prompt, 16 output), 4 in flight                     -> TTFT p50

The server (the default model: ours converted to bf16, llama.cpp's the GGUF as shipped or
re-quantised) listens on 127.0.0.1 and is stopped, with its whole process group, on success,
error or Ctrl-C. The client is the same for both: ``/v1/completions`` streamed, prompts as
fixed-seed random token ids, greedy, EOS ignored, ``stream_options.include_usage`` for the
output token count. TTFT is the first streamed chunk after the request was sent; TPOT is
(end − first chunk) ÷ (output tokens − 1). Every run starts once the cores are idle.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kthena_core.ports import free_port
from kthena_serve.bench.children import ServerChild, wait_ready, warm_up
from kthena_serve.bench.llama_cpp import (
    QUANTS,
    LlamaCppPeer,
    quantized_gguf,
    server_command,
    source_gguf,
)
from kthena_serve.bench.machine import cpu_isa, cpu_model, wait_until_idle
from kthena_serve.engine.threads import owned_cores, user_environ

# name -> (requests, prompt tokens, output tokens, in flight)
WORKLOADS = {"batch1_128_128": (4, 128, 128, 1), "c32_64x128_64": (64, 128, 64, 32),
             "c4_16x1024_16": (16, 1024, 16, 4)}
MODEL_NAME = "bench-model"


def one_request(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: seconds to the first chunk and to the end, output tokens."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first, tokens = None, None
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices") and first is None:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        end = time.perf_counter()
    finally:
        conn.close()
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"asked {max_tokens} tokens, got {tokens} (first chunk: {first})")
    return {"ttft_s": first - sent, "tpot_s": (end - first) / (tokens - 1), "tokens": tokens}


def run_workload(port: int, name: str, rng: random.Random) -> dict:
    count, prompt_len, out_len, in_flight = WORKLOADS[name]
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(count)]
    idle_s = wait_until_idle()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=in_flight)
    try:
        start = time.perf_counter()
        done = list(pool.map(lambda p: one_request(port, p, out_len), prompts))
        wall = time.perf_counter() - start
    finally:  # on Ctrl-C, return at once: stopping the server ends the requests in flight
        pool.shutdown(wait=False, cancel_futures=True)
    ms = lambda xs: round(statistics.median(xs) * 1000, 2)  # noqa: E731
    return {"ttft_p50_ms": ms([d["ttft_s"] for d in done]),
            "tpot_p50_ms": ms([d["tpot_s"] for d in done]),
            "output_tok_s": round(sum(d["tokens"] for d in done) / wall, 2),
            "wall_s": round(wall, 2), "idle_wait_s": round(idle_s, 1)}


def server_argv(args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    if args.system == "kthena":
        return ([sys.executable, "-m", "kthena_core.cli", "serve", "--model", args.model,
                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
                 "--max-queue-delay", "0",
                 *(["--quantization", args.quantization] if args.quantization else [])],
                {**user_environ(), "PYTHONUNBUFFERED": "1"})
    peer = LlamaCppPeer(gguf=source_gguf(args.model), quant=args.peer_quant)
    peer.check()
    gguf = quantized_gguf(peer)
    return (server_command(peer.server, gguf, port, len(owned_cores()), 32, MODEL_NAME),
            user_environ())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("kthena", "llama.cpp"), required=True)
    parser.add_argument("--peer-quant", choices=QUANTS, default="shipped")
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", choices=("gguf", "int8"), default=None,
                        help="kthena's weights: the GGUF file's blocks as stored, or int8 "
                             "(default: bf16)")
    args = parser.parse_args(argv)
    if args.quantization and args.system != "kthena":
        parser.error("--quantization is kthena's; llama.cpp takes --peer-quant")
    rng = random.Random(0)
    port = free_port()
    server, env = server_argv(args, port)
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="kthena-workloads-") as tmp, \
            ServerChild(f"{args.system} server", server, env, Path(tmp) / "server.log",
                        who="serving_workloads") as child:
        base = f"http://127.0.0.1:{port}"
        ready_s = wait_ready(child, base, 900.0)
        warm_up(child, base, MODEL_NAME)
        figures = {name: run_workload(port, name, rng) for name in WORKLOADS}
    print(json.dumps({"system": args.system, "quant": args.peer_quant if args.system != "kthena"
                      else args.quantization or "bf16", "workloads": figures,
                      "server_command": server,
                      "server_ready_s": round(ready_s, 1),
                      "machine": {"cpu": cpu_model(), "cpu_isa": cpu_isa(),
                                  "cores": len(owned_cores()), "loadavg_before": load_before,
                                  "loadavg_after": [round(x, 2) for x in os.getloadavg()]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
