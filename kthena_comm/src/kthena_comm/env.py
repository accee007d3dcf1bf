"""A rank's launch environment (torchrun-style), as an explicit value.

Library code takes a ``RankEnv``; only :meth:`RankEnv.from_env`, which the caller chooses to call,
reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``TORCHELASTIC_USE_AGENT_STORE`` (torchrun's agent already hosts the store on ``MASTER_PORT``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from kthena_comm.errors import RankEnvError


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise RankEnvError(attribute.name.upper(), str(value), "an int >= 0")


@attrs.frozen
class RankEnv:
    """Where this rank sits in the world and where the rendezvous master listens.

    Attributes:
        use_agent_store: the store at ``master_addr:master_port`` is already hosted by someone
            else (torchrun's agent, which says so with ``TORCHELASTIC_USE_AGENT_STORE=True``):
            every rank, rank 0 included, connects to it as a client instead of hosting one.
    """

    rank: int = attrs.field(validator=_non_negative)
    world_size: int = attrs.field()
    local_rank: int = attrs.field(default=0, validator=_non_negative)
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    use_agent_store: bool = False

    @world_size.validator
    def _check_world(self, attribute: attrs.Attribute, value: int) -> None:
        if value < 1 or self.rank >= value:
            raise RankEnvError("WORLD_SIZE", str(value), f"an int > RANK ({self.rank})")

    @property
    def address(self) -> str:
        """``host:port`` of the rendezvous master."""
        return f"{self.master_addr}:{self.master_port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """Read the torchrun variables from ``environ`` (default ``os.environ``).

        Raises:
            RankEnvError: a variable is missing or not an int; the message names it.
        """
        env = os.environ if environ is None else environ
        return cls(
            rank=_int_var(env, "RANK", None),
            world_size=_int_var(env, "WORLD_SIZE", None),
            local_rank=_int_var(env, "LOCAL_RANK", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_port_var(env),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",  # as torch reads it
        )


def _int_var(env: Mapping[str, str], name: str, default: int | None) -> int:
    raw = env.get(name)
    if raw is None and default is not None:
        return default
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RankEnvError(name, raw, "an integer (set by torchrun or kthena-run)") from None


def _port_var(env: Mapping[str, str]) -> int:
    port = _int_var(env, "MASTER_PORT", 29500)
    if not 0 < port < 65536:
        raise RankEnvError("MASTER_PORT", str(port), "a TCP port in 1..65535")
    return port
