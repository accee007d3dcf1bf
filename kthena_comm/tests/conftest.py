"""Fixtures for kthena_comm tests: transfer peers in real subprocesses, gloo rank launchers.

Every subprocess gets OMP_NUM_THREADS=1 / OMP_WAIT_POLICY=PASSIVE (the test machine has two
shared cores), a deadline, and is reaped at teardown; tests assert nothing is left behind.
"""

from __future__ import annotations

import glob
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from _support import free_port

from kthena_comm.transfer import MemoryHandle

HERE = Path(__file__).parent
PEER_SCRIPT = HERE / "_transfer_peer.py"
RANK_SCRIPT = HERE / "_rank_worker.py"


def quiet_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
               GLOG_minloglevel="2", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Peer:
    """A transfer peer process (see _transfer_peer.py)."""

    def __init__(self, backend: str, nbytes: int, seed: int, shm_prefix: str,
                 *extra: str) -> None:
        self.seed, self.nbytes = seed, nbytes
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), backend, str(nbytes), str(seed), shm_prefix,
             *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=quiet_env())
        self._hello: dict | None = None

    def hello(self) -> dict:
        """The peer's first line (its handle); read lazily so a torch peer can rendezvous first."""
        if self._hello is None:
            self._hello = self._reply(timeout=60)
        return self._hello

    @property
    def handle(self) -> MemoryHandle:
        return MemoryHandle.from_dict(self.hello()["handle"])

    @property
    def address(self) -> str:
        return self.hello()["address"]

    def _reply(self, timeout: float = 20) -> dict:
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"peer gave no answer in {timeout}s: {self.stderr()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited: {self.stderr()}")
        return json.loads(line)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def call(self, **cmd: object) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def read(self, offset: int, length: int) -> bytes:
        return bytes.fromhex(self.call(cmd="read", offset=offset, length=length)["data"])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.close()

    def notifies(self, timeout_s: float) -> list[tuple[str, bytes]]:
        got = self.call(cmd="notifies", timeout_s=timeout_s)["messages"]
        return [(sender, bytes.fromhex(data)) for sender, data in got]


@pytest.fixture(scope="session")
def shm_prefix() -> str:
    return f"ktest-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def peer_factory(shm_prefix: str):
    """Start peers; at teardown stop them and check no process or shm segment is left."""
    peers: list[Peer] = []

    def start(backend: str, nbytes: int = 1 << 22, seed: int = 7, *extra: str) -> Peer:
        peer = Peer(backend, nbytes, seed, shm_prefix, *extra)
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        peer.close()
    assert all(p.proc.poll() is not None for p in peers)
    assert not glob.glob(f"/dev/shm/{shm_prefix}*"), "shm segments left behind"


@pytest.fixture(scope="session")
def run_ranks():
    """The ``_run_ranks`` launcher, as a fixture (test modules cannot import conftest)."""
    return _run_ranks


def _run_ranks(scenario: str, world_size: int, timeout: float = 120) -> list[str]:
    """Run _rank_worker.py SCENARIO on WORLD_SIZE gloo ranks; returns each rank's stdout."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(RANK_SCRIPT), scenario],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=quiet_env(RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for r in range(world_size)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
    return outputs
