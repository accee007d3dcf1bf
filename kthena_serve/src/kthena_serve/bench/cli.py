"""``kthena bench serve``, ``soak``, ``layouts``, ``kv`` and ``trace``: registered on
kthena_core's CLI by an entry point (group ``kthena.commands``, ``bench-serve``).

Reads argv and ``KTHENA_API_KEY`` (``soak --url``); ``OMP_WAIT_POLICY`` is decided by
``kthena_serve.deployment.prepare_process`` before torch is imported, as for ``kthena serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from kthena_serve.bench.optional import is_available, note_missing, plot_or_note
from kthena_serve.deployment import prepare_process
from kthena_serve.serve_args import add_engine_args
from kthena_serve.spec import engine_config

if TYPE_CHECKING:
    from kthena_serve.bench.peer import Peer

__all__ = ["register_bench"]


# ---- kthena bench serve -------------------------------------------------------------------------
def register_bench(subparsers: argparse._SubParsersAction) -> None:
    """Entry point: add ``kthena bench serve``, ``soak``, ``layouts``, ``kv`` and ``trace``
    (sharing ``kthena bench`` with other layers)."""
    bench = subparsers.choices.get("bench") or subparsers.add_parser(
        "bench", help="benchmarks (JSON on stdout)")
    children = next((a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None)
    if children is None:
        children = bench.add_subparsers(dest="bench_command", required=True)
    parser = children.add_parser("serve", help="engine throughput, latency and prefix reuse "
                                 "vs transformers (and --peer vllm) and the machine's limits; "
                                 "writes a PNG plot", argument_default=argparse.SUPPRESS)
    add_engine_args(parser)  # no defaults: a flag not given takes EngineConfig's
    parser.add_argument("--runs", "--repeats", dest="runs", type=int, default=3,
                        help="timed runs per case (median; default 3)")
    parser.add_argument("--peer", default=None, metavar="vllm[=PYTHON]|llama.cpp[=FOLDER]",
                        help="also run the workloads through vLLM's CPU build, from the venv of "
                        "benchmarks/peers/build_vllm_venv.py (or PYTHON), or through "
                        "llama.cpp's llama-server on the model's GGUF, built by "
                        "benchmarks/peers/build_llama_cpp.sh (or in FOLDER/bin) (default: none)")
    parser.add_argument("--peer-quant", default=None, metavar="shipped|Q8_0|F16",
                        help="with --peer llama.cpp: the GGUF as shipped, or re-quantised once "
                        "to Q8_0 or F16 with llama-quantize (default: shipped)")
    parser.add_argument("--cases", default="a,b,c", help="subset of a,b,c (default a,b,c)")
    parser.add_argument("--no-hf", action="store_true", default=False,
                        help="skip the transformers baseline (default: off; without "
                             "transformers installed it is skipped with a note)")
    parser.add_argument("--plot", default="bench_serve.png",
                        help="PNG path, '' for none (default bench_serve.png; skipped with a "
                             "note when matplotlib is not installed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    parser.add_argument("--no-collectives", action="store_true", default=False,
                        help="skip timing the TP collectives over two ranks (all-reduce, "
                             "reduce-scatter, all-gather: the calibration's "
                             "sp_collective_factor) (default: off, they are timed where there "
                             "are two cores)")
    parser.set_defaults(func=_cmd_bench_serve)
    _register_soak(children)
    from kthena_serve.bench.layouts import add_parser as add_layouts_parser

    add_layouts_parser(children)  # kthena bench layouts
    from kthena_serve.bench.sp_prompts import add_sp_arguments

    add_sp_arguments(children.choices["layouts"])  # kthena bench layouts --sp-prompts
    from kthena_serve.bench.kv import add_parser as add_kv_parser

    add_kv_parser(children)  # kthena bench kv
    from kthena_serve.bench.trace import add_parser as add_trace_parser

    add_trace_parser(children)  # kthena bench trace
    from kthena_serve.bench.tp_overlap import add_parser as add_tp_overlap_parser

    add_tp_overlap_parser(children)  # kthena bench tp-overlap
    from kthena_serve.bench.moe import add_parser as add_moe_parser

    add_moe_parser(children)  # kthena bench moe


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    prepare_process()
    from kthena_serve.bench.peer import PeerRunError
    from kthena_serve.bench.serve import BenchOptions, run_bench

    try:
        config = engine_config(vars(args))
        peer = _peer(args.peer, args.peer_quant, config.model)
        if peer is not None:
            peer.check()  # before minutes of our own workloads
        options = BenchOptions(runs=args.runs, cases=tuple(c.strip() for c in
                                                           args.cases.split(",")),
                               hf_baseline=_hf_baseline(args.no_hf),
                               plot=plot_or_note("kthena bench serve", args.plot),
                               num_threads=args.threads, peer=peer,
                               collectives=not args.no_collectives)
    except (ValueError, FileNotFoundError) as error:
        print(f"kthena bench serve: {error}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(run_bench(config, options)))
    except PeerRunError as error:
        print(f"kthena bench serve: {error}", file=sys.stderr)
        return 1
    return 0


def _peer(text: str | None, quant: str | None, model: str) -> Peer | None:
    """The ``--peer`` system (not yet checked to exist), with ``--peer-quant`` for llama.cpp.

    Raises:
        ValueError: an unknown peer, a bad path or quant, ``--peer-quant`` without llama.cpp.
    """
    from kthena_serve.bench.llama_cpp import NAME, parse_llama_cpp
    from kthena_serve.bench.peer import PEERS, parse_peer

    name = (text or "").partition("=")[0]
    if name == NAME:
        return parse_llama_cpp(text, quant or "shipped", model)
    if quant is not None:
        raise ValueError(f"--peer-quant {quant}: only with --peer {NAME} (the GGUF it serves)")
    if text is None:
        return None
    if name not in PEERS:
        raise ValueError(f"--peer {text!r}: unknown peer {name!r}; choose from "
                         f"{', '.join(sorted(PEERS))} (optionally =/path/to/its/python) or "
                         f"{NAME} (optionally =/path/to/its/build/folder)")
    return parse_peer(text)


def _hf_baseline(no_hf: bool) -> bool:
    """Whether the transformers baseline runs: asked for and installed (else one line says it
    is skipped, as with --no-hf)."""
    if no_hf:
        return False
    if is_available("transformers"):
        return True
    note_missing("kthena bench serve", "transformers",
                 "running without the transformers baseline (as with --no-hf)")
    return False


# ---- kthena bench soak --------------------------------------------------------------------------
def _register_soak(children: argparse._SubParsersAction) -> None:
    parser = children.add_parser("soak", help="N streaming clients (good, disconnecting, bad) "
                                 "for T minutes: errors, TTFT/ITL, server RSS, KV after")
    parser.add_argument("--mode", default="colocated", choices=("colocated", "pd"),
                        help="the server to start (pd: 1 prefill + 1 decode worker); with "
                             "--url, only a label")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="how long clients start new requests (in-flight ones then finish); "
                             "0 with --overload: only the overload phase")
    parser.add_argument("--seed", type=int, default=0, help="client i draws from seed + i")
    parser.add_argument("--url", default=None,
                        help="attach to this loopback server instead of starting one "
                             "(sends $KTHENA_API_KEY if set)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: the process whose tree's RSS is sampled")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of the server")
    parser.add_argument("--model", default="default", help="model of the server it starts")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds one request may take, headers to [DONE]")
    parser.add_argument("--dp", type=int, default=1,
                        help="replicas of the colocated server it starts (kthena serve --dp)")
    parser.add_argument("--max-queue-delay", type=float, default=None, metavar="SECONDS",
                        help="the server's --max-queue-delay (default: its own; 0: off)")
    parser.add_argument("--overload", type=float, nargs="?", const=4.0, default=None,
                        metavar="FACTOR",
                        help="after the mixed phase, calibrate the sustainable rate with "
                             "--clients closed-loop streams, then offer FACTOR (default 4) "
                             "times it open-loop: accepted TTFT vs the bound, 503 latency")
    parser.add_argument("--overload-minutes", type=float, default=2.0,
                        help="how long the overload phase offers its load")
    parser.add_argument("--calibration-seconds", type=float, default=60.0,
                        help="how long the overload phase's calibration runs")
    parser.set_defaults(func=_cmd_bench_soak)


def _cmd_bench_soak(args: argparse.Namespace) -> int:
    """Prints the JSON line; exit status 1 if the run saw any error, 2 if it could not run."""
    from kthena_serve.bench.overload import soak_phase
    from kthena_serve.bench.soak import SoakOptions, run_soak

    try:
        options = SoakOptions(mode=args.mode, clients=args.clients, minutes=args.minutes,
                              seed=args.seed, url=args.url, server_pid=args.server_pid,
                              kv_cache_memory=args.kv_cache_memory, model=args.model,
                              request_timeout_s=args.request_timeout, dp=args.dp,
                              max_queue_delay=args.max_queue_delay, overload=args.overload,
                              overload_minutes=args.overload_minutes,
                              calibration_s=args.calibration_seconds,
                              api_key=os.environ.get("KTHENA_API_KEY") if args.url else None)
        result = run_soak(options, overload_phase=soak_phase)
    except (ValueError, RuntimeError) as error:
        print(f"kthena bench soak: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    overload_errors = (result.get("overload") or {}).get("num_errors", 0)
    return 1 if result["num_errors"] or overload_errors else 0
