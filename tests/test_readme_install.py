"""The README's pip recipe, as written, in a fresh venv; then structured output and a tool call.

The block of README.md's "Install with pip" section runs line for line under ``bash -eo
pipefail``, with ``HOME`` set to this test's folder (so ``~/kthena-env`` is a new venv made
here) and the working directory a copy of the five layer folders (a clone's, without the
``build/`` folders an earlier in-tree build leaves, and never shared with another test's pip
build). Then that venv's ``kthena serve`` answers a ``json_object`` request and a named tool
call (both need xgrammar, which imports transformers), and is stopped.

What must hold: every step succeeds, pip prints no ``ERROR:`` line (it prints one after an
install when an installed package's declared dependencies are missing), torch stays the pinned
CPU build, and no triton comes in.

pip's cache (``PIP_CACHE_DIR``) is kept in the dev venv (``.venv/kthena-test-cache/pip``:
``make clean`` removes it; never ``~/.cache``). On this project's machines it stays empty: pip
takes torch from ``/opt/wheels``, most wheels from a file:// mirror on local disk and the rest
(transformers, numpy ...) from PyPI, and pip 23.2 wrote no cache entry for them here. A run
costs 86 to 98 s on the 2 shared cores, the first as much as the next (69 to 81 s of it pip
unpacking torch, transformers and the rest; docs/measurements.md, "The test suite"). The
optional native build is not run (the README marks it optional).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _support import free_port

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kthena_core", "kthena_comm", "mooncake_kv", "mooncake_ops", "kthena_serve")
PIP_CACHE = Path(sys.prefix) / "kthena-test-cache" / "pip"
INSTALL_TIMEOUT_S = 1200  # a cold cache downloads torch and about 40 other wheels
SERVE_TIMEOUT_S = 300
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


def readme_recipe() -> str:
    """The first ```sh block of README.md's "Install with pip" section."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Install with pip", 1)[1].split("\n## ", 1)[0]
    return re.search(r"^```sh\n(.*?)^```$", section, re.S | re.M).group(1)


def clone_layers(folder: Path) -> Path:
    """The five layer folders copied into ``folder`` as a fresh clone has them."""
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, folder / layer, ignore=ignore)
    return folder


def recipe_env(home: Path) -> dict[str, str]:
    # PIP_NO_COMPILE: no byte-compiling of every installed module (torch's, transformers'):
    # Python compiles what it imports anyway; what is installed is the same.
    env = {**os.environ, "HOME": str(home), "PIP_CACHE_DIR": str(PIP_CACHE),
           "PIP_NO_COMPILE": "1", "PIP_PROGRESS_BAR": "off", "PYTHONUNBUFFERED": "1"}
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "KTHENA_API_KEY"):
        env.pop(name, None)
    # `python3` is the machine's, as for a reader, not this test's venv
    dev_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and p != dev_bin)
    return env


@pytest.mark.slow
def test_readme_recipe_in_a_fresh_venv_serves_json_and_tool_calls(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = recipe_env(home)
    clone = clone_layers(tmp_path / "clone")
    start = time.monotonic()
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", readme_recipe()], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "ERROR" not in out, [line for line in out.splitlines() if "ERROR" in line]
    print(f"README recipe: {took:.0f} s (pip cache {PIP_CACHE})")

    venv_bin = home / "kthena-env" / "bin"
    listed = subprocess.run([str(venv_bin / "python"), "-m", "pip", "list", "--format=json"],
                            env=env, capture_output=True, text=True, check=True).stdout
    versions = {p["name"].lower(): p["version"] for p in json.loads(listed)}
    assert versions["torch"] == "2.13.0+cpu"
    assert "triton" not in versions and "transformers" in versions
    assert versions["xgrammar"] == "0.2.8"
    for layer in LAYERS:
        assert layer.replace("_", "-") in versions, layer

    server = Server(venv_bin / "kthena", env, tmp_path)
    try:
        url = server.start()
        answer_json_object(url)
        answer_named_tool_call(url)
    finally:
        server.stop()


def answer_json_object(url: str) -> None:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 96, "temperature": 0,
        "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "Reply with a JSON object with one key, "
                      "answer, whose value is yes or no. Is Paris in France?"}]})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict), choice
    print(f"json_object: {choice['message']['content']}")


def answer_named_tool_call(url: str) -> None:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 96, "temperature": 0,
        "tools": [WEATHER], "tool_choice": {"type": "function",
                                            "function": {"name": "get_weather"}},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    print(f"tool call: get_weather({arguments})")


class Server:
    """The fresh venv's ``kthena serve`` in a session of its own: started up to its curl line,
    stopped with SIGTERM, and killed with its whole group if it outlives a minute."""

    def __init__(self, kthena: Path, env: dict[str, str], folder: Path) -> None:
        self.argv = [str(kthena), "serve", "--port", str(free_port())]
        self.env, self.folder = env, folder
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.log = self.folder / "serve.log"
        with open(self.log, "wb") as log:  # a file, not a pipe: a full pipe would block it
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.folder, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = re.search(r"^curl (\S+)", self.output(), re.M)
            if found:
                return found.group(1).rsplit("/v1/", 1)[0]
            time.sleep(0.5)
        raise AssertionError(f"kthena serve printed no curl line:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its group left
            except ProcessLookupError:
                pass
            self.proc.wait()
