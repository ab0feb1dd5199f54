"""Per-layer K/V head budget allocation by dynamic programming."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dha_train.ops.budget import KEY, VALUE, allocate_kv_heads, allocation_cost, divisors, fusion_loss_costs


def random_table(num_layers: int, num_heads: int, rng: np.random.Generator) -> list[list[dict[int, float]]]:
    return [[{c: float(rng.random()) for c in divisors(num_heads)} for _ in range(2)] for _ in range(num_layers)]


def brute_force(table, num_layers: int, num_heads: int, total: int) -> float:
    counts = divisors(num_heads)
    best = np.inf
    for choice in itertools.product(counts, repeat=2 * num_layers):
        if sum(choice) == total:
            allocation = [(choice[2 * layer], choice[2 * layer + 1]) for layer in range(num_layers)]
            best = min(best, allocation_cost(table, allocation))
    return best


@pytest.mark.parametrize('num_heads', [4, 8])
def test_dp_matches_brute_force_for_every_total(num_heads):
    rng = np.random.default_rng(num_heads)
    num_layers = 3
    table = random_table(num_layers, num_heads, rng)
    for total in range(2 * num_layers, 2 * num_layers * num_heads + 1):
        expected = brute_force(table, num_layers, num_heads, total)
        if np.isinf(expected):  # e.g. 23 heads from six counts in {1, 2, 4}
            with pytest.raises(ValueError, match='not every total'):
                allocate_kv_heads(table, num_layers, num_heads, total)
            continue
        allocation = allocate_kv_heads(table, num_layers, num_heads, total)
        assert sum(k + v for k, v in allocation) == total
        assert all(k in divisors(num_heads) and v in divisors(num_heads) for k, v in allocation)
        assert allocation_cost(table, allocation) == pytest.approx(expected)


def test_callable_costs_and_custom_allowed_counts():
    allocation = allocate_kv_heads(lambda layer, kind, count: (layer + 1) * (kind + 1) / count, 4, 32, 64,
                                   allowed=[4, 8, 16])
    assert sum(k + v for k, v in allocation) == 64
    assert all(c in (4, 8, 16) for pair in allocation for c in pair)


def test_unreachable_totals_raise_clear_errors():
    table = random_table(2, 8, np.random.default_rng(0))
    with pytest.raises(ValueError, match='between 4 and 32'):
        allocate_kv_heads(table, 2, 8, 33)
    with pytest.raises(ValueError, match='between 4 and 32'):
        allocate_kv_heads(table, 2, 8, 3)
    with pytest.raises(ValueError, match='not every total'):
        allocate_kv_heads(lambda layer, kind, count: 0.0, 2, 32, 18, allowed=[4, 8])


def test_fusion_loss_costs_give_more_heads_to_higher_loss():
    scores = np.array([[4.0, 1.0], [1.0, 0.25], [2.0, 0.5], [0.5, 0.1]])
    table = fusion_loss_costs(scores, 8)
    allocation = allocate_kv_heads(table, 4, 8, 16)
    assert sum(k + v for k, v in allocation) == 16
    assert allocation[0][KEY] >= allocation[0][VALUE]
    assert allocation[0][KEY] >= max(k for k, _ in allocation[1:])
    assert table[1][VALUE][8] == 0.0 and table[1][KEY][2] == pytest.approx(3.0)
    with pytest.raises(ValueError, match='shape'):
        fusion_loss_costs(np.ones((3, 3)), 8)
