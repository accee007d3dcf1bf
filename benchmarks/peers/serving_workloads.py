"""Issue 52's three serving workloads against ``kthena serve`` or ``llama-server``, one JSON line.

Usage (the project's venv; for llama.cpp, after ``bash benchmarks/peers/build_llama_cpp.sh``)::

    .venv/bin/python benchmarks/peers/serving_workloads.py --system kthena [--quantization gguf]
    .venv/bin/python benchmarks/peers/serving_workloads.py --system llama.cpp --peer-quant Q8_0
    .venv/bin/python benchmarks/peers/serving_workloads.py --compare --rounds 3 [--json F]
    .venv/bin/python benchmarks/peers/serving_workloads.py --variant process= \
        --variant thread=--no-engine-process --rounds 6 [--workloads batch1_128_128] [--json F]

``--compare`` is one run of every pair (``--pairs``, default ours bf16 against llama.cpp F16,
int8 against Q8_0, the GGUF's blocks as stored against the shipped Q4_1): in each round each
pair's two servers run back to back, ours first in odd rounds and llama.cpp first in even ones,
so a neighbour's load lands on both. ``--variant NAME=FLAGS`` (two or more) compares our own
server with different flags instead: all of them are started at once and each workload runs on
each in turn, the order reversed every round. It starts with the model-alone decode bench
(``kthena_serve.bench.gguf_decode``: each weight form's batch-1 step against the bandwidth
floor) and prints one JSON object: every run, each system's medians over the rounds, and the
ratios of those medians (ours over llama.cpp, higher is better).

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
import contextlib
import http.client
import json
import os
import random
import statistics
import subprocess
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
# --compare's default pairs: (ours: --quantization or bf16, llama.cpp's --peer-quant)
PAIRS = (("bf16", "F16"), ("int8", "Q8_0"), ("gguf", "shipped"))
OURS = ("bf16", "int8", "gguf")
# the figure each workload is judged by, and whether lower is better (a time)
JUDGED = {"batch1_128_128": ("tpot_p50_ms", True), "c32_64x128_64": ("output_tok_s", False),
          "c4_16x1024_16": ("ttft_p50_ms", True)}


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


def server_argv(system: str, model: str, quant: str, port: int) -> tuple[list[str], dict]:
    """The server command and environment: ours with ``quant`` (bf16, int8 or gguf), or
    llama-server on the GGUF re-quantised to ``quant`` (shipped, Q8_0 or F16)."""
    if system == "kthena":
        return ([sys.executable, "-m", "kthena_core.cli", "serve", "--model", model,
                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
                 "--max-queue-delay", "0",
                 *(["--quantization", quant] if quant != "bf16" else [])],
                {**user_environ(), "PYTHONUNBUFFERED": "1"})
    peer = LlamaCppPeer(gguf=source_gguf(model), quant=quant)
    peer.check()
    gguf = quantized_gguf(peer)
    return (server_command(peer.server, gguf, port, len(owned_cores()), 32, MODEL_NAME),
            user_environ())


def run_system(system: str, model: str, quant: str, seed: int = 0) -> dict:
    """Start one server, run the three workloads against it, stop it: its figures."""
    rng = random.Random(seed)
    port = free_port()
    server, env = server_argv(system, model, quant, port)
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="kthena-workloads-") as tmp, \
            ServerChild(f"{system} server", server, env, Path(tmp) / "server.log",
                        who="serving_workloads") as child:
        base = f"http://127.0.0.1:{port}"
        ready_s = wait_ready(child, base, 900.0)
        warm_up(child, base, MODEL_NAME)
        figures = {name: run_workload(port, name, rng) for name in WORKLOADS}
        kernels = kernels_info(port) if system == "kthena" else None
    return {"system": system, "quant": quant, "workloads": figures, "server_command": server,
            "server_ready_s": round(ready_s, 1), "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            **({"kernels": kernels} if kernels is not None else {})}


def kernels_info(port: int) -> dict[str, str]:
    """Our server's kernel choices (``kthena_kernels_info``'s labels on /metrics: the matmuls,
    attention and the decode step, each chosen at start-up, by timing under ``auto``)."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode("utf-8", errors="replace")
    finally:
        conn.close()
    return next((dict(sample.labels) for family in text_string_to_metric_families(text)
                 if family.name == "kthena_kernels_info" for sample in family.samples), {})


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``bf16:F16,int8:Q8_0`` -> [("bf16", "F16"), ("int8", "Q8_0")], checked.

    Raises:
        ValueError: an entry that is not OURS:THEIRS, or a name neither side has.
    """
    pairs = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        ours, sep, theirs = entry.partition(":")
        if not sep or ours not in OURS or theirs not in QUANTS:
            raise ValueError(f"--pairs entry {entry!r}: want OURS:THEIRS with OURS one of "
                             f"{', '.join(OURS)} and THEIRS one of {', '.join(QUANTS)}")
        pairs.append((ours, theirs))
    if not pairs:
        raise ValueError("--pairs is empty; give at least one OURS:THEIRS")
    return pairs


def summarize(runs: list[dict], pairs: list[tuple[str, str]]) -> dict:
    """Each system's median of each judged figure over its runs, and per pair the ratio of
    the medians, ours over llama.cpp's with higher better (a time: theirs over ours)."""
    medians: dict[str, dict[str, float]] = {}
    for system, quant in {(r["system"], r["quant"]) for r in runs}:
        mine = [r for r in runs if (r["system"], r["quant"]) == (system, quant)]
        medians[f"{system}:{quant}"] = {
            workload: round(statistics.median(r["workloads"][workload][key] for r in mine), 2)
            for workload, (key, _) in JUDGED.items()}
    ratios = {}
    for ours, theirs in pairs:
        a, b = medians.get(f"kthena:{ours}"), medians.get(f"llama.cpp:{theirs}")
        if a is None or b is None:
            continue
        ratios[f"{ours}:{theirs}"] = {
            workload: round(b[workload] / a[workload] if lower else a[workload] / b[workload], 2)
            for workload, (_, lower) in JUDGED.items()}
    return {"medians": medians, "ratios": ratios,
            "judged_by": {w: key for w, (key, _) in JUDGED.items()}}


