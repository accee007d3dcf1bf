"""EngineClient: the one seam the OpenAI app, its metrics and the CLI talk to.

::

    server/app.py, server/metrics.py, cli.py
                 │  EngineClient: processor (InputProcessor: limits · encode(_chat) · decode
                 │                · check · token_bytes · token_strs)
                 │                · check_admission · generate · abort(_all) · stats
                 │                · is_alive
       ┌─────────┴──────────────┬───────────────────────────┐
    AsyncLLM (in process)     RemoteEngine (PD router)    PrefillEngine (a PD prefill worker)

Every implementation validates with an ``InputProcessor``, so a request gets the same answer
whichever serves it (its ``EngineLimits`` are built in input_processor.py only: ``for_engine``,
``combine``). ``EngineStats`` (engine/stats.py) is plain data: a PD router sums its workers'.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.engine.stats import EngineStats

if TYPE_CHECKING:
    from kthena_serve.engine.input_processor import InputProcessor

__all__ = ["EngineClient", "KVConnector", "KVSession"]

@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP app needs of an engine, in process or remote: its input processor (the
    one place requests are tokenised and checked), whether it is alive, and five verbs."""

    @property
    def processor(self) -> InputProcessor:
        """Tokenise, render chat, detokenise, check against ``processor.limits``."""
        ...

    @property
    def is_alive(self) -> bool: ...

    def check_admission(self, requests: Sequence[EngineRequest]) -> None:
        """Queue one API call's validated requests, or refuse them all at once when the queue
        is past its bound (``kthena_serve.engine.admission``); called before anything streams.

        Raises:
            OverloadedError: past the bound (the app answers 503 with ``Retry-After``).
        """
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a validated request's outputs; leaving early aborts it."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request wherever it is: one admitted (``check_admission``) that never
        streamed gives its queue place back; a running one stops."""
        ...

    def abort_all(self, message: str) -> None:
        """End every request in flight; each stream fails with ``EngineDeadError(message)``."""
        ...

    def stats(self) -> EngineStats: ...


class KVSession(Protocol):
    """One request's side of ``kv_transfer_params``: its outputs, then the object to answer."""

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (the request ``KVConnector.open`` was given)."""
        ...

    def response_params(self) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of the answer, once the last output is out (or None)."""
        ...


@runtime_checkable
class KVConnector(Protocol):
    """A PD worker's side of the Kthena router's ``nixl`` / ``mooncake`` connectors.

    The OpenAI app hands it a request's ``kv_transfer_params`` before anything streams, so a
    refusal is a clean 400 (kthena_serve.pd.prefill_connector / decode_connector implement it).
    """

    async def open(self, params: Mapping[str, Any], request: EngineRequest, *,
                   stream: bool) -> KVSession | None:
        """Check ``params`` for ``request`` and prepare it; None: a plain request after all.

        Raises:
            InvalidRequestError: params this worker refuses (the app answers 400).
            EngineDeadError: the KV cannot be had and the policy says fail (503).
        """
        ...
