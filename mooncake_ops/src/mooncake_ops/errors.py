"""Exceptions raised by mooncake_ops.

Misuse is caught before any kernel runs and raised as one of these; each subclasses the builtin
that fits, so callers may catch either the specific class or the builtin. Messages say what was
wrong and what is allowed.
"""

from __future__ import annotations


class OpsShapeError(ValueError):
    """A tensor has the wrong rank or a dimension that disagrees with another argument."""


class OpsTypeError(TypeError):
    """An argument is not the Python type the op takes (a list where a tensor goes, ...)."""


class OpsDTypeError(TypeError):
    """A tensor has a dtype the op does not accept (or two tensors' dtypes disagree)."""


class OpsDeviceError(ValueError):
    """The arguments of one call live on different devices."""


class BlockTableError(ValueError):
    """A block table, slot mapping or length refers to cache that does not exist.

    Raised when a context is longer than its block table can hold, when a used block id or slot
    lies outside the cache, or when a length is negative.
    """


class ExpertParallelError(ValueError):
    """Experts cannot be split over an expert-parallel group as asked (the group size does not
    divide the experts), or routed ids name experts that do not exist."""


class UnsupportedDeviceError(LookupError):
    """No backend is registered for a device type."""


class NativeUnavailableError(ImportError):
    """Native kernels were requested explicitly but the extension is not built or not usable."""


class RopeScalingError(ValueError):
    """A ``rope_scaling`` dict names an unknown type or lacks a field that type needs."""
