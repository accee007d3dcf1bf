"""Backend registry, capability report, native switch and the npu adapter's import hygiene."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import mooncake_ops as mo
from mooncake_ops import dispatch
from mooncake_ops.backends import native


def test_capabilities_list_every_op_per_device_and_npu_as_unverified():
    rows = mo.capabilities()
    devices = {r.device_type for r in rows}
    assert {"cpu", "cuda", "npu"} <= devices
    for device in devices:
        assert {r.op for r in rows if r.device_type == device} == set(dispatch.OP_NAMES)
    assert all(r.status == "unverified on hardware" for r in rows if r.device_type == "npu")
    assert all(r.status == "tested" for r in rows if r.device_type == "cpu")


def test_importing_and_reporting_never_loads_torch_npu():
    code = ("import sys, mooncake_ops as mo; mo.capabilities(); "
            "assert 'torch_npu' not in sys.modules and 'mooncake_ops.backends.npu' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_device_type_raises():
    with pytest.raises(mo.UnsupportedDeviceError, match="registered"):
        dispatch.impl("write_kv", "xpu-unknown")


def test_use_native_switches_the_table():
    previous = mo.use_native(False)
    try:
        assert mo.implementation_name("paged_decode_attention", "cpu") == "torch-reference"
        mo.use_native(True)
        expected = "native-cpp" if native.is_available() else "torch-reference"
        assert mo.implementation_name("paged_decode_attention", "cpu") == expected
    finally:
        mo.use_native(previous)


def test_strict_native_request_fails_clearly_when_absent():
    if native.is_available():
        assert mo.use_native(True, strict=True) in (True, False)
    else:  # not built (how to build it), or built for a CPU this one is not (what it lacks)
        reason = native.unavailable_reason()
        assert "pip install" in reason or "the kernels need AVX512" in reason
        with pytest.raises(mo.NativeUnavailableError, match=re.escape(reason)):
            mo.use_native(True, strict=True)


def test_a_registered_backend_is_used_for_its_device_type():
    calls = []

    class Fake:
        device_type = "cpu"

        def op_table(self, allow_native):
            from mooncake_ops.backends.devices import CpuBackend
            table = dict(CpuBackend().op_table(False))
            table["silu_and_mul"] = dispatch.OpImpl(lambda x: calls.append(x) or x, "fake")
            return table

    original = dispatch._REGISTRY["cpu"]
    dispatch.register_backend(dispatch.BackendEntry("cpu", Fake, lambda _: {}, "tested"))
    try:
        mo.silu_and_mul(torch.zeros(2, 4))
        assert len(calls) == 1 and mo.implementation_name("silu_and_mul", "cpu") == "fake"
    finally:
        dispatch.register_backend(original)
