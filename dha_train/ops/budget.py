"""Per-layer K and V head budgets by dynamic programming (DHA Search, seed 000 section 4.3 and App. B.4).

One total KV-head budget is shared by the K and V projections of all layers, so K and V may get different counts
in a layer. Each (layer, kind) slot picks a head count from an allowed list (default: the divisors of H, so every
count forms equal groups); the counts must sum exactly to the total and minimise the summed cost. The paper's main
text calls this dynamic programming; its Alg. 5 adds heads in steps of 4 and can produce counts that do not divide H,
so it is not reproduced (DESIGN.md section 5).

Costs are ``cost[layer][kind][count]`` (any nested indexable: lists, dicts, arrays) or a callable
``cost(layer, kind, count)``; kind is ``KEY`` (0) or ``VALUE`` (1). ``fusion_loss_costs`` builds a table from
per-layer fusion-loss scores (what the DHA Search allocates from); ``group_at_allocation`` then groups each
(layer, kind) at the count it was given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dha_train.ops.grouping import anneal_equal_groups_batch

KEY, VALUE = 0, 1
KINDS = (KEY, VALUE)
CostFn = Callable[[int, int, int], float]


def divisors(n: int) -> list[int]:
    """Positive divisors of n in increasing order: the head counts that split n query heads into equal groups."""
    if n < 1:
        raise ValueError(f'need a positive integer, got {n}')
    return [d for d in range(1, n + 1) if n % d == 0]


def whole_head_count(fraction: float, heads: int, what: str = 'kv_budget') -> int:
    """``fraction`` of ``heads`` as a whole number of heads; a fraction in (0, 1] that does not give one (within
    1e-6) is refused, naming ``what``."""
    if not 0 < fraction <= 1:
        raise ValueError(f'{what} must be in (0, 1], got {fraction}')
    count = fraction * heads
    if abs(count - round(count)) > 1e-6:
        raise ValueError(f'{what} {fraction} of {heads} heads is not a whole number of heads ({count:g})')
    return int(round(count))


def _cost_fn(cost: Any) -> CostFn:
    if callable(cost):
        return cost
    return lambda layer, kind, count: cost[layer][kind][count]


def _allowed_counts(num_heads: int, allowed: Sequence[int] | None) -> list[int]:
    counts = divisors(num_heads) if allowed is None else sorted({int(c) for c in allowed})
    if not counts or counts[0] < 1 or counts[-1] > num_heads:
        raise ValueError(f'allowed head counts must be non-empty and within 1..{num_heads}, got {allowed}')
    return counts


def allocate_slots(cost_of: Callable[[int, int], float], num_slots: int, counts: Sequence[int], total: int,
                   what: Callable[[int], str] = str) -> list[int] | None:
    """One count per slot from ``counts`` (increasing, positive), summing exactly to ``total``, at least summed
    ``cost_of(slot, count)``; None when no choice reaches the total at a finite cost.

    A knapsack over the slots: ``best[t]`` is the least cost of the slots seen so far using t units in total, and
    each slot extends it by every allowed count. O(slots * |counts| * total) time; ties go to the smaller count in the
    earlier slot. The K/V head budget of the DHA Search and the latent ranks of an MLA conversion both use it.
    """
    best = np.full(total + 1, math.inf)
    best[0] = 0.0
    choices = np.zeros((num_slots, total + 1), dtype=np.int64)  # index into counts taken by each slot
    for slot in range(num_slots):
        candidates = np.full((len(counts), total + 1), math.inf)
        for index, count in enumerate(counts):
            if count > total:
                break
            value = float(cost_of(slot, count))
            if math.isnan(value):
                raise ValueError(f'cost({what(slot)}, count={count}) is NaN')
            candidates[index, count:] = best[:total + 1 - count] + value
        choices[slot] = candidates.argmin(axis=0)
        best = candidates[choices[slot], np.arange(total + 1)]
    if math.isinf(best[total]):
        return None
    picked = [0] * num_slots
    remaining = total
    for slot in reversed(range(num_slots)):
        picked[slot] = counts[choices[slot, remaining]]
        remaining -= picked[slot]
    return picked


def allocate_kv_heads(cost: Any, num_layers: int, num_heads: int, total_heads: int,
                      allowed: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(K count, V count) per layer, summing exactly to ``total_heads`` over all layers and both kinds, at least cost:
    ``allocate_slots`` over the 2L (layer, kind) slots. Raises ValueError when no choice of allowed counts reaches
    the total."""
    if num_layers < 1:
        raise ValueError(f'num_layers must be >= 1, got {num_layers}')
    counts = _allowed_counts(num_heads, allowed)
    lowest, highest = 2 * num_layers * counts[0], 2 * num_layers * counts[-1]
    if not lowest <= total_heads <= highest:
        raise ValueError(f'total_heads={total_heads} is unreachable with counts {counts} over {num_layers} layers x '
                         f'K and V: reachable totals lie between {lowest} and {highest}')
    cost_of = _cost_fn(cost)
    slots = [(layer, kind) for layer in range(num_layers) for kind in KINDS]
    picked = allocate_slots(lambda slot, count: cost_of(*slots[slot], count), len(slots), counts, total_heads,
                            what=lambda slot: f'layer={slots[slot][0]}, kind={slots[slot][1]}')
    if picked is None:
        raise ValueError(f'total_heads={total_heads} is unreachable with counts {counts} over {num_layers} layers x '
                         f'K and V: reachable totals lie between {lowest} and {highest} but not every total in '
                         f'between is a sum of allowed counts (nor may a finite-cost choice reach it)')
    return [(picked[2 * layer], picked[2 * layer + 1]) for layer in range(num_layers)]


