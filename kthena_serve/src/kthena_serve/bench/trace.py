"""``kthena bench trace``: a window of a Mooncake trace replayed by vLLM's own client.

    trace.jsonl ──window, scale──▶ window.jsonl ──▶ vllm bench serve --dataset-name timed_trace
                                                          │ (same file, same client, in turn)
                                      ┌───────────────────┴───────────────────┐
                                      ▼                                       ▼
                          vllm serve CHECKPOINT (peer)          kthena serve --model CHECKPOINT
                       or llama-server --model GGUF (peer)

The window is cut and scaled by `kthena_serve.bench.trace_window` (the trace README's recipe)
and written in the trace's own format; ``vllm bench serve`` from the peer venv
(``benchmarks/peers/build_vllm_venv.py``, run through ``benchmarks/peers/vllm_cli.py``) replays
it at its own times, expanding each block id into the same token ids every time. With ``--peer
vllm`` it runs against ``vllm serve`` first and then against ``kthena serve`` on the same
checkpoint folder and cores, one server alive at a time; with ``--peer llama.cpp`` against
``llama-server`` (`kthena_serve.bench.llama_cpp`) on the GGUF the checkpoint is converted from,
first, the same way; without either, against ours alone (the client still comes from the peer
venv). Every process it starts has its own process group,
stopped when its replay ends, fails or is interrupted. The report is
`kthena_serve.bench.trace_report`'s.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import attrs

from kthena_core.ports import free_port
from kthena_serve.bench.children import ServerChild, wait_ready, warm_up
from kthena_serve.bench.llama_cpp import (
    LLAMA_DIR,
    NAME,
    LlamaCppPeer,
    quantized_gguf,
    server_command,
    source_gguf,
)
from kthena_serve.bench.machine import cpu_isa, cpu_model, wait_until_idle
from kthena_serve.bench.optional import is_available
from kthena_serve.bench.peer import (
    BUILD_SCRIPT,
    PEER_DIR,
    REPO_ROOT,
    PeerMissingError,
    kill_group,
)
from kthena_serve.bench.trace_report import (
    error_counts,
    markdown_table,
    ours_vs_peer,
    per_request,
    percentile_check,
    plot_cdfs,
    side_figures,
)
from kthena_serve.bench.trace_window import (
    TraceScaling,
    read_window,
    scale_window,
    window_stats,
    write_trace,
)

__all__ = ["DEFAULT_PEER_VENV", "TraceOptions", "add_parser", "client_command",
           "options_from_args", "peer_venv_tools", "run_trace"]

DEFAULT_PEER_VENV = PEER_DIR / ".venv-vllm"
VLLM_CLI = PEER_DIR / "vllm_cli.py"  # the venv's `vllm` command, mended for the CPU wheel
SERVER_START_TIMEOUT_S = 900.0
CLIENT_SLACK_S = 1800.0  # the client's time beyond the window's arrivals
TRACE_PEERS = ("vllm", NAME)
TRACE_SLOTS = 16  # llama-server's sequences at once; more requests wait in its queue
TRACE_SLOT_TOKENS = 4096  # KV per sequence (llama-server refuses a longer request): 1.5 GB f16
_RESERVED_FLAGS = ("--model", "--host", "--port", "--served-model-name")


# ---- the peer venv and the commands ------------------------------------------------------------
def peer_venv_tools(venv: Path) -> Path:
    """The peer venv's python, after checking that it and `VLLM_CLI` exist.

    Raises:
        PeerMissingError: no python there; the message names the build script.
    """
    python = venv / "bin" / "python"
    if not python.is_file():
        raise PeerMissingError(
            f"--peer-venv {venv}: no python at {python}. vLLM's client (and --peer vllm's "
            f"server) come from that venv: build it with `python3 "
            f"{BUILD_SCRIPT.relative_to(REPO_ROOT)}` (~3.6 GB), or pass --peer-venv PATH")
    if not VLLM_CLI.is_file():
        raise PeerMissingError(f"{VLLM_CLI} is missing; run from a checkout of the repository")
    return python


def client_command(python: Path, base_url: str, model_name: str, checkpoint: Path,
                   trace_file: Path, scaling: TraceScaling, result_file: Path) -> list[str]:
    """``vllm bench serve`` replaying ``trace_file`` at its own times (``timestamp`` in ms,
    hence the 0.001 seconds multiplier) against ``base_url``'s completions endpoint."""
    return [str(python), str(VLLM_CLI), "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model_name,
            "--tokenizer", str(checkpoint), "--dataset-name", "timed_trace",
            "--dataset-path", str(trace_file),
            "--timed-trace-chunk-hash-size", str(scaling.block_tokens),
            "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(scaling.count),
            "--ignore-eos", "--temperature", "0", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-filename", str(result_file),
            "--disable-tqdm"]


