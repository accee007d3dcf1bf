"""Worker roles and the router's score weights: the values every deployment of workers shares.

PD (``pd/config.py``, which re-exports both beside ``PDConfig``) and the data-parallel
replicas of ``kthena serve --dp`` name their workers' roles with ``Role`` and weigh the router's
score (cluster/router.py) with ``RouterWeights``.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["Role", "RouterWeights", "non_negative", "worker_names"]


class Role(str, enum.Enum):
    COLOCATED = "colocated"  # prefill and decode in one engine (the plain server, a DP replica)
    PREFILL = "prefill"  # computes prompt KV into blocks a decode worker owns
    DECODE = "decode"  # owns the KV pool, admits prefilled requests, streams tokens


def worker_names(num_prefill: int, num_decode: int) -> list[str]:
    """A PD deployment's workers' names, ``prefill-0``.. then ``decode-0``.. (also in their KV
    events' owner names: ``KVEventsConfig.for_worker``)."""
    return ([f"prefill-{i}" for i in range(num_prefill)]
            + [f"decode-{i}" for i in range(num_decode)])


def non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    """An attrs validator: ``value`` >= 0.

    Raises:
        ValueError: names the field and the value.
    """
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class RouterWeights:
    """Score = overlap * prefix blocks fraction - load * (running + waiting) - kv * usage.

    Kthena's score-plugin idea: each term is normalised to [0, 1] before weighting.
    """

    overlap: float = attrs.field(default=1.0, validator=non_negative)
    load: float = attrs.field(default=0.5, validator=non_negative)
    kv_usage: float = attrs.field(default=0.25, validator=non_negative)

    @classmethod
    def parse(cls, text: str) -> RouterWeights:
        """``"overlap,load,kv_usage"`` (``--router-weights``).

        Raises:
            ValueError: not three numbers >= 0.
        """
        try:
            overlap, load, kv_usage = (float(x) for x in text.split(","))
            return cls(overlap=overlap, load=load, kv_usage=kv_usage)
        except ValueError as error:
            raise ValueError(f"takes overlap,load,kv_usage as three numbers >= 0 (default "
                             f"1.0,0.5,0.25), got {text!r} ({error})") from None
