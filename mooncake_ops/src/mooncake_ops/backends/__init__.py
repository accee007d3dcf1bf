"""Implementations of the ops, one module per kind (reference, sdpa, native, npu).

Each function takes already-validated arguments; `mooncake_ops.dispatch` picks one per device.
"""