def allocation_cost(cost: Any, allocation: Sequence[tuple[int, int]]) -> float:
    """Total cost of an allocation [(K count, V count) per layer] under the same cost table or callable."""
    cost_of = _cost_fn(cost)
    return float(sum(cost_of(layer, kind, counts[kind]) for layer, counts in enumerate(allocation) for kind in KINDS))


def compression_penalty(count: int, num_heads: int) -> float:
    """H / count - 1: zero at full MHA, growing with the number of query heads that share one K or V head."""
    return num_heads / count - 1.0


def fusion_loss_costs(scores: Sequence[Sequence[float]] | np.ndarray, num_heads: int,
                      allowed: Sequence[int] | None = None,
                      penalty: Callable[[int, int], float] = compression_penalty) -> list[list[dict[int, float]]]:
    """Cost table ``cost[layer][kind][count] = scores[layer][kind] * penalty(count, num_heads)``.

    ``scores`` is (L, 2): each layer's fusion loss for K and for V (the DHA Search passes the omega-space loss of
    Eq. 7 / Alg. 3, averaged over the Search). The product is a modelling choice, not the paper's formula: Alg. 5
    only says that layers with a higher fusion loss get more heads, and a cost that grows with score x compression
    gives exactly that under the DP. Swap ``penalty`` (or pass any callable to ``allocate_kv_heads``) to model it
    differently.
    """
    table = np.asarray(scores, dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != 2:
        raise ValueError(f'scores must have shape (num_layers, 2) for K and V, got {table.shape}')
    if not np.isfinite(table).all():
        raise ValueError('scores contain NaN or infinite entries')
    counts = _allowed_counts(num_heads, allowed)
    return [[{count: float(table[layer, kind]) * penalty(count, num_heads) for count in counts} for kind in KINDS]
            for layer in range(table.shape[0])]


def group_at_allocation(similarities: Any, allocation: Sequence[tuple[int, int]], *, restarts: int = 8,
                        steps: int | None = None, seed: int = 0) -> tuple[list, list]:
    """Each (layer, kind) matrix of a (2L, H, H) stack (every layer's K first, then every V) grouped by annealing
    into the number of equal groups ``allocation`` gives it. Returns (key partitions, value partitions)."""
    num_layers = len(allocation)
    if len(similarities) != 2 * num_layers:
        raise ValueError(f'expected {2 * num_layers} matrices (K then V for {num_layers} layers), got {len(similarities)}')
    wanted = [allocation[layer][kind] for kind in KINDS for layer in range(num_layers)]
    partitions: list = [None] * len(wanted)
    for count in sorted(set(wanted)):  # one batched annealing per distinct count
        indices = [index for index, c in enumerate(wanted) if c == count]
        grouped = anneal_equal_groups_batch(similarities[indices], count, restarts=restarts, steps=steps, seed=seed)
        for index, partition in zip(indices, grouped):
            partitions[index] = partition
    return partitions[:num_layers], partitions[num_layers:]


def group_and_allocate(similarities: Any, num_layers: int, num_heads: int, total_heads: int,
                       group_cost: Callable[[Any, list], float], *, restarts: int = 8, steps: int | None = None,
                       seed: int = 0, allowed: Sequence[int] | None = None):
    """Per-layer K and V groupings meeting one total head budget (DHA Search, seed 000 section 4.3).

    ``similarities`` is a (2L, H, H) stack, every layer's K matrix first, then every layer's V matrix. Each matrix is
    grouped by annealing at every allowed count; ``group_cost(matrix, partition)`` prices that best grouping, and
    ``allocate_kv_heads`` picks the counts. Returns (key partitions, value partitions, cost table).
    """
    counts = _allowed_counts(num_heads, allowed)
    if len(similarities) != 2 * num_layers:
        raise ValueError(f'expected {2 * num_layers} matrices (K then V for {num_layers} layers), got {len(similarities)}')
    by_count = {count: anneal_equal_groups_batch(similarities, count, restarts=restarts, steps=steps, seed=seed)
                for count in counts}
    costs = [[{count: float(group_cost(similarities[kind * num_layers + layer], by_count[count][kind * num_layers + layer]))
               for count in counts} for kind in KINDS] for layer in range(num_layers)]
    allocation = allocate_kv_heads(costs, num_layers, num_heads, total_heads, allowed=counts)
    key_partitions = [by_count[k][layer] for layer, (k, _) in enumerate(allocation)]
    value_partitions = [by_count[v][num_layers + layer] for layer, (_, v) in enumerate(allocation)]
    return key_partitions, value_partitions, costs