def _vllm_server(python: Path, checkpoint: Path, name: str, port: int) -> list[str]:
    return [str(python), str(VLLM_CLI), "serve", str(checkpoint), "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "8192", "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name]


def _kthena_server(checkpoint: Path, name: str, port: int, extra: tuple[str, ...]) -> list[str]:
    # vLLM queues without bound: so does ours here, unless --kthena-arg sets the bound
    unbounded = () if any(a.startswith("--max-queue-delay") for a in extra) else (
        "--max-queue-delay", "0")
    return [sys.executable, "-m", "kthena_core.cli", "serve", "--model", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
            *unbounded, *extra]


def _check_kthena_args(instance: object, attribute: attrs.Attribute,
                       value: tuple[str, ...]) -> None:
    for arg in value:
        flag = arg.split("=", 1)[0]
        if not arg.startswith("-"):
            raise ValueError(f"--kthena-arg {arg!r}: pass one flag per --kthena-arg, in the "
                             "--kthena-arg=--flag=value form")
        if flag in _RESERVED_FLAGS:
            raise ValueError(f"--kthena-arg {arg!r}: {flag} is set by the bench (same "
                             "checkpoint, 127.0.0.1, a free port, one model name for both)")


@attrs.frozen
class TraceOptions:
    """One ``kthena bench trace`` run; ``peer`` None runs ours alone; ``llama_cpp_dir`` and
    ``peer_quant`` are the build and GGUF of ``peer="llama.cpp"``."""

    trace: Path
    scaling: TraceScaling = TraceScaling()
    peer: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(TRACE_PEERS)))
    llama_cpp_dir: Path = LLAMA_DIR
    peer_quant: str = "shipped"
    peer_venv: Path = DEFAULT_PEER_VENV
    model: str = "default"
    kthena_args: tuple[str, ...] = attrs.field(default=(), validator=_check_kthena_args)
    plot: str | None = None
    keep: Path | None = None  # write the work folder here and keep it (else a temp folder)
    server_start_timeout_s: float = attrs.field(default=SERVER_START_TIMEOUT_S,
                                                validator=attrs.validators.gt(0))


# ---- processes ---------------------------------------------------------------------------------
def _run_client(argv: list[str], folder: Path, timeout_s: float) -> None:
    """Run vLLM's client; its output goes on to stderr as it comes.

    Raises:
        RuntimeError: it exited non-zero or ran past ``timeout_s`` (its group is killed).
    """
    print(f"kthena bench trace: client: {' '.join(argv)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # block id -> the same token ids in every run
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                            errors="replace", start_new_session=True, cwd=folder)
    tail: collections.deque[str] = collections.deque(maxlen=30)

    def echo() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail.append(line.rstrip("\n"))
            print(line, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"vLLM's client ran past {timeout_s:.0f} s") from None
    finally:
        kill_group(proc)
        reader.join(timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM's client exited with {proc.returncode}; its last output:\n"
                           + "\n".join(tail))


@attrs.frozen
class _Side:
    """One system: its server's command line and environment, and where it listens."""

    name: str
    server: list[str]
    env: dict
    base_url: str


@attrs.frozen
class _Replay:
    """What every side's replay shares: the client's venv, the model, the scaled window."""

    python: Path
    checkpoint: Path
    model_name: str
    trace_file: Path
    scaling: TraceScaling
    server_start_timeout_s: float
    client_timeout_s: float


