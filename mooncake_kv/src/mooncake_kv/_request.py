"""What the KV cache manager keeps per live request (``LiveRequest``: its block table, hash
chain and commit progress), the table of live and recently freed requests that names each
misuse (``RequestTable``), and the guard every mutating verb runs under (``mutating``: the
manager's lock, the owner thread, the optional self-check)."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from mooncake_kv.hashing import BlockChain
from mooncake_kv.types import (
    BlockId,
    DoubleFreeError,
    DuplicateRequestError,
    OwnerThreadError,
    RequestFinishedError,
    RequestId,
    UnknownRequestError,
)

__all__ = ["LiveRequest", "RequestTable", "mutating"]

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


class RequestTable:
    """The live requests by id, and the last ``max_finished`` freed ids: enough to tell a verb
    after ``free`` or a second ``free`` from an id that was never matched."""

    __slots__ = ("_finished", "_live", "_max_finished")

    def __init__(self, max_finished: int) -> None:
        self._live: dict[RequestId, LiveRequest] = {}
        self._finished: OrderedDict[RequestId, None] = OrderedDict()
        self._max_finished = max_finished

    def __len__(self) -> int:
        return len(self._live)

    def items(self) -> Iterator[tuple[RequestId, LiveRequest]]:
        return iter(self._live.items())

    def check_new(self, request_id: RequestId) -> None:
        """Raise DuplicateRequestError if ``request_id`` is live."""
        if request_id in self._live:
            raise DuplicateRequestError(
                request_id,
                f"request {request_id!r} is already live; free it before matching it again",
            )

    def add(self, request_id: RequestId, request: LiveRequest) -> None:
        self._finished.pop(request_id, None)
        self._live[request_id] = request

    def live(self, request_id: RequestId) -> LiveRequest:
        """The live request; RequestFinishedError after ``free``, else UnknownRequestError."""
        request = self._live.get(request_id)
        if request is not None:
            return request
        if request_id in self._finished:
            raise RequestFinishedError(
                request_id,
                f"request {request_id!r} was freed; register it again with match_prefix",
            )
        raise UnknownRequestError(
            request_id, f"unknown request {request_id!r}; call match_prefix first"
        )

    def finish(self, request_id: RequestId) -> LiveRequest:
        """Remove the live request and remember its id as freed.

        Raises:
            DoubleFreeError: already freed.  UnknownRequestError: never registered.
        """
        request = self._live.pop(request_id, None)
        if request is None:
            if request_id in self._finished:
                raise DoubleFreeError(
                    request_id, f"request {request_id!r} was already freed; free it only once"
                )
            raise UnknownRequestError(
                request_id, f"unknown request {request_id!r}; only live requests can be freed"
            )
        self._finished[request_id] = None
        if len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)
        return request


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
