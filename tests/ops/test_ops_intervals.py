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


def _correlated_cuts(rng, documents: int, cuts: int, rho: float) -> tuple[list[float], list[int]]:
    """Per document a level drawn once (its cuts share it), so consecutive cuts of one document correlate by rho."""
    values, labels = [], []
    for document in range(documents):
        level = rng.normal(0, math.sqrt(rho))
        values += list(level + rng.normal(0, math.sqrt(1 - rho), size=cuts))
        labels += [document] * cuts
    return values, labels


def test_a_document_interval_is_the_closed_form_and_one_item_a_document_is_the_plain_one():
    values, labels = [1.0, 3.0, 2.0, 6.0], [0, 0, 1, 1]  # documents: sums 4 and 8, 2 items each, mean 3
    mean, half = mean_of_means_interval({'text': values}, {'text': labels})
    # n / (n - 1) x ((4 - 6)^2 + (8 - 6)^2) / 4^2 = 2 x 8 / 16 = 1
    assert mean == 3.0 and math.isclose(half, Z95 * 1.0)
    assert mean_of_means_interval({'text': values}, {'text': [0, 1, 2, 3]}) == mean_of_means_interval({'text': values})
    with pytest.raises(ValueError, match='2 documents'):
        mean_of_means_interval({'text': values}, {'text': [0, 0, 0, 0]})


def test_on_correlated_cuts_document_intervals_are_wider_and_cover_where_cut_intervals_do_not():
    """64 documents of 4 cuts each, correlated by 0.5 within a document: resampling cuts as if independent is too
    narrow (covers the true mean 0 well under 95%); resampling documents covers it about 95% of the time, for the
    mean and for a paired difference."""
    rng = np.random.default_rng(0)
    covered = {'cuts': 0, 'documents': 0, 'paired cuts': 0, 'paired documents': 0}
    widths = {'cuts': [], 'documents': []}
    trials = 300
    for trial in range(trials):
        values, labels = _correlated_cuts(rng, 64, 4, 0.5)
        for name, documents in (('cuts', None), ('documents', {'text': labels})):
            mean, half = mean_of_means_interval({'text': values}, documents)
            covered[name] += abs(mean) <= half
            widths[name].append(half)
        other = [value + 0.0 for value in _correlated_cuts(rng, 64, 4, 0.5)[0]]
        for name, documents in (('paired cuts', None), ('paired documents', {'text': labels})):
            _, low, high = paired_difference({'text': values}, {'text': other}, documents=documents, seed=trial,
                                             resamples=1000)
            covered[name] += low <= 0 <= high
    assert np.mean(widths['documents']) > 1.3 * np.mean(widths['cuts'])
    assert covered['cuts'] / trials < 0.88 and 0.9 <= covered['documents'] / trials <= 0.99
    assert covered['paired cuts'] / trials < 0.88 and 0.9 <= covered['paired documents'] / trials <= 0.99
