"""Mooncake's ascend_direct transport (Mooncake's path to CANN HIXL/ADXL): config and set-up.

The transport reads its settings from the process environment when the engine initialises
(Mooncake docs, "Ascend Direct Transport"), so the engine writes them from this explicit config,
in this order, before anything of Mooncake's runs::

    1. refuse at once if the wheel has no ascend_direct transport (see _mooncake_build.py)
    2. environment: ASCEND_CONNECT_TIMEOUT / ASCEND_TRANSFER_TIMEOUT (ms),
       ASCEND_USE_ASYNC_TRANSFER (CANN 8.5+ only), HCCL_INTRA_ROCE_ENABLE,
       MC_TRANSFER_TIMEOUT (s; read by the TransferEngine constructor, kept > the transfer timeout)
    3. select the NPU (torch.npu.set_device), which Mooncake requires before initialize()
    4. TransferEngine(); initialize(host, "P2PHANDSHAKE", "ascend", "")

The local host name is the bare host, as vllm-ascend passes it for ascend_direct; the
``host:port:npu_N`` form belongs to the older HCCL-based ``ascend`` transport (-DUSE_ASCEND),
which this backend does not drive. A value already in the environment that differs from the
config is an error rather than silently overwritten: two sources for one setting disagree.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, MutableMapping

import attrs

__all__ = ["AscendDirectConfig", "apply_environment", "ascend_environment",
           "mc_transfer_timeout_s"]

_MIN_ASYNC_CANN = (8, 5)


def _cann_version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"cann_version {text!r}: expected 'MAJOR.MINOR...' such as '8.5.0'")
    return int(match.group(1)), int(match.group(2))


@attrs.frozen
class AscendDirectConfig:
    """Settings of Mooncake's ascend_direct transport for one engine (one NPU).

    Attributes:
        device_id: the NPU this engine uses (set as the current device before initialise).
        connect_timeout_ms: ASCEND_CONNECT_TIMEOUT, link set-up deadline.
        transfer_timeout_ms: ASCEND_TRANSFER_TIMEOUT, per-transfer deadline inside the transport
            (Mooncake's default is 10 s; 5 s here so that it, and MC_TRANSFER_TIMEOUT above it,
            both end before MooncakeConfig.timeout_s, the engine's own deadline).
        use_async_transfer: ASCEND_USE_ASYNC_TRANSFER=1 (HIXL async mode); needs CANN 8.5+.
        intra_roce: HCCL_INTRA_ROCE_ENABLE=1, RDMA instead of HCCS inside an A2 server / A3
            supernode.
        cann_version: the installed CANN version (``cat $ASCEND_HOME_PATH/version.info``);
            required when ``use_async_transfer`` is set.
    """

    device_id: int = attrs.field(validator=attrs.validators.ge(0))
    connect_timeout_ms: int = attrs.field(default=10_000, validator=attrs.validators.gt(0))
    transfer_timeout_ms: int = attrs.field(default=5_000, validator=attrs.validators.gt(0))
    use_async_transfer: bool = False
    intra_roce: bool = False
    cann_version: str | None = None

    def __attrs_post_init__(self) -> None:
        version = _cann_version(self.cann_version)
        if self.use_async_transfer and (version is None or version < _MIN_ASYNC_CANN):
            raise ValueError(f"use_async_transfer (ASCEND_USE_ASYNC_TRANSFER) needs CANN 8.5 or "
                             f"later; cann_version is {self.cann_version!r}. Set cann_version "
                             "to the installed CANN, or leave async transfer off")

    @property
    def transfer_timeout_s(self) -> float:
        return self.transfer_timeout_ms / 1000


def mc_transfer_timeout_s(config: AscendDirectConfig) -> int:
    """MC_TRANSFER_TIMEOUT for ``config``: whole seconds, at least 5 (Mooncake's floor), and
    strictly greater than ASCEND_TRANSFER_TIMEOUT, as Mooncake asks: otherwise a timed-out
    transfer may still be writing into the buffer."""
    return max(5, math.floor(config.transfer_timeout_s) + 1)


def ascend_environment(config: AscendDirectConfig) -> dict[str, str]:
    """The environment the transport reads, from ``config`` (a pure function)."""
    env = {
        "ASCEND_CONNECT_TIMEOUT": str(config.connect_timeout_ms),
        "ASCEND_TRANSFER_TIMEOUT": str(config.transfer_timeout_ms),
        "MC_TRANSFER_TIMEOUT": str(mc_transfer_timeout_s(config)),
    }
    if config.use_async_transfer:
        env["ASCEND_USE_ASYNC_TRANSFER"] = "1"
    if config.intra_roce:
        env["HCCL_INTRA_ROCE_ENABLE"] = "1"
    return env


def apply_environment(wanted: Mapping[str, str], environ: MutableMapping[str, str] | None = None
                      ) -> None:
    """Write ``wanted`` into ``environ`` (default ``os.environ``).

    Raises:
        ValueError: a variable is already set to a different value; names both values.
    """
    env = os.environ if environ is None else environ
    clashes = [f"{k}={env[k]!r} (config wants {v!r})" for k, v in sorted(wanted.items())
               if k in env and env[k] != v]
    if clashes:
        raise ValueError("the environment already sets " + ", ".join(clashes) + "; unset "
                         "those variables or make AscendDirectConfig agree with them")
    env.update(wanted)
