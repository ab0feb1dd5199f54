"""95% intervals for the figures that rank methods: a mean over documents or sequences, a mean of task means, and
the paired difference of two models scored on the same documents (a seeded bootstrap, resampled within each task).
Items cut from one document (held-out sequences) are resampled by document, the independent unit.

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


def document_sums(values: Sequence[float], documents: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(per document, the sum of its items' values; per document, how many items it has): the independent units of
    a mean over items cut from documents. ``documents[i]`` names item i's document; None: every item is its own."""
    array = np.asarray(values, dtype=np.float64)
    if documents is None:
        return array, np.ones_like(array)
    labels = np.asarray(documents)
    if labels.shape != array.shape:
        raise ValueError(f'{array.size} values but {labels.size} document labels')
    _, index = np.unique(labels, return_inverse=True)
    return np.bincount(index, weights=array), np.bincount(index).astype(np.float64)


def _ratio_mean_variance(sums: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    """(mean over items, its variance with documents as the units): the cluster-robust variance of a ratio mean,
    n / (n - 1) x sum_d (S_d - mean x N_d)^2 / N^2 (with one item a document, the sample variance over n)."""
    units = sums.size
    if units < 2:
        raise ValueError(f'an interval needs at least 2 documents, got {units}')
    mean = sums.sum() / counts.sum()
    residuals = sums - mean * counts
    return float(mean), float(units / (units - 1) * np.sum(residuals ** 2) / counts.sum() ** 2)


def mean_of_means_interval(groups: Mapping[str, Sequence[float]],
                           documents: Mapping[str, Sequence[int] | None] | None = None) -> tuple[float, float]:
    """(the mean of the groups' means, half-width of its normal 95% interval): the groups are independent samples, so
    the variance of the mean of T means is the sum of each mean's variance over T squared. ``documents[g]`` names
    the document of each of group g's items (consecutive cuts of one document correlate): each mean's variance is
    then over documents, not items."""
    if not groups:
        raise ValueError('no groups to average')
    means, variances = [], []
    for name, values in groups.items():
        try:
            mean, variance = _ratio_mean_variance(*document_sums(values, (documents or {}).get(name)))
        except ValueError as error:
            raise ValueError(f'{name}: {error}') from None
        means.append(mean)
        variances.append(variance)
    count = len(means)
    return float(np.mean(means)), float(Z95 * math.sqrt(sum(variances)) / count)


def paired_difference(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], *, seed: int = 0,
                      resamples: int = 10_000,
                      documents: Mapping[str, Sequence[int] | None] | None = None) -> tuple[float, float, float]:
    """(difference of the mean of group means, b minus a, and its 95% percentile bootstrap interval) for two models
    scored on the same items: every resample draws each group's items with replacement, the same items for both
    models, so what the two share cancels. ``a[g][i]`` and ``b[g][i]`` must be the same item. ``documents[g]``
    names the document of each item: a resample then draws whole documents (their items' mean is the statistic)."""
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
        sums, counts = document_sums(delta, (documents or {}).get(name))
        if sums.size < 2:
            raise ValueError(f'{name}: a paired interval needs at least 2 documents, got {sums.size}')
        picks = rng.integers(0, sums.size, size=(resamples, sums.size))
        differences.append(sums[picks].sum(axis=1) / counts[picks].sum(axis=1))
    resampled = np.mean(differences, axis=0)
    low, high = np.percentile(resampled, [2.5, 97.5])
    return float(np.mean(observed)), float(low), float(high)


def excludes_zero(low: float, high: float) -> bool:
    """Whether a difference's interval excludes 0: the two models differ at the 95% level."""
    return low > 0 or high < 0
