"""Lazy package exports: a package's public names load from their modules on first use, so
importing the package stays cheap (no torch until a name that needs it is used). Used by
kthena_comm and kthena_serve, whose packages export that way."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str],
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose name ``N`` lives in
    ``package.exports[N]``.

    Example (in a package's ``__init__.py``)::

        __getattr__, __dir__ = lazy_exports(__name__, {"LLM": "llm"})
    """
    names = sorted(exports)

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def dir_() -> list[str]:
        return list(names)

    return getattr_, dir_
