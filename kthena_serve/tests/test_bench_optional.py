"""``kthena bench ...`` after a plain install: without transformers and matplotlib (the
``[bench]`` extra) every subcommand parses, ``bench serve`` runs without the transformers
baseline and without its plot, each said in one line on stderr, and prints its JSON; no
traceback anywhere.

"Not installed" is stood in for by a ``sitecustomize`` on the children's PYTHONPATH whose
meta-path finder refuses both packages with ``ModuleNotFoundError`` (importing them, or asking
``importlib.util.find_spec`` for them, fails as for a missing package).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import tiny_checkpoint

from kthena_serve.bench.optional import draw, is_available, plot_or_note

BLOCK = """
import sys

class _NotInstalled:
    blocked = ("transformers", "matplotlib")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""
SUBCOMMANDS = ("serve", "soak", "layouts", "kv", "trace")
MODULES = ("kthena_serve.bench.kv_move", "kthena_serve.bench.pd", "kthena_serve.bench.model",
           "kthena_serve.bench.grammar", "kthena_serve.bench.serve", "kthena_serve.bench.plot",
           "kthena_serve.bench.trace_report", "kthena_serve.bench.pd_plot")


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "block").mkdir(exist_ok=True)
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCK)
    return {**os.environ, "PYTHONPATH": str(tmp_path / "block"), "OMP_WAIT_POLICY": "PASSIVE"}


def _run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_the_stand_in_hides_both_packages(tmp_path):
    code = ("from kthena_serve.bench.optional import is_available as a\n"
            "print(a('transformers'), a('matplotlib'), a('torch'))\n"
            "import matplotlib\n")
    done = _run(["-c", code], _env(tmp_path))
    assert done.stdout.split() == ["False", "False", "True"]
    assert done.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'matplotlib'"


def test_every_bench_subcommand_and_module_loads_without_them(tmp_path):
    code = ("import importlib, sys\nfrom kthena_core.cli import main\n"
            f"for sub in {SUBCOMMANDS!r}:\n"
            "    try:\n        main(['bench', sub, '--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0, (sub, e.code)\n"
            f"for name in {MODULES!r}:\n    importlib.import_module(name)\n"
            "print('ok', file=sys.stderr)\n")
    done = _run(["-c", code], _env(tmp_path))
    assert done.returncode == 0 and done.stderr == "ok\n", done.stderr[-3000:]
    for sub in SUBCOMMANDS:
        assert f"usage: kthena bench {sub}" in done.stdout


def test_bench_serve_without_transformers_and_matplotlib_prints_its_json(tmp_path):
    model = tiny_checkpoint(tmp_path / "tiny")
    plot = tmp_path / "bench.png"
    done = _run(["-m", "kthena_core.cli", "bench", "serve", "--model", str(model), "--cases",
                 "a", "--runs", "1", "--dtype", "float32", "--kernels", "torch", "--threads",
                 "1", "--kv-cache-memory", "64MiB", "--plot", str(plot)],
                {**_env(tmp_path), "KTHENA_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    notes = [line for line in done.stderr.splitlines() if "is not installed" in line]
    assert notes == [
        "kthena bench serve: transformers is not installed: running without the transformers "
        "baseline (as with --no-hf); `pip install transformers` (or `pip install "
        "\"./kthena_serve[bench]\"`) adds it",
        f"kthena bench serve: matplotlib is not installed: the plot {plot} is skipped; `pip "
        "install matplotlib` (or `pip install \"./kthena_serve[bench]\"`) adds it"]
    result = json.loads(done.stdout)
    assert set(result["kthena"]) == {"a_batch1"} and result["kthena"]["a_batch1"]["ttft_s"] > 0
    assert "transformers" not in result and "plot" not in result and not plot.exists()


def test_a_plot_is_skipped_with_one_line(monkeypatch, capsys, tmp_path):
    assert plot_or_note("kthena bench kv", None) is None and capsys.readouterr().err == ""
    if is_available("matplotlib"):
        assert plot_or_note("kthena bench kv", "p.png") == "p.png"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert plot_or_note("kthena bench kv", "p.png") is None
    assert capsys.readouterr().err == (
        "kthena bench kv: matplotlib is not installed: the plot p.png is skipped; `pip install "
        "matplotlib` (or `pip install \"./kthena_serve[bench]\"`) adds it\n")


def test_a_plotter_that_fails_to_import_is_one_line(monkeypatch, capsys):
    from kthena_serve.bench.plot import save_figure

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert not draw("bench pd", lambda: save_figure(None, "x.png", "title"))
    assert capsys.readouterr().err.startswith("bench pd: matplotlib is not installed: the plot "
                                              "is skipped; `pip install matplotlib`")
    with pytest.raises(ZeroDivisionError):  # anything else is a real failure
        draw("bench pd", lambda: 1 / 0)
