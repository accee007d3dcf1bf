"""The peer system of ``kthena bench serve --peer``: vLLM's CPU build, run in its own venv.

vLLM cannot share this venv (it pins its own transformers and friends), so it lives in
``benchmarks/peers/.venv-vllm`` (built by ``benchmarks/peers/build_vllm_venv.py``) and runs
``benchmarks/peers/vllm_workloads.py`` as a child process: same checkpoint folder, same prompt
token ids (handed over as a JSON file), same cores. The child prints one JSON line of medians
keyed like our own cases; its logs are passed on to stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import attrs

__all__ = ["BUILD_SCRIPT", "PEERS", "PeerMissingError", "PeerRunError", "PeerSpec", "check_peer",
           "parse_peer", "run_peer"]

REPO_ROOT = Path(__file__).resolve().parents[3]
PEER_DIR = REPO_ROOT / "benchmarks" / "peers"
BUILD_SCRIPT = PEER_DIR / "build_vllm_venv.py"
PEERS = {"vllm": (PEER_DIR / ".venv-vllm" / "bin" / "python", PEER_DIR / "vllm_workloads.py")}
PEER_TIMEOUT_S = 3600


class PeerRunError(RuntimeError):
    """The peer ran but failed; the message holds its exit status and last output."""


class PeerMissingError(FileNotFoundError):
    """The peer's python or workload script is not there; the message says how to build it."""


@attrs.frozen
class PeerSpec:
    """A peer to run: its name, the python of its venv and the workload script it runs."""

    name: str
    python: Path
    script: Path


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


def _kill_group(proc: subprocess.Popen) -> None:
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


def run_peer(peer: PeerSpec, checkpoint: Path, workloads: dict, cores: list[int],
             repeats: int) -> dict:
    """Run the peer's workloads; returns its JSON line (``{"vllm": {case: medians}, ...}``).

    Raises:
        PeerMissingError: see `check_peer`.
        PeerRunError: the peer exited non-zero, printed no JSON, or ran past an hour (its
            process group is killed then; its last output is in the message).
    """
    check_peer(peer)
    with tempfile.TemporaryDirectory(prefix="kthena-peer-") as tmp:
        path = Path(tmp) / "workloads.json"
        path.write_text(json.dumps(workloads), encoding="utf-8")
        command = [str(peer.python), str(peer.script), "--model", str(checkpoint),
                   "--workloads", str(path), "--cores", ",".join(map(str, cores)),
                   "--repeats", str(repeats)]
        print(f"kthena bench serve: peer: {' '.join(command)}", file=sys.stderr, flush=True)
        returncode, lines = _run_group(command)
    result = _last_json(lines, peer.name) if returncode == 0 else None
    if result is None:
        tail = "\n".join(lines[-20:])
        raise PeerRunError(f"--peer {peer.name}: {peer.script.name} exited with {returncode} "
                           f"and no JSON line; its last output:\n{tail}")
    return result


def _last_json(lines: list[str], name: str) -> dict | None:
    """The last line that is a JSON object holding ``name`` (log lines may follow it)."""
    for line in reversed(lines):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and name in value:
            return value
    return None


def _run_group(command: list[str]) -> tuple[int, list[str]]:
    """Run ``command`` in its own process group, passing its stdout on to our stderr (vLLM
    logs to stdout; ours stays clean for the one JSON line). The group (vLLM's engine
    processes included) is killed on a time-out or an interrupt."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    timer = threading.Timer(PEER_TIMEOUT_S, _kill_group, (proc,))
    timer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip("\n"))
            print(line, end="", file=sys.stderr, flush=True)
        returncode = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        timer.cancel()
        proc.stdout.close()  # type: ignore[union-attr]
    if returncode < 0:
        lines.append(f"(killed by signal {-returncode}; the limit is {PEER_TIMEOUT_S} s)")
    return returncode, [line for line in lines if line.strip()]
