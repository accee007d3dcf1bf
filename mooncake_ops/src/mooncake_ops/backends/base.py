"""What every device backend provides: the op names, one op's implementation, the protocol.

Its own module so that the backends (devices.py, npu.py) and the registry in
`mooncake_ops.dispatch`, which loads them, both import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs

__all__ = ["MC2_OPS", "MOE_DISTRIBUTE_OPS", "OP_NAMES", "DeviceBackend", "OpImpl"]

MC2_OPS = ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter")
MOE_DISTRIBUTE_OPS = ("moe_distribute_dispatch", "moe_distribute_combine")
OP_NAMES = ("write_kv", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
            "rotary_embedding", "silu_and_mul", "int8_linear", "gather_blocks", "scatter_blocks",
            *MC2_OPS, *MOE_DISTRIBUTE_OPS)


@attrs.frozen
class OpImpl:
    """One op's implementation on one device: the callable and a human name for reports."""

    fn: Callable[..., Any]
    name: str


class DeviceBackend(Protocol):
    """What a device type provides: an implementation of every op in `OP_NAMES`."""

    device_type: str

    def op_table(self, allow_native: bool) -> Mapping[str, OpImpl]: ...
