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

``shared=True`` (the servable DHA) keeps what serving engines take, plain GQA up to a permutation of the query
heads: one count per layer for both K and V, priced at its K cost plus its V cost and spending two heads of the
total, and one partition per layer for both, grouped on the layer's K and V matrices together
(``shared_kv_matrices``). With counts that divide the heads, every group is the same size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

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


def reachable_totals(num_slots: int, counts: Sequence[int], unit: int = 1) -> list[int]:
    """Every total that ``num_slots`` slots reach, each taking one of ``counts`` and spending ``unit`` heads per
    count (2 when one count serves both K and V), in increasing order."""
    if num_slots < 1 or not counts:
        raise ValueError(f'need at least one slot and one count, got {num_slots} slots and counts {list(counts)}')
    reach = np.zeros(num_slots * unit * max(counts) + 1, dtype=bool)
    reach[0] = True
    for _ in range(num_slots):
        extended = np.zeros_like(reach)
        for count in counts:
            extended[unit * count:] |= reach[:len(reach) - unit * count]
        reach = extended
    return [int(total) for total in np.flatnonzero(reach)]


def totals_text(totals: Sequence[int]) -> str:
    """A sorted list of totals in words, as runs: '4 to 16 in steps of 2, 20, 24 to 32 in steps of 4' ('2 to 6'
    for steps of 1)."""
    runs: list[list[int]] = []
    for total in totals:
        if len(runs[-1:]) and (len(runs[-1]) == 1 or total - runs[-1][-1] == runs[-1][1] - runs[-1][0]):
            runs[-1].append(total)
        else:
            runs.append([total])
    parts = []
    for run in runs:
        if len(run) <= 2:
            parts.extend(str(total) for total in run)
        else:
            step = run[1] - run[0]
            parts.append(f'{run[0]} to {run[-1]}' + (f' in steps of {step}' if step > 1 else ''))
    return ', '.join(parts)


