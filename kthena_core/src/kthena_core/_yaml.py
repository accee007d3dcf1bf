"""Reading a YAML file (or taking an already-parsed mapping) with errors that name the file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

__all__ = ["read_yaml"]


def read_yaml(source: str | os.PathLike[str] | Mapping[str, Any], error: type[Exception],
              what: str) -> tuple[Any, str | None]:
    """``(data, folder of the file)``; a mapping is returned as is, with no folder.

    Raises:
        error: the file is missing (``"{what} not found: PATH"``) or not valid YAML.
    """
    if isinstance(source, Mapping):
        return source, None
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML: {e}") from None
    return data, os.path.dirname(os.path.abspath(path))
