"""Logprobs: each sampled token's log-probability and its top alternatives, from one step.

Values are "raw": an fp32 log-softmax of the very logits rows the sampler read this step,
before penalties, temperature and top-k / top-p (vLLM's default, and what OpenAI reports).
Only the rows of requests that asked (``SamplingParams.logprobs`` set) are touched, so a batch
where nobody asked pays nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from kthena_serve.engine.sampler import SampleRow

__all__ = ["TokenLogprobs", "gather_logprobs", "prompt_logprobs"]


def _floats(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _ints(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class TokenLogprobs:
    """One generated token's logprob and the ``k`` most likely tokens at its position.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (always given, whether or not it is in the top ``k``).
        top_ids, top_logprobs: the ``k`` most likely tokens and theirs, most likely first.
        rank: the token's rank in its distribution (1: the most likely), where computed
            (prompt logprobs, as vLLM reports them); None otherwise.
    """

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    top_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top_ids": list(self.top_ids), "top_logprobs": list(self.top_logprobs),
                "rank": self.rank}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenLogprobs:
        return cls(int(data["token_id"]), float(data["logprob"]), data.get("top_ids", ()),
                   data.get("top_logprobs", ()), data.get("rank"))


def gather_logprobs(logits: torch.Tensor, requests: Sequence[SampleRow],
                    token_ids: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """The logprobs of the rows whose request asked for them (None for the others).

    Args:
        logits: the [S, vocab] rows the sampler was given (not modified).
        requests: the S requests; ``params.logprobs`` is how many alternatives each wants.
        token_ids: the S sampled tokens (None where sampling failed: no logprobs either).
    """
    result: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests)
            if r.params.logprobs is not None and token_ids[i] is not None]
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = torch.tensor([token_ids[i] for i in rows], device=logprobs.device)
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(requests[i].params.logprobs for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.long().tolist()
    for n, i in enumerate(rows):
        num_top = requests[i].params.logprobs
        result[i] = TokenLogprobs(token_ids[i], picked[n], top_ids[n][:num_top],
                                  top_values[n][:num_top])
    return result


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int
                    ) -> list[TokenLogprobs]:
    """Each target token's logprob, rank and the ``k`` most likely tokens, from the logits rows
    that predict them (row j predicts ``targets[j]``; raw: an fp32 log-softmax, nothing
    applied).

    Args:
        logits: [len(targets), vocab] (more rows are ignored).
        targets: the prompt tokens the rows predict.
        k: alternatives per token (0: none).
    """
    if not targets:
        return []
    logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    chosen = torch.tensor(list(targets), device=logprobs.device).unsqueeze(1)
    picked = logprobs.gather(1, chosen)
    ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()
    k = min(k, logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    return [TokenLogprobs(t, lp, ids, values, rank)
            for t, lp, ids, values, rank in zip(targets, picked.squeeze(1).tolist(),
                                                top_ids.long().tolist(), top_values.tolist(),
                                                ranks, strict=True)]
