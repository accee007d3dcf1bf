"""Workload: the request shape a plan is made for (prompt/output lengths, concurrency, SLOs)."""

from __future__ import annotations

from typing import Any

import attrs

from kthena_core.dtypes import canonical_dtype

MODES = ("colocated", "pd")
OBJECTIVES = ("throughput", "latency")


class WorkloadError(ValueError):
    """A workload field is out of range; the message names the field and what is allowed."""


def _positive(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise WorkloadError(f"workload {attribute.name} must be > 0, got {value!r}")


def _choice(options: tuple[str, ...]):
    def check(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in options:
            raise WorkloadError(f"workload {attribute.name}={value!r}; allowed: {', '.join(options)}")

    return check


def _fraction(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise WorkloadError(f"workload {attribute.name} must be in [0, 1), got {value!r}")


def _optional_positive(_inst: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value <= 0:
        raise WorkloadError(f"workload {attribute.name} must be > 0 or unset, got {value!r}")


@attrs.frozen
class Workload:
    """What the deployment must serve.

    Attributes:
        prompt_len: tokens per prompt.
        output_len: generated tokens per request.
        concurrency: sequences decoding at once across the whole deployment.
        dtype: weight and activation dtype (int8 / int4 / fp8: the weights' storage, computed
            in bf16); kv_dtype: KV-cache dtype.
        mode: "colocated" (prefill and decode share instances) or "pd" (disaggregated).
        objective: "throughput" (max output tokens/s) or "latency" (min TTFT + output x TPOT).
        prefix_hit_rate: fraction of prompt tokens expected from the prefix cache.
        ttft_slo_s / tpot_slo_s: optional limits; candidates predicted to miss them are infeasible.
    """

    prompt_len: int = attrs.field(default=1024, validator=_positive)
    output_len: int = attrs.field(default=256, validator=_positive)
    concurrency: int = attrs.field(default=32, validator=_positive)
    dtype: str = attrs.field(default="bf16", converter=canonical_dtype)
    kv_dtype: str = attrs.field(default="bf16", converter=canonical_dtype)
    mode: str = attrs.field(default="colocated", validator=_choice(MODES))
    objective: str = attrs.field(default="throughput", validator=_choice(OBJECTIVES))
    prefix_hit_rate: float = attrs.field(default=0.0, validator=_fraction)
    ttft_slo_s: float | None = attrs.field(default=None, validator=_optional_positive)
    tpot_slo_s: float | None = attrs.field(default=None, validator=_optional_positive)

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.output_len

    @classmethod
    def parse(cls, text: str) -> Workload:
        """Parse ``"prompt_len=2048,output_len=128,concurrency=16,mode=pd"`` (short keys allowed).

        Raises:
            WorkloadError: unknown key or bad value.
        """
        aliases = {"prompt": "prompt_len", "output": "output_len", "batch": "concurrency",
                   "ttft_slo": "ttft_slo_s", "tpot_slo": "tpot_slo_s", "hit_rate": "prefix_hit_rate"}
        fields = {f.name: f for f in attrs.fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = aliases.get(key.strip(), key.strip())
            if not sep or key not in fields:
                raise WorkloadError(f"bad workload item {part!r}; expected key=value with key in {', '.join(fields)}")
            values[key] = _convert(key, raw.strip(), fields[key])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _convert(key: str, raw: str, field: attrs.Attribute) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "str")
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise WorkloadError(f"workload {key}={raw!r} is not a number") from None
    return raw
