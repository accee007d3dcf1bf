"""PD settings: ``PDConfig`` and its enums, frozen values the launcher, workers and router share.

``Role`` and ``RouterWeights`` are every deployment's (cluster/config.py); re-exported here.
"""

from __future__ import annotations

import enum

import attrs

from kthena_serve.cluster.config import Role, RouterWeights, non_negative

__all__ = ["NOT_WIRED", "SAME_HOST_DEVICES", "FailurePolicy", "KVPush", "PDConfig", "PoolShareError", "Role",
           "RouterWeights", "Transport"]


class FailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"  # the decode worker computes the prompt itself
    FAIL = "fail"  # the request fails with 503 and a body that says why


class KVPush(str, enum.Enum):
    LAYERWISE = "layerwise"  # each layer's blocks are put as soon as the layer has run
    BATCHED = "batched"  # one put of every block after the prefill


class Transport(str, enum.Enum):
    SHM = "shm"  # same host: prefill maps the decode pool and writes into it (zero copy)
    MOONCAKE = "mooncake"  # across hosts: prefill computes locally, then one-sided put


class PoolShareError(ValueError):
    """A pool that cannot be shared or opened here; the message says why and what to use."""


SAME_HOST_DEVICES = ("cpu", "cuda")  # device types whose pool another process opens (pool_share)
NOT_WIRED = {  # device type -> why its decode pool cannot be opened by another process
    "npu": ("the same-host route is not wired on npu: torch has no released IPC for NPU "
            "memory (an IPC route for PrivateUse1 devices such as torch_npu is an open PyTorch "
            "RFC); use --pd-transport mooncake (Mooncake's ascend_direct transport, "
            "unverified on hardware), or --device cpu / cuda"),
}


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
        prefill_tp, decode_tp: each role's TP size (0: the engine's ``tp``); a TP worker's
            ranks each hold their own KV heads' pool, and the hand-off re-shards the heads
            between the two sizes (pd/reshard.py over ``shm``, pd/reshard_put.py over
            ``mooncake``; over ``shm`` a TP pair's ``kv_push`` is honoured, its ranks copying
            their heads layer by layer; over ``mooncake`` it is batched).
    """

    policy: FailurePolicy = attrs.field(default=FailurePolicy.RECOMPUTE, converter=FailurePolicy)
    transfer_timeout_s: float = attrs.field(default=30.0, validator=non_negative)
    transport: Transport = attrs.field(default=Transport.SHM, converter=Transport)
    kv_push: KVPush = attrs.field(default=KVPush.LAYERWISE, converter=KVPush)
    pd_threshold_tokens: int = attrs.field(default=32, validator=non_negative)
    weights: RouterWeights = attrs.field(factory=RouterWeights)
    health_interval_s: float = attrs.field(default=0.5, validator=non_negative)
    kv_pin_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    prefill_tp: int = attrs.field(default=0, validator=non_negative)
    decode_tp: int = attrs.field(default=0, validator=non_negative)

    def role_tp(self, role: str, engine_tp: int) -> int:
        """The TP size of ``role``'s workers (``prefill`` or ``decode``): its own, else the
        engine's."""
        own = self.prefill_tp if role == "prefill" else self.decode_tp
        return own or engine_tp

    @staticmethod
    def check_device(device: str, transport: Transport | str) -> None:
        """Refuse a PD deployment whose pools the hand-off cannot reach on ``device``.

        cpu: shm (same host) or mooncake; cuda: shm (CUDA IPC, same host) or mooncake (device
        memory registered with a CUDA build of Mooncake); npu: mooncake only (ascend_direct).
        Anything else is refused.

        Raises:
            PoolShareError: the device type is not wired for PD, with the reason.
        """
        try:
            route = Transport(transport)
        except ValueError:
            return  # PDConfig refuses it with its own message
        kind = device.partition(":")[0]
        if kind == "npu" and route is Transport.MOONCAKE:
            return
        if kind in NOT_WIRED:
            raise PoolShareError(f"--mode pd --device {device} --pd-transport {route.value}: "
                                 f"{NOT_WIRED[kind]}")
        if kind not in SAME_HOST_DEVICES:
            raise PoolShareError(f"--mode pd --device {device}: no PD pool route for {kind!r}; "
                                 "run PD with --device cpu or cuda")

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