def _replay(side: _Side, replay: _Replay) -> dict:
    """Start one server, wait for it, warm it up, replay the window once the cores are idle,
    stop it; its figures, with the per-request lists for the CDFs under ``_raw``."""
    folder = replay.trace_file.parent
    result_file = folder / f"{side.name}-result.json"
    client = client_command(replay.python, side.base_url, replay.model_name, replay.checkpoint,
                            replay.trace_file, replay.scaling, result_file)
    with ServerChild(f"{side.name} server", side.server, side.env,
                     folder / f"{side.name}-server.log", who="kthena bench trace") as server:
        ready_s = wait_ready(server, side.base_url, replay.server_start_timeout_s)
        warm_s = warm_up(server, side.base_url, replay.model_name)
        idle_s = wait_until_idle()
        load_before = round(os.getloadavg()[0], 2)
        _run_client(client, folder, replay.client_timeout_s)
        if server.proc.poll() is not None:
            raise server.fail(f"exited with {server.proc.returncode} during the replay")
        admission = _admission_figures(side.base_url) if side.name == "kthena" else None
    raw = json.loads(result_file.read_text(encoding="utf-8"))
    lists = per_request(raw)
    return {**side_figures(raw), "errors": error_counts(raw),
            "percentile_check": percentile_check(raw, lists), "server_command": side.server,
            "server_omp_wait_policy": side.env.get("OMP_WAIT_POLICY", ""),
            "server_ready_s": round(ready_s, 1), "warm_up_s": round(warm_s, 2),
            "idle_wait_s": round(idle_s, 1), "load_avg_1m_before": load_before,
            "load_avg_1m_after": round(os.getloadavg()[0], 2),
            **({"admission": admission} if admission is not None else {}), "_raw": lists}


def _admission_figures(base_url: str) -> dict:
    """What overload control did in the replay, from the server's /metrics: refusals by bound
    (``queue_delay``/``queued_tokens`` at admission, ``queue_timeout`` after it) and how the
    scaled wait estimates compared with the waits the admitted requests had
    (``kthena_admission_estimate_to_wait_ratio``: percentiles over the last first tokens)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as reply:
        text = reply.read().decode("utf-8")
    refused: dict[str, int] = {}
    figures: dict = {"refused": refused}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kthena_requests_rejected_total":
                refused[sample.labels.get("limit", "")] = int(sample.value)
            elif sample.name == "kthena_admission_estimate_to_wait_ratio":
                figures[f"estimate_to_wait_p{round(float(sample.labels['quantile']) * 100)}"] = (
                    round(sample.value, 3))
            elif sample.name == "kthena_admission_estimate_to_wait_samples":
                figures["estimate_to_wait_samples"] = int(sample.value)
            elif sample.name == "kthena_admission_wait_factor":
                figures["wait_factor_at_end"] = round(sample.value, 3)
            elif sample.name == "kthena_step_seconds_total":
                figures.setdefault("engine_seconds", {})[sample.labels["phase"]] = round(
                    sample.value, 2)
    return figures


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _vllm_version(venv: Path) -> str | None:
    found = sorted(venv.glob("lib/python*/site-packages/vllm*-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").replace("_", "-") if found else None


def _sides(options: TraceOptions, python: Path, checkpoint: Path, name: str,
           llama: LlamaCppPeer | None = None, gguf: Path | None = None,
           rpc_dir: Path | None = None) -> list[_Side]:
    """Each server's command and environment (``llama``'s server on ``gguf`` for
    ``--peer llama.cpp``): the user's, without a PASSIVE wait policy this
    process set for itself (`threads.user_environ`), so each decides its OpenMP policy as when
    started from a shell (`kthena serve` alone on its cores keeps OpenMP's default spin).
    ``vllm serve`` binds its ZMQ ipc sockets in ``rpc_dir`` (the run's work folder; vLLM's
    default, /tmp, keeps the sockets it leaves when stopped)."""
    from kthena_serve.engine.threads import owned_cores, user_environ

    sides = []
    if options.peer == NAME:
        port = free_port()
        threads = len(owned_cores())
        server = server_command(llama.server, gguf, port, threads, TRACE_SLOTS, name,
                                slot_tokens=TRACE_SLOT_TOKENS)
        sides.append(_Side(NAME, server, user_environ(), f"http://127.0.0.1:{port}"))
    if options.peer == "vllm":
        port = free_port()
        env = {**user_environ(), "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, kthena's default KV pool
               "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, owned_cores())),
               **({"VLLM_RPC_BASE_PATH": str(rpc_dir)} if rpc_dir is not None else {})}
        sides.append(_Side("vllm", _vllm_server(python, checkpoint, name, port), env,
                           f"http://127.0.0.1:{port}"))
    port = free_port()
    env = {k: v for k, v in user_environ().items() if k != "KTHENA_API_KEY"}  # the client sends none
    sides.append(_Side("kthena", _kthena_server(checkpoint, name, port, options.kthena_args),
                       {**env, "PYTHONUNBUFFERED": "1"}, f"http://127.0.0.1:{port}"))
    return sides


@contextlib.contextmanager
def _work_folder(keep: Path | None):
    """``keep`` (created, kept), else a temporary folder removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix=f"kthena-trace-{os.getpid()}-") as tmp:
        yield Path(tmp)


