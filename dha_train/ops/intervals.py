"""95% intervals for the figures that rank methods: a mean over documents or sequences, a mean of task means, and
the paired difference of two models scored on the same documents (a seeded bootstrap, resampled within each task).

Plain numpy; no model code. Each function takes per-item values (a document's accuracy, a sequence's loss) grouped
by task: ``{task: [value, ...]}``; one group (held-out loss over sequences) is a dict of one key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its normal 95% interval): 1.96 x the sample standard deviation / sqrt(n)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size < 2:
        raise ValueError(f'an interval needs at least 2 values, got {array.size}')
    return float(array.mean()), float(Z95 * array.std(ddof=1) / math.sqrt(array.size))


def mean_of_means_interval(groups: Mapping[str, Sequence[float]]) -> tuple[float, float]:
    """(the mean of the groups' means, half-width of its normal 95% interval): the groups are independent samples, so
    the variance of the mean of T means is the sum of each mean's variance over T squared."""
    if not groups:
        raise ValueError('no groups to average')
    means, variances = [], []
    for name, values in groups.items():
        array = np.asarray(values, dtype=np.float64)
        if array.size < 2:
            raise ValueError(f'{name}: an interval needs at least 2 values, got {array.size}')
        means.append(array.mean())
        variances.append(array.var(ddof=1) / array.size)
    count = len(means)
    return float(np.mean(means)), float(Z95 * math.sqrt(sum(variances)) / count)


def paired_difference(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], *, seed: int = 0,
                      resamples: int = 10_000) -> tuple[float, float, float]:
    """(difference of the mean of group means, b minus a, and its 95% percentile bootstrap interval) for two models
    scored on the same items: every resample draws each group's items with replacement, the same items for both
    models, so what the two share cancels. ``a[g][i]`` and ``b[g][i]`` must be the same item."""
    if a.keys() != b.keys():
        raise ValueError(f'the two models were scored on different groups: {sorted(a)} and {sorted(b)}')
    rng = np.random.default_rng(seed)
    differences = []
    observed = []
    for name in sorted(a):
        left, right = np.asarray(a[name], dtype=np.float64), np.asarray(b[name], dtype=np.float64)
        if left.shape != right.shape or left.size == 0:
            raise ValueError(f'{name}: the two models were scored on {left.size} and {right.size} items; a paired '
                             'comparison needs the same items')
        delta = right - left
        observed.append(delta.mean())
        picks = rng.integers(0, delta.size, size=(resamples, delta.size))
        differences.append(delta[picks].mean(axis=1))
    resampled = np.mean(differences, axis=0)
    low, high = np.percentile(resampled, [2.5, 97.5])
    return float(np.mean(observed)), float(low), float(high)


def excludes_zero(low: float, high: float) -> bool:
    """Whether a difference's interval excludes 0: the two models differ at the 95% level."""
    return low > 0 or high < 0
