"""How two engines' greedy outputs of one prompt compare (the int8 KV and int8 weight tests):
the questions, how they are asked, and how the answers are compared."""

from __future__ import annotations

from kthena_serve.engine.sampling_params import SamplingParams

NUM_TOKENS = 16
# each question answered with NUM_TOKENS greedy tokens by both engines, with the top logprobs
# that gap_at_divergence reads
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)

QUESTIONS = [  # chat prompts
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "用一句话介绍长城。",
    "How do I reverse a list in Python?",
]


def chat_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001 - a kthena_serve Tokenizer
    """QUESTIONS as token ids, each asked as a user turn in the model's chat template."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
            for q in QUESTIONS]


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