def _report_head(options: TraceOptions, checkpoint: Path, stats: dict) -> dict:
    """What the report says about the run before it starts: window, model, client, machine."""
    return {"bench": "kthena bench trace",
            "window": {"trace": options.trace.name, **attrs.asdict(options.scaling), **stats},
            "model": str(checkpoint),
            "client": {"vllm": _vllm_version(options.peer_venv), "dataset": "timed_trace",
                       "sec_multiplier": 0.001},
            "machine": {"cpu": cpu_model(), "cpu_isa": cpu_isa(),
                        "cores": len(os.sched_getaffinity(0)),
                        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                        "loadavg_before": [round(x, 2) for x in os.getloadavg()]},
            "git_commit": _git_commit(), "kthena_args": list(options.kthena_args)}


def _llama_cpp(options: TraceOptions) -> LlamaCppPeer | None:
    """The llama.cpp peer of ``--peer llama.cpp``, its build checked; None for other peers.

    Raises:
        PeerMissingError: no build (the message names the build command).
        ValueError: a bad ``peer_quant``, or a model that is not a GGUF.
    """
    if options.peer != NAME:
        return None
    peer = LlamaCppPeer(gguf=source_gguf(options.model), quant=options.peer_quant,
                        folder=options.llama_cpp_dir)
    peer.check()
    return peer


def run_trace(options: TraceOptions) -> dict:
    """Scale the window, replay it against each server in turn (the peer first); the JSON-ready
    report (writes the plot if asked).

    Raises:
        FileNotFoundError, ValueError (TraceError), PeerMissingError: bad input, found before
            anything starts.
        RuntimeError: a server or the client failed (every process started is stopped).
    """
    from kthena_serve.model import resolve_checkpoint

    scaled = scale_window(read_window(options.trace, options.scaling.start,
                                      options.scaling.count), options.scaling)
    llama = _llama_cpp(options)  # its build first: it is what --peer llama.cpp adds
    python = peer_venv_tools(options.peer_venv)
    if options.plot and not is_available("matplotlib"):
        raise ValueError("--plot needs matplotlib: `pip install matplotlib` in this venv, or "
                         "leave --plot out")
    checkpoint = resolve_checkpoint(options.model)  # converted once, cached
    stats = window_stats(scaled)
    report = _report_head(options, checkpoint, stats)
    gguf = None if llama is None else quantized_gguf(llama)  # made once, cached
    if gguf is not None:
        report["llama.cpp_model"] = {"gguf": str(gguf), "quant": llama.quant,
                                     "slots": TRACE_SLOTS, "slot_tokens": TRACE_SLOT_TOKENS}
    with _work_folder(options.keep) as folder:
        replay = _Replay(python, checkpoint, checkpoint.name, folder / "window.jsonl",
                         options.scaling, options.server_start_timeout_s,
                         stats["arrival_span_s"] + CLIENT_SLACK_S)
        write_trace(scaled, replay.trace_file)
        for side in _sides(options, python, checkpoint, checkpoint.name, llama, gguf, folder):
            report[side.name] = _replay(side, replay)
    report["order"] = [s for s in (*TRACE_PEERS, "kthena") if s in report]
    report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    lists = {s: report[s].pop("_raw") for s in report["order"]}
    if options.peer:
        report[f"kthena_vs_{options.peer}"] = ours_vs_peer(report["kthena"], report[options.peer])
    if options.plot:
        plot_cdfs(lists, options.plot, _plot_title(report))
        report["plot"] = options.plot
    return report


def _plot_title(report: dict) -> str:
    window, machine = report["window"], report["machine"]
    return (f"kthena bench trace: requests {window['start']}+{window['count']} of "
            f"{window['trace']}, {machine['cpu']}, load {machine['loadavg_before'][0]} → "
            f"{machine['loadavg_after'][0]}, {report['git_commit']}")


