"""Loss-against-tokens arithmetic: intervals over seeds, where a curve first reaches a loss, and the tokens one method
needs to reach another's loss with its Welch t interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dha_train.ops.token_curves import first_reach, seed_interval, t975, tokens_to_reach


def test_t_quantiles_are_the_closed_forms():
    # one degree of freedom: Cauchy, tan(pi (p - 1/2)); two: (2p - 1) / sqrt(2 p (1 - p))
    assert math.isclose(t975(1), math.tan(math.pi * 0.475), rel_tol=1e-5)
    assert math.isclose(t975(2), 0.95 / math.sqrt(2 * 0.975 * 0.025), rel_tol=1e-5)
    assert t975(200) == pytest.approx(1.95996, rel=1e-5)
    with pytest.raises(ValueError):
        t975(0)


def test_seed_interval_is_t_times_the_standard_error():
    mean, half = seed_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(half, t975(2) * 1.0 / math.sqrt(3))
    with pytest.raises(ValueError, match='2 seeds'):
        seed_interval([1.0])


def test_first_reach_interpolates_inside_the_first_crossing_segment():
    xs, ys = [0, 10, 20, 30], [5.0, 4.0, 3.0, 3.5]
    assert first_reach(xs, ys, 6.0) == 0.0  # already there
    assert first_reach(xs, ys, 3.5) == 15.0  # halfway down the second segment, not the later 3.5
    assert first_reach(xs, ys, 2.9) is None
    with pytest.raises(ValueError):
        first_reach([0, 1], [1.0], 1.0)


def test_tokens_to_reach_from_the_mean_curve_and_a_welch_interval_over_seeds():
    # the other method falls linearly by 1 per 100 tokens from 5; the reference sits at 4 then 3
    other_tokens = [0, 100, 200, 300]
    other = np.array([[5.0, 4.0, 3.0, 2.0], [5.2, 4.2, 3.2, 2.2], [4.8, 3.8, 2.8, 1.8]])
    reference_tokens = np.array([[40, 80], [40, 80], [40, 80]])
    reference = np.array([[4.0, 3.0], [4.0, 3.0], [4.0, 3.0]])
    rows = tokens_to_reach(reference_tokens, reference, other_tokens, other, grid=30001)
    assert rows[0]['other_tokens_needed'] == pytest.approx(100) and rows[0]['ratio'] == pytest.approx(2.5)
    assert rows[1]['other_tokens_needed'] == pytest.approx(200) and rows[1]['ratio'] == pytest.approx(2.5)
    # the reference has no spread, the other's mean has a standard error of 0.2 / sqrt(3) with 2 degrees of freedom:
    # the tokens where |other's mean - 4| <= t(2) x that, 100 -+ 100 x 4.303 x 0.1155, over 40
    half = 100 * t975(2) * 0.2 / math.sqrt(3)
    low, high = rows[0]['ratio_ci95']
    assert low == pytest.approx((100 - half) / 40, abs=0.01) and high == pytest.approx((100 + half) / 40, abs=0.01)


def test_the_reach_interval_covers_95_percent_at_three_seeds_a_method():
    """Simulated seeds around known curves (the other falls linearly; the reference's true loss is reached at 2.5x
    its tokens): the interval covers the true ratio at least about 95% of the time at 3 seeds each (97.5% here:
    Welch's degrees of freedom are rounded down), not the ~75% a percentile bootstrap over 3 seeds gives."""
    rng = np.random.default_rng(0)
    other_tokens = np.arange(0, 501, 100.0)
    truth = 5.0 - other_tokens / 100
    trials, covered = 2000, 0
    for _ in range(trials):
        other = truth + rng.normal(0, 0.15, size=(3, other_tokens.size))
        reference = 3.5 + rng.normal(0, 0.15, size=(3, 1))  # the other reaches 3.5 at 150 tokens: 2.5x 60
        low, high = tokens_to_reach(np.full((3, 1), 60.0), reference, other_tokens, other, grid=2001)[0]['ratio_ci95']
        covered += low is not None and low <= 2.5 and (high is None or 2.5 <= high)
    assert 0.93 <= covered / trials <= 0.985


def test_a_loss_the_other_method_never_reaches_leaves_the_interval_open():
    other = np.array([[5.0, 4.5], [5.0, 4.4]])
    rows = tokens_to_reach(np.array([[10], [10]]), np.array([[3.0], [3.0]]), [0, 100], other)
    assert rows[0]['other_tokens_needed'] is None and rows[0]['ratio'] is None
    assert rows[0]['ratio_ci95'] == [None, None]
    # a loss within the other's spread at its last point: reached or not, the high end stays open
    near = tokens_to_reach(np.array([[10], [10]]), np.array([[4.5], [4.4]]), [0, 100], other)[0]
    assert near['ratio_ci95'][0] is not None and near['ratio_ci95'][1] is None
    with pytest.raises(ValueError, match='shapes'):
        tokens_to_reach(np.array([[10]]), np.array([[3.0, 2.0]]), [0, 100], other)
