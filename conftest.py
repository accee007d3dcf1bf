"""Shared pytest set-up: Hypothesis profiles `dev` (default) and `ci` (`HYPOTHESIS_PROFILE=ci`)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Import the five layers before collection: pytest's importlib mode names a test module after its
# path (``kthena_core/tests/test_x.py`` -> ``kthena_core.tests.test_x``) and would otherwise create
# an empty ``kthena_core`` placeholder (the distribution folder) that shadows the real package.
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

for _layer in ("kthena_core", "mooncake_kv", "kthena_comm", "mooncake_ops", "kthena_serve"):
    importlib.import_module(_layer)

# Every package's tests import the shared helpers of tests/_support.py (free_port, wait_until,
# metric_value, ...) as ``_support`` and the test doubles of tests/doubles as ``doubles``.
sys.path.insert(0, str(Path(__file__).parent / "tests"))


# ---- a suite that does not read the machine it runs on ------------------------------------------
# The suite runs with a cache folder of its own (KTHENA_CACHE_DIR: converted model, kernel
# choices, host probes and calibrations; the user's ~/.cache/kthena is never read or written) and
# with a recorded host probe standing in for this machine's (KTHENA_HOST_PROBE: SUITE_PROFILE's,
# from kthena_core/cpu_records), so that a plan, a calibration or a prediction made in a test is
# the same on every CPU. The controller makes both before xdist starts its workers, which inherit
# them, and removes the folder at the end. Tests of the probe itself pass their own folders and
# sizes; `cpu_profile` runs a test once per recorded CPU.
# Kernels: every engine the suite builds without a mode of its own takes them by the CPU's
# features (KTHENA_KERNELS=native, EngineConfig.kernels' default), not by timing: a choice timed
# on the suite's busy cores is provisional, so each engine start timed its candidates again
# (about 10 s of every server's start), and two processes could time a near-tie differently.
# The tests of selection itself pass kernels="auto"; a KTHENA_KERNELS the caller set is kept.
from kthena_core.cpu_defaults import load_records  # noqa: E402

SUITE_PROFILE = "zen4"
SUITE_KERNELS = "native"
_SUITE_ENV = ("KTHENA_CACHE_DIR", "KTHENA_HOST_PROBE", "KTHENA_KERNELS")


def probe_file_of(record, folder: Path) -> Path:
    """A ``KTHENA_HOST_PROBE`` file in ``folder`` holding ``record``'s probe (the host probe of
    its bench run), with its CPU's ISA class."""
    from kthena_core.bench_record import bench_probe

    probe = bench_probe(record.bench).to_dict()
    probe["cpu"] = {**record.cpu, "isa_class": record.isa_class}
    path = folder / f"host-probe-{record.name}.json"
    path.write_text(json.dumps(probe), encoding="utf-8")
    return path


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker: the controller set both, and it inherited them
    folder = Path(tempfile.mkdtemp(prefix="kthena-suite-cache-"))
    config._kthena_suite = (folder, {k: os.environ.get(k) for k in (*_SUITE_ENV, ORDER_SEED_ENV)})
    os.environ[ORDER_SEED_ENV] = str(config.getoption("order_seed")
                                     if config.getoption("order_seed") is not None
                                     else secrets.randbelow(2**32))
    record = next(r for r in load_records() if r.name == SUITE_PROFILE)
    os.environ["KTHENA_CACHE_DIR"] = str(folder)
    os.environ["KTHENA_HOST_PROBE"] = str(probe_file_of(record, folder))
    os.environ.setdefault("KTHENA_KERNELS", SUITE_KERNELS)


# ---- test files in a random order -----------------------------------------------------------------
# The files run in an order drawn from a seed (tests inside a file keep their order: a module's
# tests may share one deployment and build on each other, as a killed replica does). The
# controller draws the seed, or takes --order-seed N, and hands it to the xdist workers through
# the environment, so that every worker collects the same order, as xdist requires.
ORDER_SEED_ENV = "KTHENA_TEST_ORDER_SEED"


def pytest_addoption(parser):
    parser.addoption("--order-seed", type=int, default=None, metavar="N",
                     help="run the test files in the order this seed draws (default: a new "
                          "seed, printed at the start and the end)")


def _order_seed(config) -> int:
    given = config.getoption("order_seed")
    if given is not None:
        return given
    return int(os.environ[ORDER_SEED_ENV])


def _seed_line(config) -> str:
    seed = _order_seed(config)
    return (f"test files in a random order: --order-seed={seed} (make test "
            f"PYTEST_ARGS=--order-seed={seed} replays it)")


def pytest_collection_modifyitems(session, config, items):
    """Shuffle the files, keeping each file's tests together and in their order."""
    import random

    files: dict[str, list] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    order = list(files)
    random.Random(_order_seed(config)).shuffle(order)
    items[:] = [item for path in order for item in files[path]]


