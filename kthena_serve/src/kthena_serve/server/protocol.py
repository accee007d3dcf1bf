"""OpenAI request bodies (validated strictly: a string is not a number) and response builders."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kthena_serve.request import RequestOutput
from kthena_serve.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "new_id",
    "usage",
    "usage_chunk",
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields both endpoints share; ``prefix_hash`` / ``reuse_offset`` are hints, never trusted."""

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    prefix_hash: str | None = Field(None, max_length=256)
    reuse_offset: int | None = Field(None, ge=0)
    user: str | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for combinations pydantic cannot see."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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


def completion_response(rid: str, model: str, finals: list[RequestOutput], usage_: dict) -> dict:
    choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": _reason(o)}
               for i, o in enumerate(finals)]
    return _envelope(rid, "text_completion", model, choices, {"usage": usage_})


def chat_response(rid: str, model: str, finals: list[RequestOutput], usage_: dict) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": None, "finish_reason": _reason(o)} for i, o in enumerate(finals)]
    return _envelope(rid, "chat.completion", model, choices, {"usage": usage_})


def usage_chunk(rid: str, obj: str, model: str, usage_: dict) -> dict:
    return _envelope(rid, obj, model, [], {"usage": usage_})


def completion_chunk(rid: str, model: str, index: int, out: RequestOutput) -> dict:
    choice = {"index": index, "text": out.new_text, "logprobs": None, "finish_reason": _reason(out)}
    return _envelope(rid, "text_completion", model, [choice])


def chat_chunk(rid: str, model: str, index: int, delta: dict, reason: str | None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    return _envelope(rid, "chat.completion.chunk", model, [choice])
