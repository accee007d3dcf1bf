"""A ``mooncake_master`` on 127.0.0.1 for one process's lifetime (tests, benchmarks, one host).

    proc, address = start_local_master()     # "127.0.0.1:<rpc port>", the port answering
    ...                                        # StoreTierConfig(master_address=address)
    stop_master(proc)

The master binary comes with the Mooncake wheel (``mooncake-kv[store]``) next to this
interpreter. It listens on 127.0.0.1 only (RPC and metrics), on free ports.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["MasterUnavailableError", "master_binary", "start_local_master", "stop_master"]


class MasterUnavailableError(RuntimeError):
    """No ``mooncake_master`` could be started (the message says why)."""


def master_binary() -> Path:
    """Where the Mooncake wheel installs ``mooncake_master`` for this interpreter."""
    return Path(sys.executable).parent / "mooncake_master"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_local_master(*extra_args: str, timeout_s: float = 30.0, rpc_port: int | None = None,
                       ) -> tuple[subprocess.Popen, str]:
    """Start a master on free 127.0.0.1 ports; (process, ``"127.0.0.1:<rpc port>"``) once its
    RPC port answers. ``extra_args`` go to the master (e.g. ``--default_kv_lease_ttl=100``);
    ``rpc_port`` is the RPC port to take instead of a free one (a master started again where
    its clients look for it: they reconnect by themselves).

    Raises:
        MasterUnavailableError: the binary is missing, exited, or did not answer in time.
    """
    binary = master_binary()
    if not binary.exists():
        raise MasterUnavailableError(f"mooncake_master not found at {binary}; install "
                                     "mooncake-kv[store] (the Mooncake wheel ships it)")
    rpc, metrics = rpc_port or _free_port(), _free_port()
    proc = subprocess.Popen(
        [str(binary), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         f"--metrics_port={metrics}", "--metrics_host=127.0.0.1",
         "--enable_metric_reporting=false", "--rpc_thread_num=2", *extra_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
            proc.stderr.close()
            raise MasterUnavailableError(f"mooncake_master exited with {proc.returncode}: "
                                         f"{detail}")
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=0.2).close()
            return proc, f"127.0.0.1:{rpc}"
        except OSError:
            time.sleep(0.05)
    stop_master(proc)
    raise MasterUnavailableError(f"mooncake_master did not open 127.0.0.1:{rpc} within "
                                 f"{timeout_s:g} s")


def stop_master(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Terminate (then kill) the master and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()
