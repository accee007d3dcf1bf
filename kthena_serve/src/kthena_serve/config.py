"""EngineConfig: every knob of one engine, validated once, as a frozen value.

Only the CLI (``kthena serve``) reads argv or the environment; it builds one of these and the
engine, runner and server take it explicitly.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["EngineConfig", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"2G"`` -> bytes.

    Raises:
        ValueError: an unknown unit or a non-positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size; write e.g. 1GiB, 512MiB or 2G")
        number, unit = float(match.group(1)), match.group(2).lower()
    num_bytes = int(number * _UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return num_bytes


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _optional_positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _one_of(*allowed: str):  # noqa: ANN202
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name}={value!r} is not supported; use one of "
                             f"{', '.join(map(repr, allowed))}")

    return check


_DTYPES = ("bfloat16", "float16", "float32")
_DEVICE = re.compile(r"^(cpu|cuda|npu)(:\d+)?$")


def _check_index(instance: object, attribute: attrs.Attribute, value: str) -> None:
    from mooncake_kv import available_indexes

    if value not in available_indexes():
        raise ValueError(f"prefix_index={value!r} is not a registered prefix index; use one of "
                         f"{', '.join(map(repr, available_indexes()))}")


def _check_hash(instance: object, attribute: attrs.Attribute, value: str) -> None:
    from mooncake_kv.hashing import get_hash_fn

    try:
        get_hash_fn(value)
    except Exception as error:  # the registry's own message lists the known names
        raise ValueError(f"hash_algorithm={value!r}: {error}") from None


def _check_kv_dtype(instance: EngineConfig, attribute: attrs.Attribute, value: str) -> None:
    _one_of("auto", *_DTYPES, "int8")(instance, attribute, value)
    if value == "int8":
        raise ValueError("kv_cache_dtype='int8' is not served yet: the engine's attention path "
                         "reads bf16/fp16/fp32 pools only (mooncake_ops has the int8 KV ops); "
                         "use 'auto'")
    if value not in ("auto", instance.dtype):
        raise ValueError(f"kv_cache_dtype={value!r} differs from dtype={instance.dtype!r}; the "
                         "attention kernels read the cache in the compute dtype, so use 'auto' "
                         "(or the same dtype)")


def _check_device(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _DEVICE.match(value):
        raise ValueError(f"device={value!r} is not a device; use 'cpu', 'cuda', 'cuda:N', "
                         "'npu' or 'npu:N'")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How one engine is built.

    Attributes:
        model: ``"default"`` (SmolLM2-135M-Instruct) or a Hugging Face checkpoint folder.
        dtype: weight and compute dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        device: where weights, KV pool and sampling live (``"cpu"``, ``"cuda[:N]"``,
            ``"npu[:N]"``); only CPU is verified on hardware.
        max_num_seqs: requests running at once (the decode batch size).
        max_num_batched_tokens: tokens one step may compute (prefill chunks + decodes).
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV pool (``"1GiB"`` also accepted).
        num_kv_blocks: exact pool size; overrides ``kv_cache_memory`` (tests use tiny pools).
        max_model_len: context length; default the model's, capped by the pool.
        enable_prefix_caching: reuse cached prompt blocks across requests.
        prefix_index: the KV manager's prefix index (``"hash"`` chain or ``"radix"`` tree).
        hash_algorithm: block-hash digest (``"xxh3_128"`` or ``"sha256"``; a deployment whose
            workers share an index must use one algorithm everywhere).
        kv_cache_dtype: KV pool dtype; ``"auto"`` is ``dtype`` (int8 is refused for now).
        tp: tensor-parallel degree (worker processes, one per core).
        num_threads: torch threads; default the cores this process may run on.
        max_n: largest ``n`` (choices per request) the server accepts.
        check_invariants: run the KV manager's self-check after every verb (tests).
        chat_special_tokens: ``"text"``: special tokens typed in chat content are encoded as
            text, so a user cannot forge a turn; ``"control"``: they act as control tokens.
    """

    model: str = "default"
    dtype: str = attrs.field(default="bfloat16", validator=_one_of(*_DTYPES))
    device: str = attrs.field(default="cpu", validator=_check_device)
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=1024, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    kv_cache_memory: int = attrs.field(default=1024**3, converter=parse_bytes)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_optional_positive)
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive)
    enable_prefix_caching: bool = True
    prefix_index: str = attrs.field(default="hash", validator=_check_index)
    hash_algorithm: str = attrs.field(default="xxh3_128", validator=_check_hash)
    kv_cache_dtype: str = attrs.field(default="auto", validator=_check_kv_dtype)
    tp: int = attrs.field(default=1, validator=_positive)
    num_threads: int | None = attrs.field(default=None, validator=_optional_positive)
    max_n: int = attrs.field(default=8, validator=_positive)
    check_invariants: bool = False
    chat_special_tokens: str = attrs.field(default="text", validator=_one_of("text", "control"))

    @property
    def torch_dtype(self):  # noqa: ANN201 - torch imported lazily
        import torch

        return getattr(torch, self.dtype)