# ---- the command -------------------------------------------------------------------------------
def add_parser(children: argparse._SubParsersAction) -> None:
    """Add ``kthena bench trace`` to the ``kthena bench`` subcommands."""
    defaults = TraceScaling()
    parser = children.add_parser("trace", help="replay a window of a Mooncake trace with "
                                 "vLLM's own client against kthena serve (and --peer vllm or "
                                 "llama.cpp)",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, metavar="FILE",
                        help="a trace in Mooncake's JSONL format")
    parser.add_argument("--start", type=int, default=defaults.start,
                        help="first request of the window (0-based)")
    parser.add_argument("--count", type=int, default=defaults.count, help="requests replayed")
    parser.add_argument("--block-tokens", type=int, default=defaults.block_tokens,
                        help="tokens per 512-token block id")
    parser.add_argument("--output-scale", type=float, default=defaults.output_scale,
                        help="output lengths x this (half up, at least 1)")
    parser.add_argument("--output-cap", type=int, default=defaults.output_cap,
                        help="output lengths at most this")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale,
                        help="trace milliseconds -> replay seconds (0.002: half speed)")
    parser.add_argument("--peer", default=None, metavar="vllm|llama.cpp[=FOLDER]",
                        help="also replay against `vllm serve` or llama.cpp's `llama-server` "
                             "(built by benchmarks/peers/build_llama_cpp.sh, or in FOLDER/bin) "
                             "first, same model, same cores")
    parser.add_argument("--peer-quant", default=None, metavar="shipped|Q8_0|F16",
                        help="with --peer llama.cpp: the GGUF as shipped, or re-quantised once "
                             "with llama-quantize (default: shipped)")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV,
                        help="venv of vLLM's CPU build: the client, and the peer's server "
                             "(default: benchmarks/peers/.venv-vllm)")
    parser.add_argument("--model", default="default",
                        help="'default' or a Hugging Face checkpoint folder (both servers)")
    parser.add_argument("--kthena-arg", action="append", default=[], metavar="ARG",
                        help="an extra `kthena serve` flag (repeatable), e.g. "
                             "--kthena-arg=--max-num-batched-tokens=512")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the JSON here")
    parser.add_argument("--markdown", default=None, metavar="FILE",
                        help="write the table here instead of stderr")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="latency CDFs (TTFT, TPOT, ITL) of each system (needs matplotlib)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the scaled window, the server logs and vLLM's result files "
                             "in DIR (default: a temporary folder, removed)")
    parser.set_defaults(func=_run)


def options_from_args(args: argparse.Namespace) -> TraceOptions:
    """The validated options of a parsed command line.

    Raises:
        ValueError: a non-positive scale or count, a negative start, a bad --kthena-arg.
    """
    scaling = TraceScaling(start=args.start, count=args.count, block_tokens=args.block_tokens,
                           output_scale=args.output_scale, output_cap=args.output_cap,
                           time_scale=args.time_scale)
    peer, _, folder = (args.peer or "").partition("=")
    if peer and peer not in TRACE_PEERS or folder and peer != NAME:
        raise ValueError(f"--peer {args.peer!r}: choose vllm or {NAME} (optionally "
                         f"{NAME}=/path/to/its/build/folder)")
    if args.peer_quant is not None and peer != NAME:
        raise ValueError(f"--peer-quant {args.peer_quant}: only with --peer {NAME}")
    return TraceOptions(trace=args.trace, scaling=scaling, peer=peer or None,
                        llama_cpp_dir=Path(folder).expanduser() if folder else LLAMA_DIR,
                        peer_quant=args.peer_quant or "shipped", peer_venv=args.peer_venv,
                        model=args.model, kthena_args=tuple(args.kthena_arg), plot=args.plot, keep=args.keep)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run(args: argparse.Namespace) -> int:
    """Prints the JSON line; exit status 2 for bad input, 1 when a run failed, 130 when
    interrupted (Ctrl-C or SIGTERM: the servers and the client are stopped either way)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)  # unwind through every `finally`
    try:
        report = run_trace(options_from_args(args))
    except KeyboardInterrupt:
        print("kthena bench trace: interrupted; every process it started is stopped",
              file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as error:
        print(f"kthena bench trace: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"kthena bench trace: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(line + "\n", encoding="utf-8")
    table = markdown_table(report)
    if args.markdown:
        Path(args.markdown).write_text(table, encoding="utf-8")
    else:
        print(table, file=sys.stderr)
    return 0
