"""Loss against training tokens over seeds: each point's mean and 95% interval over the seeds (Student's t), the
tokens at which a curve first reaches a loss, and how many tokens one method needs to reach another's loss, with a
bootstrap interval over the seeds of both.

Plain numpy; no model code. A curve is its x (tokens) and its y (loss) at each evaluation; curves of one method
over seeds share their x when every seed evaluates at the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Student's t 97.5% quantiles for 1..30 degrees of freedom; beyond, the normal's (within 4% from 30 on).
_T975 = (12.7062047, 4.3026527, 3.1824463, 2.7764451, 2.5705818, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)
Z975 = 1.959963984540054


def t975(degrees_of_freedom: int) -> float:
    if degrees_of_freedom < 1:
        raise ValueError(f'a t quantile needs at least 1 degree of freedom, got {degrees_of_freedom}')
    return _T975[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T975) else Z975


def seed_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean over seeds, half-width of its 95% interval): t(n-1) x sample standard deviation / sqrt(n). Seeds are few,
    so the normal's 1.96 would be too narrow (at 3 seeds t is 4.30)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size < 2:
        raise ValueError(f'an interval over seeds needs at least 2 seeds, got {array.size}')
    return float(array.mean()), float(t975(array.size - 1) * array.std(ddof=1) / math.sqrt(array.size))


def first_reach(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The first x at which the piecewise-linear curve through (xs, ys) is at or below ``target``: xs[0] when it starts
    there, else linear interpolation inside the first segment that crosses it; None when it never does."""
    if len(xs) != len(ys) or not len(xs):
        raise ValueError(f'a curve needs as many x as y values, and one at least: got {len(xs)} and {len(ys)}')
    if ys[0] <= target:
        return float(xs[0])
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y1 <= target:
            return float(x0 + (y0 - target) / (y0 - y1) * (x1 - x0))
    return None


def tokens_to_reach(reference_tokens: np.ndarray, reference_losses: np.ndarray, other_tokens: Sequence[float],
                    other_losses: np.ndarray, *, resamples: int = 2000, seed: int = 0) -> list[dict]:
    """For each point of the reference method (``reference_*``: seeds x points; its tokens may differ by seed), the
    tokens the other method (``other_losses``: seeds x points at the shared ``other_tokens``) needs to reach the
    reference's mean loss there, from the other's mean curve, and that over the reference's mean tokens.

    The interval resamples the seeds of both methods with replacement, independently (the methods' seeds are not
    paired), and takes the 2.5 and 97.5 percentiles of the ratio; a resample in which the other method never reaches
    the loss counts as beyond its last point, so an interval may be open above (``None``)."""
    reference_tokens = np.asarray(reference_tokens, dtype=np.float64)
    reference_losses = np.asarray(reference_losses, dtype=np.float64)
    other_losses = np.asarray(other_losses, dtype=np.float64)
    if reference_tokens.shape != reference_losses.shape or other_losses.shape[1:] != (len(other_tokens),):
        raise ValueError(f'shapes do not match: reference tokens {reference_tokens.shape}, losses '
                         f'{reference_losses.shape}; other tokens {len(other_tokens)}, losses {other_losses.shape}')
    rng = np.random.default_rng(seed)
    reference_picks = rng.integers(0, reference_losses.shape[0], size=(resamples, reference_losses.shape[0]))
    other_picks = rng.integers(0, other_losses.shape[0], size=(resamples, other_losses.shape[0]))
    other_mean = other_losses.mean(axis=0)
    other_resampled = other_losses[other_picks].mean(axis=1)  # resamples x points
    rows = []
    for point in range(reference_losses.shape[1]):
        tokens, loss = float(reference_tokens[:, point].mean()), float(reference_losses[:, point].mean())
        needed = first_reach(other_tokens, other_mean, loss)
        ratios = []
        for r in range(resamples):
            target = reference_losses[reference_picks[r], point].mean()
            reached = first_reach(other_tokens, other_resampled[r], target)
            spent = reference_tokens[reference_picks[r], point].mean()
            ratios.append(math.inf if reached is None or spent <= 0 else reached / spent)
        # 'nearest': an order statistic, never an interpolation between a finite ratio and an unreached one
        low, high = np.percentile(np.asarray(ratios), [2.5, 97.5], method='nearest')
        rows.append({'tokens': tokens, 'loss': loss, 'other_tokens_needed': needed,
                     'ratio': None if needed is None or tokens <= 0 else needed / tokens,
                     'ratio_ci95': [None if math.isinf(low) else float(low), None if math.isinf(high) else float(high)],
                     'reached_share': float(np.mean(np.isfinite(ratios)))})
    return rows
