"""Logprobs in OpenAI's two shapes, from the engine's ``TokenLogprobs``: chat's ``content`` list
(``chat_logprobs``) and the completions API's parallel lists with text offsets
(``completion_logprobs``, ``TextOffsets`` across stream chunks), plus vLLM's ``prompt_logprobs``
(``vllm_prompt_logprobs``). A token is named by its text (bytes that are not whole UTF-8
characters spelt ``bytes:\\xNN``) or, with ``return_tokens_as_token_ids``, ``token_id:N``; -inf
is sent as -9999.0.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kthena_serve.engine.logprobs import TokenLogprobs

__all__ = ["TextOffsets", "TokenBytes", "chat_logprobs", "completion_logprobs",
           "vllm_prompt_logprobs"]

TokenBytes = Callable[[Sequence[int]], list[bytes]]
_MIN_LOGPROB = -9999.0  # OpenAI's (and vLLM's) stand-in for -inf, which JSON cannot carry


def _token_text(raw: bytes) -> str:
    """A token as text; bytes that are not whole UTF-8 characters are spelt ``bytes:\\xNN``
    (OpenAI's convention), so distinct partial tokens keep distinct names."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _lookup(entries: Sequence[TokenLogprobs], token_bytes: TokenBytes) -> dict[int, bytes]:
    ids = sorted({i for e in entries for i in (e.token_id, *e.top_ids)})
    return dict(zip(ids, token_bytes(ids), strict=True))


def _value(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _namer(raw: dict[int, bytes], as_ids: bool) -> Callable[[int], str]:
    """A token's name in logprobs: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose bytes are not text)."""
    return (lambda i: f"token_id:{i}") if as_ids else (lambda i: _token_text(raw[i]))


def chat_logprobs(entries: Sequence[TokenLogprobs], token_bytes: TokenBytes,
                  as_ids: bool = False) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    raw = _lookup(entries, token_bytes)
    name = _namer(raw, as_ids)

    def item(token_id: int, logprob: float) -> dict:
        return {"token": name(token_id), "logprob": _value(logprob),
                "bytes": list(raw[token_id])}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(i, lp) for i, lp in zip(e.top_ids, e.top_logprobs,
                                                                         strict=True)]}
                        for e in entries]}


class TextOffsets:
    """Where each token of one choice starts in its text, in characters, across stream chunks.

    A token that ends inside a UTF-8 character adds no character yet; the token that completes
    it does (so both halves of a split character start at that character).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0

    def next(self, raw: bytes) -> int:
        """The offset of a token with bytes ``raw``; moves past it."""
        start = self.num_chars
        self.num_chars += len(self._decoder.decode(raw))
        return start


def completion_logprobs(entries: Sequence[TokenLogprobs], token_bytes: TokenBytes,
                        offsets: TextOffsets, as_ids: bool = False, *,
                        echo: Sequence[TokenLogprobs | None] = (), first_id: int = 0,
                        num_top: int | None = None) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` of ``entries``.

    ``top_logprobs[i]`` maps the top tokens' text to their logprob and always holds the sampled
    token too (up to ``logprobs + 1`` entries, as vLLM does). With ``echo`` (the prompt's
    entries: None for its first token, whose id is ``first_id``), the prompt's tokens come
    first, the first with null logprob and top logprobs (as vLLM answers ``echo``); ``num_top``
    cuts the prompt's alternatives to what the request's ``logprobs`` asked.
    """
    prompt = [e for e in echo if e is not None]
    raw = _lookup([*prompt, *entries, TokenLogprobs(first_id, 0.0)] if echo else entries,
                  token_bytes)
    name = _namer(raw, as_ids)
    tokens, values, tops, starts = [], [], [], []
    if echo:
        tokens.append(name(first_id))
        values.append(None)
        tops.append(None)
        starts.append(offsets.next(raw[first_id]))
    for position, entry in enumerate([*prompt, *entries]):
        if num_top is not None and position < len(prompt):
            entry = attrs.evolve(entry, top_ids=entry.top_ids[:num_top],
                                 top_logprobs=entry.top_logprobs[:num_top])
        text = name(entry.token_id)
        top = {name(i): _value(lp)
               for i, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)}
        top.setdefault(text, _value(entry.logprob))
        tokens.append(text)
        values.append(_value(entry.logprob))
        tops.append(top)
        starts.append(offsets.next(raw[entry.token_id]))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": starts}


def vllm_prompt_logprobs(entries: Sequence[TokenLogprobs | None], token_text: TokenBytes,
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {logprob,
    rank, decoded_token}}`` for the prompt token and its ``num_top`` most likely alternatives
    (ranked 1..k)."""
    entries = [e if e is None else attrs.evolve(e, top_ids=e.top_ids[:num_top],
                                                top_logprobs=e.top_logprobs[:num_top])
               for e in entries]
    known = [e for e in entries if e is not None]
    raw = _lookup(known, token_text)
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        item = {str(i): {"logprob": _value(lp), "rank": r, "decoded_token": _token_text(raw[i])}
                for r, (i, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs, strict=True),
                                            start=1)}
        item.setdefault(str(entry.token_id), {"logprob": _value(entry.logprob),
                                              "rank": entry.rank,
                                              "decoded_token": _token_text(raw[entry.token_id])})
        out.append(item)
    return out
