"""tools/check_import_cycles.py finds cycles: run on throwaway packages, and Tarjan vs brute force.

If the checker stopped seeing cycles, `make lint` would pass on a tangled tree; these tests make
it fail on one it must catch (a two-module cycle closed by a function-level import, and a
three-module ring) and pass on a clean package.
"""

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

CHECKER = Path(__file__).resolve().parents[1] / "tools" / "check_import_cycles.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_import_cycles", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checker = load_checker()


def write_package(root: Path, name: str, modules: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text('"""Throwaway package for the cycle checker."""\n')
    for module, source in modules.items():
        (package / f"{module}.py").write_text(source)


def run_checker(root: Path, *packages: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, str(CHECKER), *packages], capture_output=True,
                          text=True, env=env, cwd=root, timeout=120)


def test_reports_every_cycle_and_fails(tmp_path):
    write_package(tmp_path, "tangled", {
        "a": "from tangled import b\n",
        "b": "def f():\n    from tangled import a\n    return a\n",  # deferred: still a cycle
        "c": "from tangled import a\n",  # imports into a cycle, is not part of one
        "x": "import tangled.y\n",
        "y": "from tangled.z import VALUE\n",
        "z": "from tangled import x\nVALUE = 1\n",
    })
    proc = run_checker(tmp_path, "tangled")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 import cycle(s)" in proc.stdout
    assert "[1] tangled.a, tangled.b\n" in proc.stdout
    assert "[2] tangled.x, tangled.y, tangled.z\n" in proc.stdout
    assert "tangled.b:2 -> tangled.a" in proc.stdout  # the import line that closes the cycle
    assert "tangled.c" not in proc.stdout


def test_passes_on_an_acyclic_package(tmp_path):
    write_package(tmp_path, "tidy", {
        "base": "VALUE = 1\n",
        "mid": "from tidy.base import VALUE\n",
        "top": "from tidy import base, mid\n\ndef f():\n    from tidy.mid import VALUE\n    return VALUE\n",
    })
    proc = run_checker(tmp_path, "tidy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no import cycles" in proc.stdout


def reaches(edges: set[tuple[int, int]], start: int) -> set[int]:
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        for a, b in edges:
            if a == node and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


@given(st.integers(1, 8).flatmap(
    lambda n: st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))).map(lambda e: (n, e))))
def test_components_match_brute_force(graph):
    num_nodes, edges = graph
    names = [f"m{i}" for i in range(num_nodes)]
    got = checker.strongly_connected(
        names, lambda name: {names[b] for a, b in edges if names[a] == name})
    reach = [reaches(edges, i) for i in range(num_nodes)]
    expected = set()
    for i in range(num_nodes):
        expected.add(tuple(sorted(names[j] for j in range(num_nodes) if j in reach[i] and i in reach[j])))
    assert sorted(map(tuple, got)) == sorted(expected)
    assert sorted(itertools.chain.from_iterable(got)) == sorted(names)  # a partition
