"""Loss against training tokens over seeds: each point's mean and 95% interval over the seeds (Student's t), the
tokens at which a curve first reaches a loss, and how many tokens one method needs to reach another's loss, with an
interval from Welch's t test over the seeds of both.

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
                    other_losses: np.ndarray, *, grid: int = 4096) -> list[dict]:
    """For each point of the reference method (``reference_*``: seeds x points; its tokens may differ by seed), the
    tokens the other method (``other_losses``: seeds x points at the shared ``other_tokens``) needs to reach the
    reference's mean loss there, from the other's mean curve, and that over the reference's mean tokens.

    The interval inverts Welch's t test: it holds the token counts x at which the other's mean loss (linear between
    its points) is not distinguishable at 95% from the reference's, with both methods' seed spreads (the other's
    at x from its seeds' curves interpolated there) and Welch-Satterthwaite degrees of freedom, so it keeps its coverage at 2
    or 3 seeds a method, where a percentile bootstrap over 3 seeds covers about 75%. Its low end is the first x where
    the other is no longer significantly above the reference's loss, its high end the first where it is
    significantly below, open (None) when that does not happen within the other's curve; the reference's own token
    spread is not carried (its tokens are a mean). Fewer than 2 seeds of both: no interval."""
    reference_tokens = np.asarray(reference_tokens, dtype=np.float64)
    reference_losses = np.asarray(reference_losses, dtype=np.float64)
    other_losses = np.asarray(other_losses, dtype=np.float64)
    if reference_tokens.shape != reference_losses.shape or other_losses.shape[1:] != (len(other_tokens),):
        raise ValueError(f'shapes do not match: reference tokens {reference_tokens.shape}, losses '
                         f'{reference_losses.shape}; other tokens {len(other_tokens)}, losses {other_losses.shape}')
    xs = np.asarray(other_tokens, dtype=np.float64)
    other_mean = other_losses.mean(axis=0)
    other_seeds, reference_seeds = other_losses.shape[0], reference_losses.shape[0]
    at = np.linspace(xs[0], xs[-1], grid)
    # each seed's curve interpolated, then the spread over seeds: the variance of the interpolated mean itself
    other_at = np.stack([np.interp(at, xs, curve) for curve in other_losses])
    mean_at = other_at.mean(axis=0)
    var_at = other_at.var(axis=0, ddof=1) / other_seeds if other_seeds > 1 else np.zeros_like(mean_at)
    rows = []
    for point in range(reference_losses.shape[1]):
        tokens, loss = float(reference_tokens[:, point].mean()), float(reference_losses[:, point].mean())
        needed = first_reach(xs, other_mean, loss)
        reference_var = reference_losses[:, point].var(ddof=1) / reference_seeds if reference_seeds > 1 else 0.0
        interval = [None, None]
        variance = reference_var + var_at
        denominator = ((reference_var ** 2 / (reference_seeds - 1) if reference_seeds > 1 else 0.0)
                       + (var_at ** 2 / (other_seeds - 1) if other_seeds > 1 else 0.0))
        if (reference_seeds > 1 or other_seeds > 1) and tokens > 0:
            with np.errstate(divide='ignore', invalid='ignore'):
                freedom = np.where(denominator > 0, variance ** 2 / denominator, np.inf)
            quantile = np.array([t975(int(max(1, math.floor(df)))) if np.isfinite(df) else Z975 for df in freedom])
            margin = quantile * np.sqrt(variance)
            gap = mean_at - loss
            not_above, below = np.flatnonzero(gap <= margin), np.flatnonzero(gap < -margin)
            if not_above.size:
                later_below = below[below > not_above[0]]
                interval = [float(at[not_above[0]] / tokens),
                            float(at[later_below[0]] / tokens) if later_below.size else None]
        rows.append({'tokens': tokens, 'loss': loss, 'other_tokens_needed': needed,
                     'ratio': None if needed is None or tokens <= 0 else needed / tokens,
                     'ratio_ci95': interval, 'interval': 'welch_t'})
    return rows