def pytest_sessionstart(session):
    """The order's seed, printed even under -q (by the controller, or by pytest alone)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        session.config.get_terminal_writer().line(_seed_line(session.config))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_seed_line(config))


def pytest_unconfigure(config):
    found = getattr(config, "_kthena_suite", None)
    if found is None:
        return
    folder, before = found
    shutil.rmtree(folder, ignore_errors=True)
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(params=[r.name for r in load_records()])
def cpu_profile(request, tmp_path):
    """(record, probe file) of each recorded CPU in turn (``kthena_core/cpu_records``)."""
    record = next(r for r in load_records() if r.name == request.param)
    return record, probe_file_of(record, tmp_path)


@contextlib.contextmanager
def _globals_restored():
    from mooncake_ops.dispatch import dispatch_state, restore_dispatch

    dispatch = dispatch_state()
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    environ = dict(os.environ)
    yield
    restore_dispatch(dispatch)
    if threads is not None and sys.modules["torch"].get_num_threads() != threads:
        sys.modules["torch"].set_num_threads(threads)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(autouse=True, scope="module")
def _process_globals_restored_per_file():
    """What a file's module fixtures change process-wide (an engine they build applies its
    kernel choice) is put back after the file: the next file starts where the first one did."""
    with _globals_restored():
        yield


@pytest.fixture(autouse=True)
def _process_globals_restored():
    """What a test changes process-wide is put back after it: the op dispatch table
    (`use_native`, `choose_impl`, which a kernel choice's ``apply`` sets), torch's thread count
    and ``os.environ``; the next test starts where the first one did, in any order."""
    with _globals_restored():
        yield


# ---- nothing left behind ---------------------------------------------------------------------
# Each pytest process that runs tests (each xdist worker, or pytest itself without xdist) checks
# at the end of its session that every process its tests started has ended and that every
# /dev/shm entry and `kthena-*` temp entry they made is gone. Its processes are its
# descendants and whatever carries this session's mark in its environment (set here, so an
# orphan whose parent was killed is still found); an entry is its own when the entry is new
# and its name holds the pid of one of those processes (the project names segments, pools and
# launcher folders after the creating pid), so what other sessions on the machine make is
# never counted. Leaks fail the run (an error in the last test's teardown, listing them), and
# are then killed and removed.
import re  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

_SESSION_MARK = "KTHENA_TEST_SESSION"
# interpreter helpers that live as long as the pytest process that started them
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
            "torch/_inductor/compile_worker")
_GRACE_S = 10.0  # for processes a test stopped without waiting, and their clean-up


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, start time) of every process."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            table[int(stat.parent.name)] = (int(fields[1]), fields[0], fields[19])
    return table


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


class _SessionProcesses:
    """What this session starts: a mark in the environment, a poll of /proc every half second
    (so pids of processes that made an entry and ended are known), and the entries at start."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.mark = f"{_SESSION_MARK}={self.pid}-{secrets.token_hex(4)}".encode() + b"\0"
        os.environ[_SESSION_MARK] = self.mark[len(_SESSION_MARK) + 1:-1].decode()
        self.seen: set[int] = {self.pid}
        self._unmarked: set[tuple[int, str]] = set()  # (pid, start) not ours, read once
        self.entries = self._entries()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="leak-check", daemon=True)
        self._poller.start()

    @staticmethod
    def _entries() -> set[Path]:
        temp = Path(tempfile.gettempdir())
        return set(Path("/dev/shm").glob("*")) | set(temp.glob("kthena-*"))

    def live(self) -> dict[int, str]:
        """pid -> command line of this session's processes still running (not zombies)."""
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        ours, todo = set(), [self.pid]
        while todo:  # descendants
            found = children.get(todo.pop(), [])
            ours.update(found)
            todo += found
        for pid in table.keys() - ours - {self.pid}:
            key = (pid, table[pid][2])
            if key in self._unmarked:
                continue
            if self.mark in _read(pid, "environ"):
                ours.add(pid)
            else:
                self._unmarked.add(key)
        self.seen |= ours
        found = {}
        for pid in ours:
            cmdline = _read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")
            if table[pid][1] != "Z" and not any(h in cmdline for h in _HELPERS):
                found[pid] = cmdline.strip()
        return found

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self.live()

    def left_entries(self) -> list[Path]:
        """New /dev/shm and kthena-* temp entries named with a pid of this session."""
        pids = {str(pid) for pid in self.seen}
        return sorted(p for p in self._entries() - self.entries
                      if pids & set(re.findall(r"[0-9]+", p.name)))

    def finish(self) -> str:
        """Stop polling; what is left (and, after listing it, kill and remove it)."""
        self._stop.set()
        self._poller.join()
        deadline = time.monotonic() + _GRACE_S
        while (self.live() or self.left_entries()) and time.monotonic() < deadline:
            time.sleep(0.2)
        processes, entries = self.live(), self.left_entries()
        for pid in processes:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for path in entries:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        lines = [f"  pid {pid}: {cmd[:160]}" for pid, cmd in sorted(processes.items())]
        lines += [f"  {path}" for path in entries]
        return "\n".join(lines)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind():
    """Fails the session (in this pytest worker) if its tests left processes or entries."""
    if not Path("/proc/self/stat").exists():  # not Linux: nothing to read
        yield
        return
    session = _SessionProcesses()
    yield
    left = session.finish()
    if left:
        pytest.fail(f"tests left these running or on disk (now killed / removed):\n{left}",
                    pytrace=False)
