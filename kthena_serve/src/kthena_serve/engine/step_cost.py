"""Step cost: how long a step of a given composition takes, learnt from the engine's own steps.

A step's time is modelled as linear in its composition::

    t(step) = a + b * prefill_tokens + c * decode_rows + d * prefill_attention

``prefill_attention`` counts a prefill chunk's query x key pairs (a chunk of ``n`` tokens from
position ``s`` attends to ``n * s + n * (n + 1) / 2``): long contexts cost more per token.
``StepCostModel`` starts from seed coefficients and refits them after every measured step by
exponentially weighted least squares, pulled towards the seed where the steps seen say little
(a ridge prior), so a run of decode-only steps does not forget what a prefill token costs. A
step far slower than predicted (the process was descheduled on shared cores) counts as at most
``outlier_ratio`` times its prediction: one stall does not reshape the model, a lasting
slow-down still moves it (by up to that factor per step).

``DecodeProtectingBudget`` turns the model into the scheduler's prefill cap: with ``rows``
decodes in a step, how many prefill tokens keep the predicted step within a target time
(``EngineConfig.target_step_ms``). A prefill token's attention is charged at the pairs per
prefill token the recent steps had (``StepCostModel.pairs_per_token``): the scheduler asks for
a token count, not for each chunk's position. It takes the budget as a plain callable, so it
stays a pure function of its inputs (tests inject fixed costs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import numpy as np

from kthena_serve.engine.scheduled import ScheduledBatch

__all__ = ["BURST_STEPS", "DEFAULT_SEED", "DecodeProtectingBudget", "StepCoefficients", "StepCostModel",
           "StepShape", "fit_least_squares"]


@attrs.frozen
class StepShape:
    """What a step's time depends on.

    Attributes:
        prefill_tokens: tokens of prefill chunks (sequences fed more than one token).
        decode_rows: sequences fed one token (decodes, and one-token prompt tails).
        prefill_attention: query x key pairs of the prefill chunks (``chunk_attention``).
    """

    prefill_tokens: int = 0
    decode_rows: int = 0
    prefill_attention: int = 0

    @staticmethod
    def chunk_attention(start: int, num_tokens: int) -> int:
        """Query x key pairs of a causal chunk of ``num_tokens`` tokens from ``start``."""
        return num_tokens * start + num_tokens * (num_tokens + 1) // 2

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepShape:
        """The shape of a scheduled step."""
        chunks = [(s.start, len(s.token_ids)) for s in batch.seqs if len(s.token_ids) > 1]
        return cls(prefill_tokens=sum(n for _, n in chunks),
                   decode_rows=len(batch.seqs) - len(chunks),
                   prefill_attention=sum(cls.chunk_attention(s, n) for s, n in chunks))

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.prefill_tokens), float(self.decode_rows),
                float(self.prefill_attention))


@attrs.frozen
class StepCoefficients:
    """Seconds of a step: ``fixed`` + per prefill token + per decode row + per attention pair
    (all at least 0)."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_row_s: float
    per_attention_pair_s: float = 0.0

    def predict(self, shape: StepShape) -> float:
        return (self.fixed_s + self.per_prefill_token_s * shape.prefill_tokens
                + self.per_decode_row_s * shape.decode_rows
                + self.per_attention_pair_s * shape.prefill_attention)

    def coefficients(self) -> dict[str, float]:
        """The coefficients, in microseconds (JSON-able)."""
        return {k: round(v * 1e6, 6) for k, v in attrs.asdict(self).items()}

    @classmethod
    def from_vector(cls, theta: Iterable[float]) -> StepCoefficients:
        return cls(*(max(0.0, float(v)) for v in theta))


# SmolLM2-135M-Instruct, bf16, 2 cores of an AMD EPYC (family 26: Zen 5): the forward's fit
# by scripts/profile_step_cost.py, with a decode row at what the engine's own steps add
# (sampling, detokenising; scripts/step_budget_ab.py's fits), docs/kthena_serve.md "Decode
# protection". On another machine or model the online fit takes over within a few dozen steps.
DEFAULT_SEED = StepCoefficients(fixed_s=0.012, per_prefill_token_s=0.24e-3,
                                per_decode_row_s=0.4e-3, per_attention_pair_s=0.09e-6)

