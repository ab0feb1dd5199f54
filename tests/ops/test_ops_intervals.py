"""95% intervals (dha_train.ops.intervals): closed forms, and a bootstrap that is exact where it must be."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dha_train.ops.intervals import Z95, excludes_zero, mean_interval, mean_of_means_interval, paired_difference


def test_mean_interval_is_the_normal_closed_form():
    values = [0.0, 1.0, 1.0, 0.0, 1.0]
    mean, half = mean_interval(values)
    assert mean == pytest.approx(0.6)
    assert half == pytest.approx(Z95 * math.sqrt(0.3) / math.sqrt(5))  # sample variance 0.3
    with pytest.raises(ValueError, match='at least 2 values'):
        mean_interval([1.0])


def test_mean_of_means_adds_the_means_variances():
    groups = {'a': [0.0, 1.0, 1.0, 1.0], 'b': [2.0, 4.0]}
    mean, half = mean_of_means_interval(groups)
    assert mean == pytest.approx((0.75 + 3.0) / 2)
    assert half == pytest.approx(Z95 * math.sqrt(0.25 / 4 + 2.0 / 2) / 2)  # variances 0.25 and 2.0


def test_paired_difference_of_a_constant_shift_is_exact_and_of_itself_zero():
    rng = np.random.default_rng(1)
    a = {'piqa': list(rng.random(50)), 'sciq': list(rng.random(30))}
    shifted = {task: [value + 0.1 for value in values] for task, values in a.items()}
    difference, low, high = paired_difference(a, shifted, seed=3)
    assert (difference, low, high) == pytest.approx((0.1, 0.1, 0.1))  # what both share cancels in every resample
    assert excludes_zero(low, high)
    assert paired_difference(a, a, seed=3) == (0.0, 0.0, 0.0)
    assert not excludes_zero(0.0, 0.0)


def test_paired_bootstrap_width_matches_the_normal_one_for_many_items_and_is_seeded():
    rng = np.random.default_rng(2)
    a = {'t': list(rng.integers(0, 2, 2000).astype(float))}
    b = {'t': list(rng.integers(0, 2, 2000).astype(float))}
    difference, low, high = paired_difference(a, b, seed=5)
    _, normal_half = mean_interval(np.asarray(b['t']) - np.asarray(a['t']))
    assert (high - low) / 2 == pytest.approx(normal_half, rel=0.1)
    assert paired_difference(a, b, seed=5) == (difference, low, high)


def test_paired_difference_refuses_unpaired_items():
    with pytest.raises(ValueError, match='the same items'):
        paired_difference({'t': [1.0, 0.0]}, {'t': [1.0]})
    with pytest.raises(ValueError, match='different groups'):
        paired_difference({'t': [1.0]}, {'u': [1.0]})
