"""The kernel cache: where a measured kernel choice is kept, under what key, and whether a kept
choice is final.

    <cache_dir>/kernels/<key>.json    one record per key (`selection.KernelChoice.as_dict`,
                                      or `moe_selection.MoEKernelChoice.as_dict`: kind "moe")
    <cache_dir>/kernels/<key>.lock    held while a process reads, times and writes that key

`cached_or_measured` is that read, time, write round, for either kind of choice.

The key (`cache_key`) names what would make another measurement differ: the CPU (model name
and a hash of its flags), torch's version and thread count, OpenMP's wait settings, the native
build (file, size, mtime), the mode and the shapes timed.

A record is final unless it was timed while the machine was busy with other work: the 1-minute
load average read just before timing was above half the cores this process may use
(`MachineLoad.is_busy`: the host probe's rule, ``kthena_core.discovery.host_probe.is_busy``).
Such a record is provisional: the process that timed it runs with it, and the next start times
again and overwrites it, unless the record was written while that start waited for the lock (a
replica or rank starting beside it timed it just now).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import attrs
import torch

from kthena_core.discovery.host_probe import cpu_identity, is_busy
from mooncake_ops.dispatch import native_enabled

__all__ = ["MachineLoad", "Measured", "cache_key", "cached_or_measured", "locked", "machine_load",
           "read_record", "read_records", "record_path", "write_record"]

_log = logging.getLogger("mooncake_ops")


@attrs.frozen
class MachineLoad:
    """How busy this machine was just before a measurement.

    Attributes:
        load_1m: the 1-minute load average (runnable threads, on every core of the machine).
        num_cores: the cores this process may use.
    """

    load_1m: float
    num_cores: int

    @property
    def is_busy(self) -> bool:
        """True when other work held more than half the cores: timings then measure the
        neighbours as much as the kernels."""
        return is_busy(self.load_1m, self.num_cores)


def machine_load() -> MachineLoad:
    """This machine's load now: ``os.getloadavg()[0]`` over the cores of this process's
    affinity mask (``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        num_cores = len(os.sched_getaffinity(0))
    else:
        num_cores = os.cpu_count() or 1
    return MachineLoad(os.getloadavg()[0], num_cores)


class _Keyed(Protocol):
    def key(self) -> list: ...


def _native_identity() -> list:
    from mooncake_ops.linear import native_module

    module = native_module()
    path = getattr(module, "__file__", None)
    if not path:
        return [None]
    stat = Path(path).stat()
    return [Path(path).name, stat.st_size, int(stat.st_mtime)]


def _openmp_waiting() -> list[str | None]:
    """How this process's OpenMP threads wait between parallel regions (asleep under PASSIVE,
    spinning otherwise): every multi-threaded timing depends on it (a batch-32 decode step of
    the default model took 24 ms against 19 on a 2-core Zen 5)."""
    return [os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")]


def cache_key(mode: str, linear_shapes: Sequence, attention: _Keyed | None) -> str:
    """The hex key of a measurement: what would make another measurement differ.

    Args:
        mode: the kernel mode timed (``auto``).
        linear_shapes: one list per matmul weight timed (shape, dtype, role).
        attention: the attention shape timed (its ``key()``), or None.

    Returns:
        20 hex digits.
    """
    parts = [mode, cpu_identity(), torch.__version__, torch.get_num_threads(),
             _openmp_waiting(), native_enabled() and _native_identity(),
             [list(s) for s in linear_shapes], None if attention is None else attention.key()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def record_path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    """Where the record of ``key`` lives under ``cache_dir``."""
    return Path(cache_dir) / "kernels" / f"{key}.json"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock file, so a second process that starts at the same time waits and
    reads the first one's record instead of timing beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_record(path: Path) -> dict | None:
    """The JSON object at ``path``; None when it is missing, unreadable or not an object."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` whole (a reader never sees half a file)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def read_records(cache_dir: str | os.PathLike[str]) -> list[dict]:
    """Every readable record under ``<cache_dir>/kernels/``, by file name (unreadable files
    are skipped: a half-written or foreign file says nothing about a choice)."""
    folder = Path(cache_dir) / "kernels"
    found = (read_record(path) for path in sorted(folder.glob("*.json")))
    return [record for record in found if record is not None]


class Measured(Protocol):
    """What the cache needs of a measured choice (`KernelChoice`, `MoEKernelChoice`)."""

    provisional: bool
    measured_at_s: float | None

    def as_dict(self) -> dict: ...

    def timed_under(self) -> str: ...


M = TypeVar("M", bound=Measured)


def cached_or_measured(cache_dir: str | os.PathLike[str], key: str, measure: Callable[[], M],
                       from_record: Callable[[Mapping], M]) -> M:
    """The final record of ``key``, else a new measurement written in its place; a cache
    folder that cannot be written is warned about and the measurement used uncached.

    Args:
        cache_dir: the cache folder (records under ``<cache_dir>/kernels/``).
        key: the measurement's key (`cache_key`).
        measure: times the candidates, returning the choice.
        from_record: a record (``as_dict``) back to a choice of source ``cached``.
    """
    path = record_path(cache_dir, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".lock").touch()
    except OSError as e:
        _log.warning("kernel selection: cannot cache in %s (%s); timing now, uncached",
                     path.parent, e.strerror or e)
        return measure()
    return _locked_choice(path, key, measure, from_record)


def _locked_choice(path: Path, key: str, measure: Callable[[], M],
                   from_record: Callable[[Mapping], M]) -> M:
    started = time.time()
    with locked(path):
        record = read_record(path)
        if record is not None and record.get("key") == key:
            cached = from_record(record)
            # a provisional record timed while this call waited for the lock is a sibling's
            # (replicas and ranks start together): timing again in turn would only add up
            if not cached.provisional or (cached.measured_at_s or 0) >= started:
                return cached
            _log.info("kernel selection: the cached choice was timed at %s (a busy "
                      "machine); timing again", cached.timed_under())
        choice = measure()
        write_record(path, choice.as_dict())
    return choice