# A burst's prompt tokens (those of requests that arrived together with the running decodes,
# ``DecodeProtectingBudget``) are cleared in steps of at least this share of them: measured on
# the Zen 5 above with 32 x (544 -> 16) arriving at once, total time 5.5-5.8 s with protection
# off, 6.0-6.1 s with the target alone, 5.8-6.0 s with 1/8 and 5.7-5.8 s with 1/4
# (scripts/step_budget_ab.py); on a Zen 4 the target alone took 9% longer on 32 x (128 -> 64)
# and 14% on 32 x (544 -> 16) than 1/4 (docs/kthena_serve.md, "Decode protection").
BURST_STEPS = 4

# Feature scales: the prior's weight is per scaled feature, so every coefficient is held to
# its seed about equally (a step of 256 prefill tokens, 16 decode rows, 64k attention pairs).
_SCALE_LIST = (1.0, 256.0, 16.0, 65536.0)
_SCALES = np.array(_SCALE_LIST)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, by Gaussian elimination with partial pivoting (``a`` and ``b`` are
    overwritten; ``a`` here is symmetric positive definite: the prior keeps it so)."""
    n = len(b)
    for k in range(n):
        p = max(range(k, n), key=lambda r: abs(a[r][k]))
        if p != k:
            a[k], a[p], b[k], b[p] = a[p], a[k], b[p], b[k]
        pivot = a[k][k]
        for r in range(k + 1, n):
            f = a[r][k] / pivot
            if f:
                row, top = a[r], a[k]
                for c in range(k, n):
                    row[c] -= f * top[c]
                b[r] -= f * b[k]
    x = [0.0] * n
    for k in range(n - 1, -1, -1):
        x[k] = (b[k] - sum(a[k][c] * x[c] for c in range(k + 1, n))) / a[k][k]
    return x


def fit_least_squares(samples: Iterable[tuple[StepShape, float]], *,
                      attention: bool = True) -> StepCoefficients:
    """Ordinary least squares over (shape, seconds) samples (the profile script's fit).

    Args:
        attention: fit the attention term too; False holds it at 0.

    Raises:
        ValueError: fewer samples than coefficients.
    """
    pairs = list(samples)
    width = 4 if attention else 3
    if len(pairs) < width:
        raise ValueError(f"fitting {width} coefficients needs at least {width} samples, "
                         f"got {len(pairs)}")
    x = np.array([s.features()[:width] for s, _ in pairs]) / _SCALES[:width]
    y = np.array([t for _, t in pairs])
    theta = np.linalg.lstsq(x, y, rcond=None)[0] / _SCALES[:width]
    return StepCoefficients.from_vector([*theta, *([0.0] * (4 - width))])


class StepCostModel:
    """Step-time coefficients refitted online from measured steps.

    Exponentially weighted least squares with a ridge prior at ``seed``: after ``observe``,
    the coefficients minimise ``sum_i w^(age_i) (t_i - x_i . theta)^2 + prior_weight *
    |scaled(theta - seed)|^2``, with ``w`` halving a sample's weight every
    ``half_life_steps`` and each ``t_i`` at most ``outlier_ratio`` times its prediction.

    Args:
        seed: the coefficients before any step is seen.
        half_life_steps: steps after which a measurement counts half.
        prior_weight: how many steps' worth of evidence the seed is.
        outlier_ratio: a measured step counts as at most this many times its prediction.
    """

    def __init__(self, seed: StepCoefficients = DEFAULT_SEED, *, half_life_steps: float = 256,
                 prior_weight: float = 2.0, outlier_ratio: float = 2.0) -> None:
        if half_life_steps <= 0 or prior_weight <= 0 or outlier_ratio <= 1:
            raise ValueError("half_life_steps and prior_weight must be positive and "
                             f"outlier_ratio above 1 (got {half_life_steps}, {prior_weight}, "
                             f"{outlier_ratio})")
        self.seed = seed
        self.outlier_ratio = outlier_ratio
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._prior_weight = prior_weight
        # the normal equations in plain floats: a 4 x 4 update and solve per step costs a third
        # of numpy's calls on these sizes (the engine observes every step)
        self._seed_scaled = [v * s for v, s in zip(_vector(seed), _SCALE_LIST, strict=True)]
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self._current = seed
        self.num_observed = 0
        self.pairs_per_token = 512.0  # a 1,024-token chunk from position 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Take one measured step into the fit."""
        predicted = self._current.predict(shape)
        if predicted > 0:
            seconds = min(seconds, self.outlier_ratio * predicted)
        if shape.prefill_tokens:
            ratio = shape.prefill_attention / shape.prefill_tokens
            self.pairs_per_token += (1 - self._decay) * (ratio - self.pairs_per_token)
        x = [f / s for f, s in zip(shape.features(), _SCALE_LIST, strict=True)]
        decay, xtx, xty = self._decay, self._xtx, self._xty
        for i, xi in enumerate(x):
            row = xtx[i]
            for j, xj in enumerate(x):
                row[j] = decay * row[j] + xi * xj
            xty[i] = decay * xty[i] + xi * seconds
        w = self._prior_weight
        theta = _solve([[v + w if i == j else v for j, v in enumerate(row)]
                        for i, row in enumerate(xtx)],
                       [v + w * s for v, s in zip(xty, self._seed_scaled, strict=True)])
        self._current = StepCoefficients.from_vector(
            t / s for t, s in zip(theta, _SCALE_LIST, strict=True))
        self.num_observed += 1

    @property
    def current(self) -> StepCoefficients:
        """The coefficients as fitted now."""
        return self._current

    def predict(self, shape: StepShape) -> float:
        return self._current.predict(shape)

    def prefill_tokens_per_s(self, num_decode_rows: int, num_prefill_tokens: int) -> float:
        """Prompt tokens per second of steps that each carry ``num_prefill_tokens`` beside
        ``num_decode_rows`` decodes (attention charged at ``pairs_per_token``): the prior of
        the admission bound's rate (``kthena_serve.engine.admission``)."""
        shape = StepShape(num_prefill_tokens, num_decode_rows,
                          int(num_prefill_tokens * self.pairs_per_token))
        seconds = self.predict(shape)
        return num_prefill_tokens / seconds if seconds > 0 else math.inf


def _vector(c: StepCoefficients) -> tuple[float, float, float, float]:
    return (c.fixed_s, c.per_prefill_token_s, c.per_decode_row_s, c.per_attention_pair_s)


@attrs.frozen
class DecodeProtectingBudget:
    """The scheduler's prefill cap for steps with decodes, from a cost model and a target.

    ``budget(rows, burst)``: the prefill tokens that keep ``fixed + rows * per_row + tokens *
    per_token`` within ``target_s``, or ``burst / burst_steps`` if more, at most
    ``max_tokens``. ``burst`` is the prompt tokens still to compute of the requests that
    arrived together with the running decodes (the scheduler's ``burst_window_s``): the
    decodes are protected from prompts that arrive after them, however long that queue (a
    share of the whole queue per step stretched every decode's inter-token time to a full
    chunk's under overload: docs/kthena_serve.md, "Decode protection"), while requests that
    arrived at once are served as one batch, their prompts in a few full steps (every prompt
    waiting pays every step's fixed cost, and the decodes of a burst finish no later with
    full steps: the tokens they wait for in a long step they would otherwise wait for in the
    short steps after it). Where the decodes alone take more
    than half the target (a large batch, a slow or shared machine), the prefill still gets as
    much predicted time as the rest of the step, so prompts keep at least half the throughput
    and a step takes at most twice its decode-only time; and at least ``min_tokens`` always.
    A prefill token's attention is charged at ``cost.pairs_per_token`` pairs.

    Attributes:
        cost: the step cost model (its ``current`` coefficients and ``pairs_per_token``).
        target_s: the step time to stay within while something decodes.
        min_tokens: the least prefill a step with decodes carries (a block).
        max_tokens: the most (``max_num_batched_tokens``).
        burst_steps: a burst's prompt tokens are cleared in steps of at least this share.
    """

    cost: StepCostModel
    target_s: float
    min_tokens: int
    max_tokens: int
    burst_steps: int = BURST_STEPS

    def __call__(self, num_decode_rows: int, num_burst_tokens: int = 0) -> int:
        c = self.cost.current
        rest = c.fixed_s + c.per_decode_row_s * num_decode_rows
        left = max(self.target_s - rest, rest)
        per_token = c.per_prefill_token_s + c.per_attention_pair_s * self.cost.pairs_per_token
        if per_token <= 0:
            return self.max_tokens
        share = num_burst_tokens // self.burst_steps  # one burst: a few full steps
        return max(self.min_tokens, min(self.max_tokens, max(int(left / per_token), share)))
