"""Loss-against-tokens arithmetic: intervals over seeds, where a curve first reaches a loss, and the tokens one method
needs to reach another's loss with its bootstrap interval."""

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


def test_tokens_to_reach_from_the_mean_curve_and_an_interval_over_seeds():
    # the other method falls linearly by 1 per 100 tokens from 5; the reference sits at 4 then 3
    other_tokens = [0, 100, 200, 300]
    other = np.array([[5.0, 4.0, 3.0, 2.0], [5.2, 4.2, 3.2, 2.2], [4.8, 3.8, 2.8, 1.8]])
    reference_tokens = np.array([[40, 80], [40, 80], [40, 80]])
    reference = np.array([[4.0, 3.0], [4.0, 3.0], [4.0, 3.0]])
    rows = tokens_to_reach(reference_tokens, reference, other_tokens, other, resamples=500, seed=1)
    assert rows[0]['other_tokens_needed'] == pytest.approx(100) and rows[0]['ratio'] == pytest.approx(2.5)
    assert rows[1]['other_tokens_needed'] == pytest.approx(200) and rows[1]['ratio'] == pytest.approx(2.5)
    # resampling the other's seeds moves its mean curve by up to 0.2 either way: 20 tokens, so 80-120 at the first
    low, high = rows[0]['ratio_ci95']
    assert 80 / 40 - 1e-9 <= low < 2.5 < high <= 120 / 40 + 1e-9
    assert rows[0]['reached_share'] == 1.0


def test_a_loss_the_other_method_never_reaches_leaves_the_interval_open():
    other = np.array([[5.0, 4.5], [5.0, 4.4]])
    rows = tokens_to_reach(np.array([[10], [10]]), np.array([[3.0], [3.0]]), [0, 100], other, resamples=50)
    assert rows[0]['other_tokens_needed'] is None and rows[0]['ratio'] is None
    assert rows[0]['ratio_ci95'] == [None, None] and rows[0]['reached_share'] == 0.0
    with pytest.raises(ValueError, match='shapes'):
        tokens_to_reach(np.array([[10]]), np.array([[3.0, 2.0]]), [0, 100], other)