def allocate_kv_heads(cost: Any, num_layers: int, num_heads: int, total_heads: int,
                      allowed: Sequence[int] | None = None, shared: bool = False) -> list[tuple[int, int]]:
    """(K count, V count) per layer, summing exactly to ``total_heads`` over all layers and both kinds, at least cost:
    ``allocate_slots`` over the 2L (layer, kind) slots. With ``shared``, over L slots instead, one per layer: the
    layer's K and V take the same count, which costs its K cost plus its V cost and spends two heads of the total.
    Raises ValueError, naming the totals that are reachable, when no choice of allowed counts reaches the total."""
    if num_layers < 1:
        raise ValueError(f'num_layers must be >= 1, got {num_layers}')
    counts = _allowed_counts(num_heads, allowed)
    cost_of = _cost_fn(cost)
    if shared:
        what = f'{num_layers} layers x one count for K and V together'
        slots, unit = [(layer,) for layer in range(num_layers)], 2

        def slot_cost(slot: int, units: int) -> float:
            return cost_of(slot, KEY, units // 2) + cost_of(slot, VALUE, units // 2)
    else:
        what = f'{num_layers} layers x K and V'
        slots, unit = [(layer, kind) for layer in range(num_layers) for kind in KINDS], 1

        def slot_cost(slot: int, units: int) -> float:
            return cost_of(*slots[slot], units)
    lowest, highest = len(slots) * unit * counts[0], len(slots) * unit * counts[-1]

    def unreachable(reason: str) -> ValueError:
        return ValueError(f'total_heads={total_heads} is unreachable with counts {counts} over {what}: {reason}; '
                          f'reachable totals: {totals_text(reachable_totals(len(slots), counts, unit))}')

    if not lowest <= total_heads <= highest:
        raise unreachable(f'reachable totals lie between {lowest} and {highest}')
    picked = allocate_slots(slot_cost, len(slots), [unit * count for count in counts], total_heads,
                            what=lambda slot: ', '.join(f'{name}={value}' for name, value in
                                                        zip(('layer', 'kind'), slots[slot])))
    if picked is None:
        raise unreachable(f'reachable totals lie between {lowest} and {highest} but not every total in between is '
                          'a sum of allowed counts (nor may a finite-cost choice reach it)')
    if shared:
        return [(units // 2, units // 2) for units in picked]
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


def shared_kv_matrices(similarities: Any, normalise: bool = True) -> torch.Tensor:
    """(L, H, H) from a (2L, H, H) stack (every layer's K first, then every V): the mean of each layer's K and V
    matrices, what ``shared`` grouping anneals on. With ``normalise`` each matrix is first divided by the mean
    absolute value of its off-diagonal entries, so that neither kind's scale outweighs the other's (the DHA Search's
    Eq. 6 distances follow the weight scales: a rescaled W_k, with W_q rescaled inversely, is the same model with
    other distances); a matrix whose off-diagonal entries are all zero is taken as it is. Scale-free measures (CKA)
    can skip it."""
    matrices = similarities if torch.is_tensor(similarities) else torch.as_tensor(np.asarray(similarities), device='cpu')
    if matrices.ndim != 3 or matrices.shape[0] % 2 or matrices.shape[1] != matrices.shape[2]:
        raise ValueError(f'expected a (2L, H, H) stack of K then V matrices, got shape {tuple(matrices.shape)}')
    if normalise and matrices.shape[-1] > 1:
        off = ~torch.eye(matrices.shape[-1], dtype=torch.bool, device=matrices.device)
        scale = matrices[:, off].abs().mean(dim=1)
        matrices = matrices / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None, None]
    num_layers = len(matrices) // 2
    return (matrices[:num_layers] + matrices[num_layers:]) / 2


def group_at_counts(similarities: Any, counts: Sequence[int], *, restarts: int = 8, steps: int | None = None,
                    seed: int = 0) -> list:
    """Matrix i of a stack grouped by annealing into ``counts[i]`` equal groups: one batched annealing per distinct
    count. Returns one partition per matrix."""
    if len(similarities) != len(counts):
        raise ValueError(f'{len(similarities)} matrices but {len(counts)} counts')
    partitions: list = [None] * len(counts)
    for count in sorted(set(counts)):
        indices = [index for index, c in enumerate(counts) if c == count]
        grouped = anneal_equal_groups_batch(similarities[indices], count, restarts=restarts, steps=steps, seed=seed)
        for index, partition in zip(indices, grouped):
            partitions[index] = partition
    return partitions


def group_at_allocation(similarities: Any, allocation: Sequence[tuple[int, int]], *, restarts: int = 8,
                        steps: int | None = None, seed: int = 0, shared: bool = False,
                        normalise: bool = True) -> tuple[list, list]:
    """Each (layer, kind) matrix of a (2L, H, H) stack (every layer's K first, then every V) grouped by annealing
    into the number of equal groups ``allocation`` gives it. With ``shared`` (where every layer's K and V counts
    agree), each layer is grouped once, on ``shared_kv_matrices(similarities, normalise)``, and K and V get that
    one partition. Returns (key partitions, value partitions)."""
    num_layers = len(allocation)
    if len(similarities) != 2 * num_layers:
        raise ValueError(f'expected {2 * num_layers} matrices (K then V for {num_layers} layers), got {len(similarities)}')
    if shared:
        apart = [layer for layer, (keys, values) in enumerate(allocation) if keys != values]
        if apart:
            raise ValueError(f'shared grouping needs the same K and V count in every layer; layers {apart} differ')
        partitions = group_at_counts(shared_kv_matrices(similarities, normalise), [keys for keys, _ in allocation],
                                     restarts=restarts, steps=steps, seed=seed)
        return partitions, list(partitions)
    wanted = [allocation[layer][kind] for kind in KINDS for layer in range(num_layers)]
    partitions = group_at_counts(similarities, wanted, restarts=restarts, steps=steps, seed=seed)
    return partitions[:num_layers], partitions[num_layers:]


def group_and_allocate(similarities: Any, num_layers: int, num_heads: int, total_heads: int,
                       group_cost: Callable[[Any, list], float], *, restarts: int = 8, steps: int | None = None,
                       seed: int = 0, allowed: Sequence[int] | None = None, shared: bool = False,
                       normalise: bool = True):
    """Per-layer K and V groupings meeting one total head budget (DHA Search, seed 000 section 4.3).

    ``similarities`` is a (2L, H, H) stack, every layer's K matrix first, then every layer's V matrix. Each matrix is
    grouped by annealing at every allowed count; ``group_cost(matrix, partition)`` prices that best grouping, and
    ``allocate_kv_heads`` picks the counts. With ``shared``, each layer is grouped once per count on
    ``shared_kv_matrices(similarities, normalise)``; that partition is priced on the K matrix plus on the V matrix,
    and the allocation gives K and V one count per layer. Returns (key partitions, value partitions, cost table).
    """
    counts = _allowed_counts(num_heads, allowed)
    if len(similarities) != 2 * num_layers:
        raise ValueError(f'expected {2 * num_layers} matrices (K then V for {num_layers} layers), got {len(similarities)}')
    grouped = shared_kv_matrices(similarities, normalise) if shared else similarities
    by_count = {count: anneal_equal_groups_batch(grouped, count, restarts=restarts, steps=steps, seed=seed)
                for count in counts}

    def partition(layer: int, kind: int, count: int) -> list:
        return by_count[count][layer if shared else kind * num_layers + layer]

    costs = [[{count: float(group_cost(similarities[kind * num_layers + layer], partition(layer, kind, count)))
               for count in counts} for kind in KINDS] for layer in range(num_layers)]
    allocation = allocate_kv_heads(costs, num_layers, num_heads, total_heads, allowed=counts, shared=shared)
    key_partitions = [partition(layer, KEY, k) for layer, (k, _) in enumerate(allocation)]
    value_partitions = [partition(layer, VALUE, v) for layer, (_, v) in enumerate(allocation)]
    return key_partitions, value_partitions, costs
