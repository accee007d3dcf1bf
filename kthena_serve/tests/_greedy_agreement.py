"""How two engines' greedy outputs of one prompt compare (the int8 KV and int8 weight tests)."""

from __future__ import annotations

QUESTIONS = [  # chat prompts, each answered with 16 greedy tokens by both engines
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "用一句话介绍长城。",
    "How do I reverse a list in Python?",
]


def agreed(reference, other) -> int:  # noqa: ANN001 - RequestOutputs
    """Tokens before the first difference (after it the two continue different texts)."""
    pairs = list(zip(reference.token_ids, other.token_ids, strict=True))
    return next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))


def gap_at_divergence(reference, other) -> float | None:  # noqa: ANN001
    """How far (log-probability) the reference's pick was ahead of the other's pick, at the
    first step where they differ (the context is still the same there); None if they agree,
    inf if the other's pick is not in the reference's top logprobs."""
    step = agreed(reference, other)
    if step == len(reference.token_ids):
        return None
    lp = reference.logprobs[step]
    chosen = other.token_ids[step]
    if chosen not in lp.top_ids:
        return float("inf")
    return lp.logprob - lp.top_logprobs[lp.top_ids.index(chosen)]
