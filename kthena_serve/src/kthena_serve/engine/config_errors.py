"""``ConfigError`` and the field checks ``EngineConfig`` and ``ParallelConfig`` share."""

from __future__ import annotations

import attrs

__all__ = ["ConfigError", "is_bool", "is_int", "optional_positive", "positive"]


class ConfigError(ValueError):
    """An ``EngineConfig`` field holds a value the engine cannot honour.

    The message reads ``EngineConfig.<field> must be <what it takes> (got <value>)``, with a
    hint after it where the reason is not obvious.

    Attributes:
        field: the field's name (the CLI turns it into its flag).
    """

    def __init__(self, field: str, requirement: str, value: object, hint: str = "") -> None:
        message = f"EngineConfig.{field} must be {requirement} (got {value!r})"
        super().__init__(f"{message}; {hint}" if hint else message)
        self.field = field


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(attribute.name, "a positive int", value)


def optional_positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ConfigError(attribute.name, "a positive int or None", value)


def is_bool(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, "True or False", value)
