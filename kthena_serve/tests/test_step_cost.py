"""The step cost model and the decode-protecting prefill budget, on injected step times (no
clock is read): the shape of a step, the least-squares fits recovering known coefficients, the
online model moving from its seed to what it measures, and the budget's arithmetic and bounds.
"""

from __future__ import annotations

import random

import attrs
import numpy as np
import pytest

from kthena_serve.engine.scheduled import ScheduledBatch, ScheduledSeq
from kthena_serve.engine.step_cost import (
    DecodeProtectingBudget,
    StepCoefficients,
    StepCostModel,
    StepShape,
    fit_least_squares,
)

TRUE = StepCoefficients(fixed_s=0.012, per_prefill_token_s=0.4e-3, per_decode_row_s=0.6e-3,
                        per_attention_pair_s=2e-9)


def _shapes(count: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start, tokens = rng.randrange(0, 2048), rng.choice([0, 16, 64, 256, 1024])
        out.append(StepShape(prefill_tokens=tokens, decode_rows=rng.randrange(0, 33),
                             prefill_attention=StepShape.chunk_attention(start, tokens)))
    return out


def test_a_steps_shape_counts_chunks_rows_and_attention_pairs():
    seqs = (ScheduledSeq("d", (5,), 40, (0,), True),  # a decode: one row
            ScheduledSeq("p", (1, 2, 3), 8, (1,), False),  # a chunk of 3 from position 8
            ScheduledSeq("q", (4, 5), 0, (2,), True))
    shape = StepShape.of(ScheduledBatch(seqs))
    # 3 * 8 + (1 + 2 + 3) pairs for p, 0 + (1 + 2) for q
    assert shape == StepShape(prefill_tokens=5, decode_rows=1, prefill_attention=30 + 3)
    assert StepShape.chunk_attention(0, 1) == 1 and StepShape.chunk_attention(10, 0) == 0


def test_least_squares_recovers_the_coefficients_of_exact_times():
    shapes = _shapes(40)
    fit = fit_least_squares([(s, TRUE.predict(s)) for s in shapes])
    for got, want in zip(fit.coefficients().values(), TRUE.coefficients().values(), strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    linear = fit_least_squares([(s, TRUE.predict(s)) for s in shapes], attention=False)
    assert linear.per_attention_pair_s == 0.0
    with pytest.raises(ValueError, match="needs at least 4 samples, got 2"):
        fit_least_squares([(s, 0.1) for s in shapes[:2]])


def test_the_online_model_starts_at_its_seed_and_converges_to_what_it_measures():
    seed = StepCoefficients(0.020, 1.0e-3, 1.0e-3, 0.0)
    model = StepCostModel(seed)
    shape = StepShape(prefill_tokens=256, decode_rows=4)
    assert model.current == seed and model.predict(shape) == pytest.approx(0.020 + 0.256 + 0.004)
    for s in _shapes(400, seed=1):
        model.observe(s, TRUE.predict(s))
    assert model.num_observed == 400
    assert model.predict(shape) == pytest.approx(TRUE.predict(shape), rel=0.02)


def test_coefficients_no_step_informs_stay_at_the_seed():
    """Decode-only steps say nothing about a prefill token: its cost stays the seed's."""
    seed = StepCoefficients(0.020, 1.0e-3, 1.0e-3, 0.0)
    model = StepCostModel(seed)
    for rows in [1, 2, 4, 8, 16, 32] * 50:
        model.observe(StepShape(decode_rows=rows), 0.010 + 0.5e-3 * rows)
    got = model.current
    assert got.per_prefill_token_s == pytest.approx(seed.per_prefill_token_s)
    assert got.per_decode_row_s == pytest.approx(0.5e-3, rel=0.05)
    assert got.fixed_s == pytest.approx(0.010, rel=0.1)


def test_old_steps_fade_so_the_model_follows_a_slower_machine():
    model = StepCostModel(TRUE, half_life_steps=32)
    shapes = _shapes(600, seed=2)
    for s in shapes[:300]:
        model.observe(s, TRUE.predict(s))
    for s in shapes[300:]:  # the cores got shared: every step twice as long
        model.observe(s, 2 * TRUE.predict(s))
    probe = StepShape(prefill_tokens=512, decode_rows=8)
    # the seed (the old machine) still pulls a little: within 5% of the new time
    assert model.predict(probe) == pytest.approx(2 * TRUE.predict(probe), rel=0.05)


def test_one_stalled_step_barely_moves_the_model():
    model = StepCostModel(TRUE)
    shapes = _shapes(300, seed=3)
    for s in shapes:
        model.observe(s, TRUE.predict(s))
    probe = StepShape(prefill_tokens=512, decode_rows=8)
    model.observe(probe, 100 * TRUE.predict(probe))  # descheduled for a while
    # counted as 2x its prediction: a few percent (taken at face value, several times over)
    assert model.predict(probe) == pytest.approx(TRUE.predict(probe), rel=0.1)


def test_coefficients_are_never_negative():
    fit = StepCoefficients.from_vector([0.01, -1e-4, 2e-3, -1e-9])
    assert (fit.per_prefill_token_s, fit.per_attention_pair_s) == (0.0, 0.0)


def test_model_arguments_are_checked():
    with pytest.raises(ValueError, match="must be positive and outlier_ratio above 1"):
        StepCostModel(half_life_steps=0)
    with pytest.raises(ValueError, match="outlier_ratio above 1"):
        StepCostModel(outlier_ratio=1.0)


def _budget(coefficients: StepCoefficients, pairs_per_token: float = 0.0,
            **kw) -> DecodeProtectingBudget:
    model = StepCostModel(coefficients, prior_weight=1e12)  # held at its seed
    model.pairs_per_token = pairs_per_token
    options = {"target_s": 0.100, "min_tokens": 16, "max_tokens": 1024}
    options.update(kw)
    return DecodeProtectingBudget(model, **options)


def test_the_budget_is_the_prefill_that_fits_in_the_target():
    budget = _budget(StepCoefficients(0.020, 0.5e-3, 1.0e-3))
    assert budget(1) == 158  # (100 - 20 - 1) ms / 0.5 ms
    assert budget(30) == 100  # (100 - 20 - 30) / 0.5
    # a prefill token's attention: the pairs per token recent steps had
    with_attention = _budget(StepCoefficients(0.020, 0.4e-3, 1.0e-3, 1e-7),
                             pairs_per_token=1000)
    assert with_attention(1) == 158  # per token 0.4 ms + 1000 * 1e-7 s


def test_a_long_queue_does_not_stretch_the_step_past_the_target():
    """However many prompt tokens wait, the decodes' step stays within the target (issue 52:
    a share of the backlog per step stretched every inter-token time to a full chunk's)."""
    budget = _budget(StepCoefficients(0.020, 0.5e-3, 1.0e-3))
    assert budget(2) == 156  # (100 - 20 - 2) ms / 0.5 ms
    model = budget.cost
    step = StepShape(prefill_tokens=budget(2), decode_rows=2)
    assert model.predict(step) <= budget.target_s
    assert model.predict(attrs.evolve(step, prefill_tokens=budget(2) + 1)) > budget.target_s


def test_a_burst_that_arrived_with_the_decodes_is_cleared_in_a_few_full_steps():
    budget = _budget(StepCoefficients(0.020, 0.5e-3, 1.0e-3))
    assert budget(2, 0) == budget(2) == 156
    assert budget(2, 4 * 156) == 156  # a burst of four budgets: split to the target
    assert budget(2, 2000) == 500  # a quarter of it
    assert budget(1, 17_408) == 1024  # capped at the whole step
    assert _budget(StepCoefficients(0.020, 0.5e-3, 1.0e-3), burst_steps=8)(2, 2000) == 250


def test_pairs_per_token_follow_the_recent_prefill_chunks():
    model = StepCostModel(half_life_steps=8)
    assert model.pairs_per_token == 512  # a 1,024-token chunk from position 0
    for _ in range(100):  # 64-token chunks from position 2,048
        model.observe(StepShape(64, 1, StepShape.chunk_attention(2048, 64)), 0.05)
        model.observe(StepShape(decode_rows=4), 0.01)  # no prefill: no say
    assert model.pairs_per_token == pytest.approx(2048 + 65 / 2, rel=1e-3)


def test_the_budget_keeps_prefills_moving_and_never_exceeds_the_step():
    # decodes alone over the target: the prefill gets as long as they take (201 ms / 0.5 ms)
    assert _budget(StepCoefficients(0.200, 0.5e-3, 1.0e-3))(1) == 402
    assert _budget(StepCoefficients(0.060, 0.5e-3, 0.0))(1) == 120  # over half: 60 ms too
    assert _budget(StepCoefficients(0.0, 0.1, 0.0))(1) == 16  # 1 token > target: a block
    assert _budget(StepCoefficients(0.0, 1e-6, 0.0))(4) == 1024  # cheap: the whole step
    assert _budget(StepCoefficients(0.0, 0.0, 0.0))(4) == 1024  # free: the whole step


def test_the_normal_equations_solve_as_numpy_does():
    """observe solves its 4 x 4 system in plain floats (`_solve`); numpy's LAPACK solve on
    fresh random symmetric positive definite systems, as the prior keeps observe's, is the
    reference (both are LU with partial pivoting, so they agree to rounding)."""
    from kthena_serve.engine.step_cost import _solve

    rng = np.random.default_rng()
    for _ in range(100):
        g = rng.normal(size=(4, 4)) * rng.choice([1e-3, 1.0, 1e3], size=4)
        a = g @ g.T + 2.0 * np.eye(4)
        b = rng.normal(size=4)
        want = np.linalg.solve(a, b)
        got = np.array(_solve(a.tolist(), b.tolist()))
        # backward-stable solves: residuals within a few units of rounding of |a| |x|
        bound = 64 * np.finfo(float).eps * (np.abs(a) @ np.abs(want) + np.abs(b))
        assert np.all(np.abs(a @ got - b) <= bound), (a, b, got, want)
