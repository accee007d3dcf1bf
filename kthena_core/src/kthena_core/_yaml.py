"""Reading a YAML (or JSON) file, or taking an already-parsed mapping, with errors that name the
file."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import yaml

__all__ = ["read_file", "read_yaml"]


def read_file(path: str, parse: Callable[[TextIO], Any], error: type[Exception], what: str,
              syntax: str, invalid: type[Exception]) -> Any:
    """``parse`` of the file at ``path``.

    Raises:
        error: the file is missing (``"{what} not found: PATH"``), or ``parse`` raised
            ``invalid`` (``"PATH is not valid {syntax}: ..."``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except invalid as e:
        raise error(f"{path} is not valid {syntax}: {e}") from None


def read_yaml(source: str | os.PathLike[str] | Mapping[str, Any], error: type[Exception],
              what: str) -> tuple[Any, str | None]:
    """``(data, folder of the file)``; a mapping is returned as is, with no folder.

    Raises:
        error: the file is missing (``"{what} not found: PATH"``) or not valid YAML.
    """
    if isinstance(source, Mapping):
        return source, None
    path = os.fspath(source)
    data = read_file(path, yaml.safe_load, error, what, "YAML", yaml.YAMLError)
    return data, os.path.dirname(os.path.abspath(path))
