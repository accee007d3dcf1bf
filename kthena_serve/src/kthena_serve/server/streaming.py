"""The streamed side of the OpenAI routes: server-sent events (``sse_response``: one ``data:``
line per chunk, ``[DONE]`` last, an error after the headers as an in-band error event), the
first output ahead of the rest (``after_head``: the headers wait for it), and what a chunk
carries beyond its text: the logprobs of steps that sent no chunk (``PendingLogprobs``), vLLM's
``return_token_ids`` deltas (``TokenIdDeltas``) and tool-call deltas parsed from a choice's text
(``ToolDeltas``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from kthena_serve.engine.errors import EngineDeadError, OverloadedError, RequestFailedError
from kthena_serve.engine.logprobs import TokenLogprobs
from kthena_serve.engine.request import RequestOutput
from kthena_serve.server.errors import OVERLOADED, ApiError, error_body
from kthena_serve.server.generation import Job
from kthena_serve.server.protocol import ChatCompletionRequest, RequestCommon
from kthena_serve.server.responses import tool_reason, with_token_ids
from kthena_serve.server.tool_parsers import DEFAULT_PARSER, FORMATS, ToolParser

__all__ = ["PendingLogprobs", "TokenIdDeltas", "ToolDeltas", "after_head", "max_tool_calls",
           "sse_response"]

log = logging.getLogger(__name__)


def max_tool_calls(body: ChatCompletionRequest) -> int | None:
    """The most tool calls one choice may make (``parallel_tool_calls: false``: 1)."""
    return 1 if body.parallel_tool_calls is False else None


class ToolDeltas:
    """The stream's tool-call side: each choice's text through a parser of ``parser``'s
    format (tool_parsers/) into content and OpenAI's ``tool_calls`` deltas (a call's first with
    ``index``, ``id``, ``type``, ``function.name``; then ``index`` and ``function.arguments``
    fragments)."""

    def __init__(self, body: RequestCommon, parser: str = DEFAULT_PARSER) -> None:
        self.enabled = isinstance(body, ChatCompletionRequest) and body.parses_tool_calls
        self._max_calls = max_tool_calls(body) if self.enabled else None
        self._format = FORMATS[parser]
        self._parsers: dict[int, ToolParser] = {}

    def delta(self, choice: int, out: RequestOutput) -> tuple[dict, str | None]:
        """(delta, finish reason) of one output of ``choice``."""
        parser = self._parsers.get(choice)
        if parser is None:
            parser = self._parsers[choice] = self._format.parser(self._max_calls)
        content, calls = parser.feed(out.new_text)
        if out.finished:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        reason = out.finish_reason.value if out.finish_reason else None
        if out.finished and parser.num_calls:
            reason = tool_reason(out)
        return delta, reason


class PendingLogprobs:
    """Each choice's logprobs not sent yet: a step whose text is held back (half a UTF-8
    character, a possible stop string) sends no chunk, so its tokens ride on the next one."""

    def __init__(self) -> None:
        self._by_choice: dict[int, list[TokenLogprobs]] = {}

    def add(self, choice: int, out: RequestOutput) -> None:
        if out.logprobs is not None:
            self._by_choice.setdefault(choice, []).extend(out.new_logprobs or ())

    def take(self, choice: int) -> list[TokenLogprobs]:
        return self._by_choice.pop(choice, [])


class TokenIdDeltas:
    """vLLM's ``return_token_ids`` in a stream: each chunk carries the token ids its choice
    made since its last chunk (a step that sent no chunk rides on the next), and a completion
    choice's first chunk its prompt's ids."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._num_sent: dict[int, int] = {}

    def add(self, choice_body: dict, choice: int, out: RequestOutput, *,
            prompt_in_choice: bool) -> None:
        """Put the ids into ``choice_body`` (the chunk's choice); ``prompt_in_choice``: a
        completion chunk, whose first per choice carries ``prompt_token_ids``."""
        first = choice not in self._num_sent
        sent = self._num_sent.get(choice, 0)
        self._num_sent[choice] = len(out.token_ids)
        prompt = (self._job.prompts[self._job.prompt_index(choice)]
                  if first and prompt_in_choice else None)
        with_token_ids(choice_body, out.token_ids[sent:], prompt)


async def after_head(head: tuple[int, RequestOutput],
                     rest: AsyncIterator[tuple[int, RequestOutput]],
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``head``, then ``rest``; closing this closes ``rest`` (which aborts what is left)."""
    async with contextlib.aclosing(rest):
        yield head
        async for item in rest:
            yield item


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """The chunks as server-sent events, ended by ``[DONE]``; an error after the headers went
    out is an error event in the stream."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except Exception as error:  # headers are gone: report in-band, then end the stream
            yield f"data: {json.dumps(_in_band(error))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _in_band(error: Exception) -> dict:
    """The error event of a stream whose headers are already sent."""
    if isinstance(error, ApiError):
        return error_body(error.status, error.message, error.param, error.code)
    if isinstance(error, RequestFailedError):
        return error_body(500, str(error), code="request_failed")
    if isinstance(error, OverloadedError):  # after the first output: not expected, kept safe
        return error_body(503, str(error), code=OVERLOADED)
    if isinstance(error, EngineDeadError):
        return error_body(503, str(error))
    log.error("stream failed", exc_info=error)
    return error_body(500, "internal error while streaming; retry the request")
