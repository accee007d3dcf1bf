"""The peer systems of ``kthena bench serve --peer``; here vLLM's CPU build, run in its own venv.

vLLM cannot share this venv (it pins its own transformers and friends), so it lives in
``benchmarks/peers/.venv-vllm`` (built by ``benchmarks/peers/build_vllm_venv.py``) and runs
``benchmarks/peers/vllm_workloads.py`` as a child process: same checkpoint folder, same prompt
token ids (handed over as a JSON file), same cores. The child serves one timed run per request
(a JSON line each way), so the bench can alternate its runs with ours; its logs are passed on
to stderr. The other peer, llama.cpp's ``llama-server``, is `kthena_serve.bench.llama_cpp`; the
bench sees either through the `Peer` protocol.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn, Protocol

import attrs

__all__ = ["BUILD_SCRIPT", "PEERS", "PEER_CASES", "Peer", "PeerMissingError", "PeerRunError",
           "PeerSession", "PeerSpec", "check_peer", "parse_peer"]

REPO_ROOT = Path(__file__).resolve().parents[4]
PEER_DIR = REPO_ROOT / "benchmarks" / "peers"
BUILD_SCRIPT = PEER_DIR / "build_vllm_venv.py"
PEERS = {"vllm": (PEER_DIR / ".venv-vllm" / "bin" / "python", PEER_DIR / "vllm_workloads.py")}
PEER_TIMEOUT_S = 1800  # per answer: the peer's start-up, or one timed run


class PeerRunError(RuntimeError):
    """The peer ran but failed; the message holds its exit status and last output."""


class PeerMissingError(FileNotFoundError):
    """The peer's python or workload script is not there; the message says how to build it."""


class Peer(Protocol):
    """A peer system of ``kthena bench serve``: `PeerSpec` (vLLM) or
    `kthena_serve.bench.llama_cpp.LlamaCppPeer`."""

    @property
    def name(self) -> str: ...

    def check(self) -> None: ...

    def session(self, checkpoint: Path, workloads: dict, cores: list[int]
                ) -> contextlib.AbstractContextManager: ...


@attrs.frozen
class PeerSpec:
    """A peer to run: its name, the python of its venv and the workload script it runs."""

    name: str
    python: Path
    script: Path

    def check(self) -> None:
        """Raise `PeerMissingError` unless the peer's python and script exist."""
        check_peer(self)

    def session(self, checkpoint: Path, workloads: dict, cores: list[int]) -> PeerSession:
        """The bench's runs of ``workloads`` on this peer, over ``checkpoint`` on ``cores``."""
        return PeerSession(self, checkpoint, workloads, cores)


def parse_peer(text: str) -> PeerSpec:
    """``vllm`` or ``vllm=/path/to/python`` -> `PeerSpec` (not yet checked to exist).

    Raises:
        ValueError: an unknown peer name or an empty path.
    """
    name, sep, path = text.partition("=")
    if name not in PEERS:
        raise ValueError(f"--peer {text!r}: unknown peer {name!r}; choose from "
                         f"{', '.join(sorted(PEERS))} (optionally NAME=/path/to/its/python)")
    if sep and not path:
        raise ValueError(f"--peer {text!r}: empty path after '='; give the peer venv's python")
    python, script = PEERS[name]
    return PeerSpec(name, Path(path).expanduser() if path else python, script)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def check_peer(peer: PeerSpec) -> None:
    """Raise `PeerMissingError` unless the peer's python and script exist."""
    if not peer.script.is_file():
        raise PeerMissingError(f"--peer {peer.name}: workload script {peer.script} is missing; "
                               "run from a checkout of the repository (benchmarks/peers/)")
    if not peer.python.is_file():
        raise PeerMissingError(
            f"--peer {peer.name}: no peer python at {peer.python}. Build the optional peer "
            f"venv with `python3 {BUILD_SCRIPT.relative_to(REPO_ROOT)}` (downloads vLLM's CPU "
            f"wheel and its requirements, ~3.6 GB), or pass --peer {peer.name}=/path/to/python")


# result key -> (workload, the peer script's case, its LLM's prefix caching), in the order the
# bench runs the cases
PEER_CASES = {"a_batch1": ("a_batch1", "a", "on"), "b_offline": ("b_offline", "b", "on"),
              "c_shared_prefix_reuse": ("c_shared_prefix", "c", "on"),
              "c_shared_prefix_no_reuse": ("c_shared_prefix", "c", "off")}
_EOF = object()
_POLL_S = 1.0  # how often a wait for an answer checks that the peer is still alive


