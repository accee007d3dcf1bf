"""OutputStream: one request's text, detokenised incrementally, and its stop conditions.

Stop strings are matched on the text, not on tokens (a stop string may span tokens or end
mid-token); the text is cut before the match (after it with ``include_stop_str_in_output``,
which also keeps the text of a stop token). While a request runs, the last
``len(longest stop) - 1`` characters are held back from streaming, so a client never sees the
start of a stop string that the next token completes.
"""

from __future__ import annotations

from collections.abc import Iterable

from kthena_serve.engine.request import FinishReason
from kthena_serve.engine.sampling_params import SamplingParams

__all__ = ["OutputStream"]


class OutputStream:
    """Detokenises and stop-checks one request.

    Args:
        detokenizer: an ``IncrementalDetokenizer`` for the prompt (``step(id) -> str``).
        params: the request's sampling parameters.
        eos_token_ids: the model's end-of-sequence ids (ignored with ``ignore_eos``).
        max_tokens: the resolved output budget.
    """

    __slots__ = ("_detokenizer", "_hold", "_include_stop", "_min_tokens", "_stop_ids", "_stops",
                 "max_tokens", "num_sent_chars", "num_tokens", "text")

    def __init__(self, detokenizer, params: SamplingParams, eos_token_ids: Iterable[int],
                 max_tokens: int) -> None:
        self._detokenizer = detokenizer
        self._stops = params.stop
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._min_tokens = params.min_tokens  # before it, no stop ends the output
        self._include_stop = params.include_stop_str_in_output
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.text = ""
        self.num_sent_chars = 0

    def append(self, token_id: int) -> FinishReason | None:
        """Take one generated token; returns why the request ends now, or None."""
        self.num_tokens += 1
        may_stop = self.num_tokens >= self._min_tokens
        if may_stop and token_id in self._stop_ids:
            if self._include_stop:
                self.text += self._detokenizer.step(token_id)
            return FinishReason.STOP
        delta = self._detokenizer.step(token_id)
        if delta:
            self.text += delta
            if may_stop and self._stops and self._cut_at_stop(len(delta)):
                return FinishReason.STOP
        if self.num_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out (holding back a possible stop-string start unless done)."""
        end = len(self.text) if finished else max(len(self.text) - self._hold, self.num_sent_chars)
        new = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return new

    def _cut_at_stop(self, num_new_chars: int) -> bool:
        start = max(len(self.text) - num_new_chars - self._hold, 0)
        found = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self._stops)
                 if i >= 0]
        if not found:
            return False
        at, length = min(found)
        self.text = self.text[: at + length if self._include_stop else at]
        self.num_sent_chars = min(self.num_sent_chars, len(self.text))
        return True
