"""What the KV cache manager keeps per live request (``LiveRequest``: its block table, hash
chain and commit progress), and the guard every mutating verb runs
under (``mutating``: the manager's lock, the owner thread, the optional self-check)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from mooncake_kv.hashing import BlockChain
from mooncake_kv.types import BlockId, OwnerThreadError

__all__ = ["LiveRequest", "mutating"]

_F = TypeVar("_F", bound=Callable[..., Any])


class LiveRequest:
    """What the manager remembers about one live request."""

    __slots__ = (
        "block_ids",
        "chain",
        "is_allocated",
        "last_holder",
        "num_committed",
        "num_prompt_tokens",
        "num_tokens",
    )

    def __init__(self, chain: BlockChain | None, matched: list[BlockId], block_size: int,
                 num_prompt_tokens: int) -> None:
        self.chain = chain
        self.num_prompt_tokens = num_prompt_tokens  # tokens given to match_prefix
        self.block_ids = matched  # the block table, in token order
        self.num_tokens = len(matched) * block_size  # slots reserved
        self.num_committed = len(matched)  # full blocks already offered to the index
        self.last_holder: BlockId | None = matched[-1] if matched else None
        self.is_allocated = False


def mutating(verb: _F) -> _F:
    """Run ``verb`` under the manager lock, on the owner thread, then self-check if asked."""

    @functools.wraps(verb)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._owner != threading.get_ident():
                _claim_owner(self)
            result = verb(self, *args, **kwargs)
            if self._self_check:
                self.check_invariants()
            return result

    return wrapper  # type: ignore[return-value]


def _claim_owner(manager: Any) -> None:
    if manager._owner is not None:
        raise OwnerThreadError(
            f"KVCacheManager is owned by thread {manager._owner}, called from "
            f"{threading.get_ident()}; mutate it from one thread (release_owner hands over)"
        )
    manager._owner = threading.get_ident()
