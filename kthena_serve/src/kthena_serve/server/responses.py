"""OpenAI response bodies: a JSON answer (``completion_response``, ``chat_response``), a stream's
chunks (``completion_chunk``, ``chat_chunk``, ``usage_chunk``), and usage (counted once per
prompt, or per chunk so far with vLLM's ``continuous_usage_stats``), and vLLM's
``return_token_ids`` fields (``with_token_ids``). Each is a plain dict in OpenAI's envelope
(``id``, ``object``, ``created``, ``model``, ``choices``); the logprobs they carry are shaped in
logprobs.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from kthena_serve.engine.request import FinishReason, RequestOutput

__all__ = [
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "new_id",
    "tool_reason",
    "usage",
    "usage_chunk",
    "with_running_usage",
    "with_token_ids",
]


def new_id(prefix: str, request_id: str | None = None) -> str:
    """``prefix-<request_id>`` (vLLM's: the client's ``request_id`` names the response), else
    ``prefix-<random hex>``."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput], prompt_indices: list[int]) -> dict[str, Any]:
    """OpenAI usage over a request's choices; each prompt is counted once, not once per choice."""
    firsts: dict[int, RequestOutput] = {}
    for index, out in zip(prompt_indices, outputs, strict=True):
        firsts.setdefault(index, out)
    prompt_tokens = sum(o.num_prompt_tokens for o in firsts.values())
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts.values())},
    }


def _reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finish_reason is not None else None


def _envelope(rid: str, obj: str, model: str, choices: list, extra: dict | None = None) -> dict:
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices}
    if extra:
        body.update(extra)
    return body


def completion_response(rid: str, model: str, finals: list[RequestOutput], usage_: dict,
                        logprobs: Sequence[dict | None] | None = None,
                        echoed: Sequence[str] | None = None,
                        prompt_logprobs: Sequence[list | None] | None = None) -> dict:
    """Args: logprobs: each choice's ``completion_logprobs`` (None: the request asked none);
    echoed: each choice's prompt text to put before its output (``echo``);
    prompt_logprobs: each choice's `vllm_prompt_logprobs` (vLLM's field, when asked)."""
    logprobs = logprobs or [None] * len(finals)
    echoed = echoed or [""] * len(finals)
    choices = [{"index": i, "text": e + o.text, "logprobs": lp, "finish_reason": _reason(o)}
               for i, (o, lp, e) in enumerate(zip(finals, logprobs, echoed, strict=True))]
    if prompt_logprobs is not None:
        for choice, entries in zip(choices, prompt_logprobs, strict=True):
            choice["prompt_logprobs"] = entries
    return _envelope(rid, "text_completion", model, choices, {"usage": usage_})


def chat_response(rid: str, model: str, finals: list[RequestOutput], usage_: dict,
                  logprobs: Sequence[dict | None] | None = None,
                  prompt_logprobs: list | None = None,
                  tool_calls: Sequence[tuple[str | None, list[dict]]] | None = None) -> dict:
    """Args: logprobs: each choice's ``chat_logprobs`` (None: the request asked none);
    prompt_logprobs: the conversation's `vllm_prompt_logprobs` (vLLM's top-level field);
    tool_calls: each choice's ``(content, calls)`` (``tools.parse_tool_calls``) when the output
    was parsed for tool calls: a choice with calls has them, its content (null when none is
    left) and finish reason ``tool_calls`` (where it stopped, not where it hit a limit)."""
    logprobs = logprobs or [None] * len(finals)
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": lp, "finish_reason": _reason(o)}
               for i, (o, lp) in enumerate(zip(finals, logprobs, strict=True))]
    for choice, out, parsed in zip(choices, finals, tool_calls or (), strict=False):
        content, calls = parsed
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["finish_reason"] = tool_reason(out)
    extra: dict[str, Any] = {"usage": usage_}
    if prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs
    return _envelope(rid, "chat.completion", model, choices, extra)


def tool_reason(out: RequestOutput) -> str | None:
    """The finish reason of a choice that made tool calls: ``tool_calls`` where it stopped."""
    return "tool_calls" if out.finish_reason is FinishReason.STOP else _reason(out)


def usage_chunk(rid: str, obj: str, model: str, usage_: dict) -> dict:
    return _envelope(rid, obj, model, [], {"usage": usage_})


def with_running_usage(chunk: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    """``chunk`` with vLLM's ``continuous_usage_stats`` usage: its choice's prompt and the
    tokens that choice generated so far."""
    chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}
    return chunk


def with_token_ids(choice: dict, token_ids: Sequence[int],
                   prompt_token_ids: Sequence[int] | None = None) -> dict:
    """``choice`` with vLLM's ``return_token_ids`` fields: ``token_ids`` (what it generated, or
    in a stream chunk what it adds) and, where given, ``prompt_token_ids`` (a completion
    choice's prompt; a chat answer carries it at the top level)."""
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    choice["token_ids"] = list(token_ids)
    return choice


def completion_chunk(rid: str, model: str, index: int, out: RequestOutput,
                     logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": out.new_text, "logprobs": logprobs,
              "finish_reason": _reason(out)}
    return _envelope(rid, "text_completion", model, [choice])


def chat_chunk(rid: str, model: str, index: int, delta: dict, reason: str | None,
               logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return _envelope(rid, "chat.completion.chunk", model, [choice])
