"""PD settings: ``PDConfig`` and its enums, frozen values the launcher, workers and router share.

``Role`` and ``RouterWeights`` are every deployment's (cluster/config.py); re-exported here.
"""

from __future__ import annotations

import enum

import attrs

from kthena_serve.cluster.config import Role, RouterWeights, non_negative

__all__ = ["FailurePolicy", "KVPush", "PDConfig", "Role", "RouterWeights", "Transport"]


class FailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"  # the decode worker computes the prompt itself
    FAIL = "fail"  # the request fails with 503 and a body that says why


class KVPush(str, enum.Enum):
    LAYERWISE = "layerwise"  # each layer's blocks are put as soon as the layer has run
    BATCHED = "batched"  # one put of every block after the prefill


class Transport(str, enum.Enum):
    SHM = "shm"  # same host: prefill maps the decode pool and writes into it (zero copy)
    MOONCAKE = "mooncake"  # across hosts: prefill computes locally, then one-sided put


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class PDConfig:
    """How a PD deployment behaves; also the router's settings (``weights``,
    ``pd_threshold_tokens``, ``health_interval_s``: cluster/router.py ``RouterSettings``).

    Attributes:
        policy: what a failed handoff does (``recompute`` or ``fail``).
        transfer_timeout_s: a prefill + handoff not done by then has failed.
        transport: ``shm`` (same host, zero copy) or ``mooncake`` (one-sided put).
        kv_push: with ``mooncake``, put each layer's blocks while the prefill goes on
            (``layerwise``, the default) or all blocks after it (``batched``).
        pd_threshold_tokens: prompts whose uncached part is shorter skip disaggregation and
            run on the decode worker (llm-d's threshold idea); 0 disaggregates everything.
        weights: the router's score weights.
        health_interval_s: how often the router polls each worker's state.
        kv_pin_timeout_s: behind the Kthena router, how long a prefill worker keeps a
            prompt's blocks for the decode worker that is to pull them (then frees them).
    """

    policy: FailurePolicy = attrs.field(default=FailurePolicy.RECOMPUTE, converter=FailurePolicy)
    transfer_timeout_s: float = attrs.field(default=30.0, validator=non_negative)
    transport: Transport = attrs.field(default=Transport.SHM, converter=Transport)
    kv_push: KVPush = attrs.field(default=KVPush.LAYERWISE, converter=KVPush)
    pd_threshold_tokens: int = attrs.field(default=32, validator=non_negative)
    weights: RouterWeights = attrs.field(factory=RouterWeights)
    health_interval_s: float = attrs.field(default=0.5, validator=non_negative)
    kv_pin_timeout_s: float = attrs.field(default=120.0, validator=_positive)

    def to_json(self) -> dict:
        """Every field as JSON (what workers get); ``from_json`` reads it back."""
        return attrs.asdict(self, value_serializer=lambda _i, _a, v: getattr(v, "value", v))

    @classmethod
    def from_json(cls, fields: dict) -> PDConfig:
        """The config ``to_json`` wrote (or any subset of its fields: the rest default).

        Raises:
            ValueError: a refused value. TypeError: an unknown field.
        """
        fields = dict(fields)
        if isinstance(fields.get("weights"), dict):
            fields["weights"] = RouterWeights(**fields["weights"])
        return cls(**fields)