class PeerSession:
    """The peer's workloads one run at a time, so that its runs and ours can alternate.

    The peer script serves one ``LLM`` per process (prefix caching on for (a), (b) and (c)
    with reuse, off for (c) without): `run` starts the process a case needs, stopping the
    other first, so one peer process at most is alive. Use as a context manager: leaving it
    ends the peer's process group (vLLM's engine processes included) and removes its folder (the
    prompt file, vLLM's ipc sockets); on an error or interrupt at once, otherwise after the peer
    shut its ``LLM`` down.
    """

    def __init__(self, peer: PeerSpec, checkpoint: Path, workloads: dict, cores: list[int],
                 timeout_s: float = PEER_TIMEOUT_S) -> None:
        check_peer(peer)
        self.peer = peer
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix=f"kthena-peer-{os.getpid()}-")
        self._workloads = Path(self._tmp.name) / "workloads.json"
        self._workloads.write_text(json.dumps(workloads), encoding="utf-8")
        self._base = [str(peer.python), str(peer.script), "--model", str(checkpoint),
                      "--workloads", str(self._workloads), "--cores", ",".join(map(str, cores))]
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._caching: str | None = None
        self._answers: queue.Queue = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=20)
        self.info: dict = {}  # the peer's "ready" fields (version, cores, settings)

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.close(graceful=exc_type is None)
        finally:
            self._tmp.cleanup()

    def run(self, key: str) -> dict:
        """One timed run of result key ``key`` (see `PEER_CASES`) on the peer; its figures.

        Raises:
            PeerRunError: the peer exited, answered with something else, or took longer than
                ``timeout_s`` (its process group is killed; its last output is in the message).
        """
        _, case, caching = PEER_CASES[key]
        if self._caching != caching:
            self.close()
            self._start(caching)
        self._signal(self._proc, signal.SIGCONT)
        self._send({"case": case})
        answer = self._next()
        if answer.get("case") != case or not isinstance(answer.get("result"), dict):
            self._fail(f"answered {answer} to case {case!r}")
        self._signal(self._proc, signal.SIGSTOP)
        return answer["result"]

    @staticmethod
    def _signal(proc: subprocess.Popen | None, sig: signal.Signals) -> None:
        """Stop (SIGSTOP) the peer's process group between its runs, continue it (SIGCONT)
        for the next: an idle vLLM is not idle (its workers poll their queue for a second
        after each run, a dozen gloo threads wake 100 times a second each), and those
        wake-ups would land on the other systems' runs."""
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self, graceful: bool = True) -> None:
        """End the peer process: with ``graceful``, stdin closed and up to a minute for it to
        shut its ``LLM`` down; then, always, its process group killed."""
        proc, self._proc, self._caching = self._proc, None, None
        if proc is None:
            return
        self._signal(proc, signal.SIGCONT)  # a stopped peer cannot read its closed stdin
        try:
            if graceful:
                proc.stdin.close()  # type: ignore[union-attr]
                proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            kill_group(proc)
            if self._reader is not None:
                self._reader.join(timeout=10)
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()  # type: ignore[union-attr]
                except OSError:
                    pass

    def _start(self, caching: str) -> None:
        command = [*self._base, "--prefix-caching", caching]
        print(f"kthena bench serve: peer: {' '.join(command)}", file=sys.stderr, flush=True)
        self._answers = queue.Queue()
        self._tail.clear()
        # vLLM's engine binds ZMQ ipc sockets under VLLM_RPC_BASE_PATH (default /tmp) and leaves
        # them when stopped: here they go into this session's folder, removed with it
        env = {**os.environ, "VLLM_RPC_BASE_PATH": self._tmp.name}
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                                      errors="replace", start_new_session=True, env=env)
        self._caching = caching
        self._reader = threading.Thread(target=self._read, args=(self._proc, self._answers),
                                        daemon=True)
        self._reader.start()
        ready = self._next()
        if not isinstance(ready.get("ready"), dict):
            self._fail(f"sent {ready} before its ready line")
        self.info = ready["ready"]
        self._signal(self._proc, signal.SIGSTOP)

    def _read(self, proc: subprocess.Popen, answers: queue.Queue) -> None:
        """Answers (JSON objects naming the peer) to ``answers``; its logs on to stderr."""
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                line = line.rstrip("\n")
                try:
                    value = json.loads(line)
                except ValueError:
                    value = None
                if isinstance(value, dict) and value.get("peer") == self.peer.name:
                    answers.put(value)
                elif line.strip():
                    self._tail.append(line)
                    print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # the pipe closed under us (close())
            pass
        finally:
            answers.put(_EOF)

    def _send(self, request: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            self._fail("closed its stdin")

    def _next(self) -> dict:
        """The peer's next answer; fails when it exits first or gives none in ``timeout_s``."""
        proc = self._proc
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                answer = self._answers.get(timeout=min(_POLL_S, self.timeout_s))
            except queue.Empty:
                # its engine processes may keep the pipe open after it died: no EOF then
                if proc.poll() is not None:  # type: ignore[union-attr]
                    self._fail(f"exited with {proc.returncode}")  # type: ignore[union-attr]
                if time.monotonic() >= deadline:
                    self._fail(f"gave no answer within {self.timeout_s} s")
                continue
            if answer is _EOF:
                try:
                    proc.wait(timeout=10)  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    pass
                self._fail(f"exited with {proc.returncode}")  # type: ignore[union-attr]
            return answer

    def _fail(self, what: str) -> NoReturn:
        self.close(graceful=False)
        tail = "\n".join(self._tail)
        raise PeerRunError(f"--peer {self.peer.name}: {self.peer.script.name} {what}; "
                           f"its last output:\n{tail}")
