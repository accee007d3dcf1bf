"""The ``--peer llama.cpp`` system: ``llama-server`` on the same GGUF, on 127.0.0.1.

    benchmarks/peers/build_llama_cpp.sh ─▶ benchmarks/peers/llama.cpp/bin/llama-{server,quantize}
    the model's GGUF (default: SmolLM2's, as shipped: Q4_1)
        └─ llama-quantize --allow-requantize, once ─▶ llama.cpp/models/NAME.{Q8_0,F16}.gguf
    llama-server --model GGUF --host 127.0.0.1 --port FREE --threads N --threads-batch N
                 --parallel SLOTS --ctx-size SLOTS*2048 --cache-ram 0 --slots ...
        ◀─ kthena bench serve: each case's requests sent at once, streamed (/completion, token ids)
        ◀─ kthena bench trace: vLLM's client (/v1/completions)

The build is optional and never made by the tests: without it, `LlamaCppPeer.check` refuses in
one line naming the build command. ``N`` is one thread per core the bench gives it (the server
inherits the bench's affinity). ``--cache-ram 0`` turns off llama-server's host-memory prompt
cache and every timed run starts after each slot is erased, so a run starts as cold as ours
(our prefix cache is reset before each run; erasing needs ``--slot-save-path``, a temporary
folder nothing is saved to). Between runs the server's process group is stopped
(SIGSTOP), as the vLLM peer's is, so nothing of it lands on the other systems' runs.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import attrs

from kthena_core.ports import free_port
from kthena_serve.bench.children import ServerChild, http_status, wait_ready
from kthena_serve.bench.peer import (
    PEER_CASES,
    PEER_DIR,
    PEER_TIMEOUT_S,
    PeerMissingError,
    PeerRunError,
)

__all__ = ["BUILD_COMMAND", "LLAMA_DIR", "NAME", "QUANTS", "LlamaCppPeer", "LlamaCppSession",
           "RequestTiming", "parse_llama_cpp", "quantized_gguf", "run_batch", "server_command",
           "source_gguf"]

NAME = "llama.cpp"
LLAMA_DIR = PEER_DIR / "llama.cpp"
BUILD_COMMAND = "bash benchmarks/peers/build_llama_cpp.sh"
QUANTS = ("shipped", "Q8_0", "F16")  # the GGUF as given, or re-quantised to that type
SLOT_TOKENS = 2048  # each sequence's KV (prompt + output) in bench serve: (c) needs 560


def _check_quant(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in QUANTS:
        raise ValueError(f"--peer-quant {value!r}: choose from {', '.join(QUANTS)} (shipped: "
                         "the model's GGUF as it is; the others: re-quantised once with "
                         "llama-quantize)")


@attrs.frozen
class LlamaCppPeer:
    """llama.cpp's binaries in ``folder`` (``bin/`` under it) serving ``gguf`` at ``quant``."""

    gguf: Path
    quant: str = attrs.field(default="shipped", validator=_check_quant)
    folder: Path = LLAMA_DIR
    name: str = attrs.field(default=NAME, init=False)

    @property
    def server(self) -> Path:
        return self.folder / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.folder / "bin" / "llama-quantize"

    def check(self) -> None:
        """Raise `PeerMissingError` (one line naming the build command) without the build."""
        missing = [p.name for p in (self.server, self.quantize) if not os.access(p, os.X_OK)]
        if missing:
            raise PeerMissingError(
                f"--peer {NAME}: no {' or '.join(missing)} in {self.folder / 'bin'}; build them "
                f"once with `{BUILD_COMMAND}` (~10+ minutes on 2 cores), or pass "
                f"--peer {NAME}=/path/to/a/folder/with/bin")

    def session(self, checkpoint: Path, workloads: dict, cores: list[int]) -> LlamaCppSession:
        """The bench's runs of ``workloads`` on this peer (``checkpoint`` is ours: unused)."""
        return LlamaCppSession(self, workloads, cores)