def decode_floor(model: str, ours: list[str]) -> list[dict]:
    """The model-alone batch-1 decode bench (`kthena_serve.bench.gguf_decode`) for ``ours``'
    weight forms (its candidates of the same names): its JSON rows (each with
    ``floor_fraction``), in a child process."""
    names = ",".join(ours)
    done = subprocess.run([sys.executable, "-m", "kthena_serve.bench.gguf_decode", "--model",
                           model, "--candidates", names, "--threads", str(len(owned_cores()))],
                          env=user_environ(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gguf_decode failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def compare(model: str, pairs: list[tuple[str, str]], rounds: int) -> dict:
    """--compare: the decode bench, then ``rounds`` rounds of every pair, alternating which
    system of a pair goes first."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    floor = decode_floor(model, [ours for ours, _ in pairs])
    runs = []
    for round_ in range(1, rounds + 1):
        for ours, theirs in pairs:
            order = [("kthena", ours), ("llama.cpp", theirs)]
            for system, quant in order if round_ % 2 else order[::-1]:
                run = run_system(system, model, quant)
                runs.append({"round": round_, **run})
                print(f"serving_workloads: round {round_} {system} {quant}: "
                      + ", ".join(f"{w} {run['workloads'][w][k]}" for w, (k, _) in
                                  JUDGED.items()), file=sys.stderr, flush=True)
    return {"bench": "serving_workloads_compare", "started": started, "rounds": rounds,
            "pairs": [f"{a}:{b}" for a, b in pairs], **summarize(runs, pairs),
            "decode_floor": floor, "runs": runs, "machine": machine()}


def parse_variants(entries: list[str]) -> dict[str, list[str]]:
    """``["a=", "b=--no-engine-process --kernels native"]`` -> {name: extra flags}, checked.

    Raises:
        ValueError: fewer than two, an entry without ``=``, or a name given twice.
    """
    variants: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, flags = entry.partition("=")
        if not sep or not name or name in variants:
            raise ValueError(f"--variant {entry!r}: want NAME=FLAGS (FLAGS may be empty), each "
                             "NAME once")
        variants[name] = flags.split()
    if len(variants) < 2:
        raise ValueError(f"--variant: give at least two to compare, got {len(variants)}")
    return variants


def side_by_side(model: str, quant: str, variants: dict[str, list[str]], rounds: int,
                 workloads: list[str]) -> dict:
    """--variant: our server once per variant, all started together; every round runs each
    workload on each variant in turn (reversed in even rounds), then each variant's medians."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kthena-workloads-") as tmp, \
            contextlib.ExitStack() as stack:
        ports = {}
        for name, flags in variants.items():
            port = free_port()
            server, env = server_argv("kthena", model, quant, port)
            child = stack.enter_context(ServerChild(f"{name} server", server + flags, env,
                                                    Path(tmp) / f"{name}.log",
                                                    who="serving_workloads"))
            wait_ready(child, f"http://127.0.0.1:{port}", 900.0)
            warm_up(child, f"http://127.0.0.1:{port}", MODEL_NAME)
            ports[name] = port
        for round_ in range(1, rounds + 1):
            names = list(variants) if round_ % 2 else list(variants)[::-1]
            for workload in workloads:
                for name in names:
                    figures = run_workload(ports[name], workload, random.Random(round_))
                    runs.append({"round": round_, "variant": name, "workload": workload,
                                 **figures})
    medians = {name: {w: round(statistics.median(r[JUDGED[w][0]] for r in runs
                                                   if r["variant"] == name
                                                   and r["workload"] == w), 2)
                      for w in workloads} for name in variants}
    return {"bench": "serving_workloads_side_by_side", "started": started, "quant": quant,
            "rounds": rounds, "variants": {n: " ".join(f) for n, f in variants.items()},
            "medians": medians, "judged_by": {w: JUDGED[w][0] for w in workloads},
            "runs": runs, "machine": machine()}


def machine() -> dict:
    return {"cpu": cpu_model(), "cpu_isa": cpu_isa(), "cores": len(owned_cores()),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("kthena", "llama.cpp"))
    parser.add_argument("--peer-quant", choices=QUANTS, default="shipped")
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", choices=("gguf", "int8"), default=None,
                        help="kthena's weights: the GGUF file's blocks as stored, or int8 "
                             "(default: bf16)")
    parser.add_argument("--compare", action="store_true",
                        help="every pair of --pairs, ours and llama.cpp interleaved, --rounds "
                             "times, after the model-alone decode bench")
    parser.add_argument("--pairs", default=",".join(f"{a}:{b}" for a, b in PAIRS),
                        help="--compare's OURS:THEIRS pairs (default: %(default)s)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="our server with these extra flags (two or more): started "
                             "together, the workloads alternating between them")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="--variant's workloads (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="--compare: also write the JSON here")
    args = parser.parse_args(argv)
    if args.variant:
        if args.compare or args.system:
            parser.error("--variant compares our server with itself; leave out --system and "
                         "--compare")
        workloads = [w for w in args.workloads.split(",") if w]
        unknown = [w for w in workloads if w not in WORKLOADS]
        if unknown or not workloads or args.rounds < 1:
            parser.error(f"--workloads takes {', '.join(WORKLOADS)} (got {args.workloads!r}); "
                         f"--rounds at least 1 (got {args.rounds})")
        try:
            variants = parse_variants(args.variant)
        except ValueError as error:
            parser.error(str(error))
        result = side_by_side(args.model, args.quantization or "bf16", variants, args.rounds,
                              workloads)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(result))
        return 0
    if args.compare == (args.system is not None):
        parser.error("give either --system (one server) or --compare (every pair)")
    if args.quantization and args.system != "kthena" and not args.variant:
        parser.error("--quantization is kthena's; llama.cpp takes --peer-quant")
    if args.compare:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        try:
            pairs = parse_pairs(args.pairs)
        except ValueError as error:
            parser.error(str(error))
        result = compare(args.model, pairs, args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(result))
        return 0
    quant = (args.quantization or "bf16") if args.system == "kthena" else args.peer_quant
    run = run_system(args.system, args.model, quant)
    print(json.dumps({"system": run["system"], "quant": run["quant"],
                      "workloads": run["workloads"], "server_command": run["server_command"],
                      "server_ready_s": run["server_ready_s"],
                      "machine": {"cpu": cpu_model(), "cpu_isa": cpu_isa(),
                                  "cores": len(owned_cores()),
                                  "loadavg_before": run["loadavg_before"],
                                  "loadavg_after": run["loadavg_after"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