def source_gguf(model: str) -> Path:
    """The GGUF file the peer serves for ``--model``: the default model's shipped file, or a
    ``.gguf`` path.

    Raises:
        ValueError: ``model`` is neither (llama.cpp reads GGUF only).
    """
    if model == "default":
        from kthena_core.known_models import default_gguf_path

        return Path(default_gguf_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.resolve()
    raise ValueError(f"--peer {NAME} with --model {model!r}: llama.cpp reads GGUF files only; "
                     "use --model default or --model /path/to/model.gguf")


def parse_llama_cpp(text: str, quant: str, model: str) -> LlamaCppPeer:
    """``llama.cpp`` or ``llama.cpp=FOLDER`` (the build folder, ``bin/`` under it) with
    ``--peer-quant`` and ``--model`` -> `LlamaCppPeer` (not yet checked to exist).

    Raises:
        ValueError: another name, an empty folder after '=', a bad quant or a non-GGUF model.
    """
    name, sep, folder = text.partition("=")
    if name != NAME:
        raise ValueError(f"--peer {text!r}: not {NAME!r}")
    if sep and not folder:
        raise ValueError(f"--peer {text!r}: empty folder after '='; give the build folder "
                         f"(the one holding bin/llama-server)")
    return LlamaCppPeer(gguf=source_gguf(model), quant=quant,
                        folder=Path(folder).expanduser() if folder else LLAMA_DIR)


def quantized_gguf(peer: LlamaCppPeer, cache: Path | None = None) -> Path:
    """The GGUF the peer serves: ``peer.gguf`` for ``shipped``, else its re-quantisation to
    ``peer.quant``, made once with ``llama-quantize --allow-requantize`` into ``cache``
    (default: ``models/`` beside the build) and reused after.

    Raises:
        PeerRunError: llama-quantize failed (its exit status and last output).
    """
    if peer.quant == "shipped":
        return peer.gguf
    cache = cache or peer.folder / "models"
    stem = re.sub(r"\.(Q\d\w*|F16|BF16|F32)$", "", peer.gguf.stem, flags=re.IGNORECASE)
    target = cache / f"{stem}.{peer.quant}.gguf"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    argv = [str(peer.quantize), "--allow-requantize", str(peer.gguf), str(partial), peer.quant]
    print(f"kthena bench: {NAME}: {' '.join(argv)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise PeerRunError(f"--peer {NAME}: llama-quantize exited with {done.returncode}; its "
                           f"last output:\n{tail}")
    partial.replace(target)
    print(f"kthena bench: {NAME}: wrote {target} in {time.monotonic() - start:.1f} s",
          file=sys.stderr, flush=True)
    return target


def server_command(server: Path, gguf: Path, port: int, threads: int, slots: int,
                   alias: str, slot_tokens: int = SLOT_TOKENS,
                   slot_folder: Path | None = None) -> list[str]:
    """``llama-server`` on 127.0.0.1: ``threads`` for decode and prefill, ``slots`` sequences
    at once with ``slot_tokens`` of KV each (llama-server splits ``--ctx-size`` evenly among
    its slots), no host prompt cache; with ``slot_folder`` (its ``--slot-save-path``, which the
    slot actions need) slots can be erased."""
    saving = ["--slot-save-path", str(slot_folder)] if slot_folder is not None else []
    return [str(server), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(slots * slot_tokens), "--cache-ram", "0", "--slots", *saving,
            "--alias", alias, "--no-webui"]


# ---- the client --------------------------------------------------------------------------------
@attrs.frozen
class RequestTiming:
    """One streamed completion, times from `time.perf_counter`: sent, first token, last; the
    output tokens and the prompt tokens the server computed (its ``timings.prompt_n``)."""

    sent: float
    first_token: float
    finished: float
    num_output_tokens: int
    num_computed_prompt_tokens: int


def stream_completion(port: int, prompt: list[int], max_tokens: int, cache_prompt: bool,
                      timeout_s: float = PEER_TIMEOUT_S) -> RequestTiming:
    """POST ``prompt`` (token ids) to llama-server's ``/completion``, greedy, EOS ignored,
    streamed; times the first and the last token.

    Raises:
        PeerRunError: an HTTP error, an error event, or a stream that ends without its final
            event or with another number of tokens than ``max_tokens``.
    """
    body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True,
                       "temperature": 0.0, "cache_prompt": cache_prompt, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise PeerRunError(f"--peer {NAME}: /completion answered HTTP {response.status}: "
                               f"{response.read()[:500]!r}")
        first = None
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise PeerRunError(f"--peer {NAME}: /completion streamed an error: {event}")
            if first is None and event.get("tokens_predicted", 0) >= 1:
                first = time.perf_counter()
            if event.get("stop"):
                return _final(event, sent, first, max_tokens)
        raise PeerRunError(f"--peer {NAME}: /completion's stream ended before its final event")
    finally:
        conn.close()


def _final(event: dict, sent: float, first: float | None, max_tokens: int) -> RequestTiming:
    finished = time.perf_counter()
    produced = int(event.get("tokens_predicted", -1))
    if produced != max_tokens or first is None:
        raise PeerRunError(f"--peer {NAME}: asked for {max_tokens} tokens (EOS ignored), the "
                           f"server produced {produced}: {event.get('stop_type')}")
    return RequestTiming(sent, first, finished, produced, int(event["timings"]["prompt_n"]))


def run_batch(port: int, prompts: list[list[int]], max_tokens: int, cache_prompt: bool,
              concurrency: int | None = None) -> tuple[float, list[RequestTiming]]:
    """Send ``prompts`` with at most ``concurrency`` in flight (default: all at once); the
    start time (before the first is sent) and each request's timing, in prompt order."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency or len(prompts))
    try:
        start = time.perf_counter()
        futures = [pool.submit(stream_completion, port, p, max_tokens, cache_prompt)
                   for p in prompts]
        return start, [f.result() for f in futures]
    finally:
        # on an error or Ctrl-C, return at once: the caller stops the server, which ends the
        # requests still in flight (waiting for them could take their whole timeout)
        pool.shutdown(wait=False, cancel_futures=True)


def case_figures(key: str, start: float, timings: list[RequestTiming]) -> dict:
    """The figures of bench case ``key`` (`PEER_CASES`), as ours are computed: TTFT from the
    start of the run, decode rate over the tokens after the first."""
    total = max(t.finished for t in timings) - start
    mean_ttft = sum(t.first_token - start for t in timings) / len(timings)
    if key == "a_batch1":
        (one,) = timings
        return {"ttft_s": one.first_token - start,
                "decode_tok_s": (one.num_output_tokens - 1) / (one.finished - one.first_token)}
    if key == "b_offline":
        return {"total_s": total, "output_tok_s": sum(t.num_output_tokens for t in timings) / total}
    return {"total_s": total, "mean_ttft_s": mean_ttft,
            "computed_prompt_tokens": sum(t.num_computed_prompt_tokens for t in timings)}


# ---- the session -------------------------------------------------------------------------------
class LlamaCppSession:
    """One ``llama-server`` for all of the bench's cases, run one at a time: `run` continues
    its process group, erases every slot, runs the case and stops the group again. Use as a
    context manager: leaving it ends the group and removes the log folder."""

    def __init__(self, peer: LlamaCppPeer, workloads: dict, cores: list[int]) -> None:
        from kthena_serve.engine.threads import user_environ

        peer.check()
        self.peer = peer
        self._workloads = workloads
        self.slots = max(len(w["prompts"]) for w in workloads.values())
        gguf = quantized_gguf(peer)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"kthena-llama-{os.getpid()}-")
        self.port = free_port()
        argv = server_command(peer.server, gguf, self.port, len(cores), self.slots, gguf.stem,
                              slot_folder=Path(self._tmp.name))
        try:
            self._server = ServerChild(f"{NAME} server", argv, user_environ(),
                                       Path(self._tmp.name) / "llama-server.log",
                                       grace_s=10.0, who="kthena bench serve")
            ready_s = wait_ready(self._server, f"http://127.0.0.1:{self.port}", 600.0)
        except BaseException:
            self.close()
            raise
        try:
            meta = _model_meta(self.port)
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError) as error:
            self.close()
            raise PeerRunError(f"--peer {NAME}: /v1/models gave no model meta ({error})") from None
        self.info = {"version": _version(peer.server), "file_type": meta.get("ftype"),
                     "model_bytes": meta.get("size"), "quant": peer.quant, "gguf": str(gguf), "threads": len(cores),
                     "slots": self.slots, "slot_tokens": SLOT_TOKENS, "ready_s": round(ready_s, 1),
                     "command": argv}
        self._signal(signal.SIGSTOP)

    def __enter__(self) -> LlamaCppSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        server = getattr(self, "_server", None)
        try:
            if server is not None:
                server.stop()
        finally:
            self._tmp.cleanup()

    def run(self, key: str) -> dict:
        """One timed run of result key ``key`` (see `PEER_CASES`); its figures.

        Raises:
            PeerRunError: the server failed a request or exited (its last output attached).
        """
        workload, _, caching = PEER_CASES[key]
        spec = self._workloads[workload]
        self._signal(signal.SIGCONT)
        try:
            for slot in range(self.slots):
                http_status(f"http://127.0.0.1:{self.port}/slots/{slot}?action=erase", {})
            start, timings = run_batch(self.port, spec["prompts"], spec["max_tokens"],
                                       cache_prompt=caching == "on")
        except (OSError, urllib.error.URLError, PeerRunError, ValueError) as error:
            raise PeerRunError(f"--peer {NAME}: case {key} failed ({error}); the server's last "
                               f"output:\n{self._server.tail()}") from None
        self._signal(signal.SIGSTOP)
        return case_figures(key, start, timings)

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._server.proc.pid, sig)
        except ProcessLookupError:
            pass


def _model_meta(port: int) -> dict:
    """What the server says it loaded (``/v1/models``: file type, bytes, parameters)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["meta"]


def _version(server: Path) -> str | None:
    """``llama-server --version``'s ``version:`` line."""
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True,
                          errors="replace", timeout=60)
    found = re.search(r"^version: (.+)$", done.stdout + done.stderr, flags=re.MULTILINE)
    return found.group(1).strip() if found else None
