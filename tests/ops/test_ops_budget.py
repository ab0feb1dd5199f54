"""Per-layer K/V head budget allocation by dynamic programming."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dha_train.ops.budget import (
    KEY,
    VALUE,
    allocate_kv_heads,
    allocation_cost,
    divisors,
    fusion_loss_costs,
    group_at_allocation,
    reachable_totals,
    shared_kv_matrices,
    totals_text,
)


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


# --- shared K/V counts (the servable DHA) ----------------------------------------------------------------------

def brute_force_shared(table, num_layers: int, num_heads: int, total: int) -> float:
    """The least K + V cost over every choice of one count per layer with 2 x (sum of counts) == total."""
    best = np.inf
    for choice in itertools.product(divisors(num_heads), repeat=num_layers):
        if 2 * sum(choice) == total:
            best = min(best, allocation_cost(table, [(count, count) for count in choice]))
    return best


@pytest.mark.parametrize('num_heads', [3, 6, 8])
def test_shared_dp_matches_brute_force_for_every_total(num_heads):
    rng = np.random.default_rng(100 + num_heads)
    num_layers = 4
    table = random_table(num_layers, num_heads, rng)
    reachable = reachable_totals(num_layers, divisors(num_heads), unit=2)
    for total in range(1, 2 * num_layers * num_heads + 2):
        expected = brute_force_shared(table, num_layers, num_heads, total)
        assert (total in reachable) == np.isfinite(expected)
        if np.isinf(expected):  # every odd total, and e.g. 10 from four counts in {1, 3}
            with pytest.raises(ValueError, match='reachable totals: '):
                allocate_kv_heads(table, num_layers, num_heads, total, shared=True)
            continue
        allocation = allocate_kv_heads(table, num_layers, num_heads, total, shared=True)
        assert all(k == v and num_heads % k == 0 for k, v in allocation)
        assert sum(k + v for k, v in allocation) == total
        assert allocation_cost(table, allocation) == pytest.approx(expected)


def test_the_shared_constraint_changes_the_answer_where_k_and_v_costs_disagree():
    """Layer 0's K resists fusing and its V does not, layer 1 the other way: unconstrained, each layer keeps 4 heads
    of one kind and 1 of the other; shared, each layer has one count for both, at a higher cost."""
    heads, total = 4, 10

    def cost(layer, kind, count):
        return (10.0 if kind == layer else 0.1) * (heads / count - 1)

    free = allocate_kv_heads(cost, 2, heads, total)
    shared = allocate_kv_heads(cost, 2, heads, total, shared=True)
    assert free == [(4, 1), (1, 4)]
    assert all(k == v for k, v in shared) and sum(k + v for k, v in shared) == total
    assert allocation_cost(cost, shared) > allocation_cost(cost, free)


def test_reachable_totals_closed_form_and_in_words():
    # SmolLM2: 30 layers, counts 1 or 3 for K and V together: 60 + 4x heads for x layers at 3
    assert reachable_totals(30, [1, 3], unit=2) == list(range(60, 181, 4))
    assert reachable_totals(2, [1, 2, 4]) == [2, 3, 4, 5, 6, 8]
    assert totals_text([2, 3, 4, 5, 6, 8]) == '2 to 6, 8'
    assert totals_text(list(range(60, 181, 4))) == '60 to 180 in steps of 4'
    assert totals_text([4, 12]) == '4, 12'
    with pytest.raises(ValueError, match=r'total_heads=122 .*reachable totals: 60 to 180 in steps of 4'):
        allocate_kv_heads(lambda *_: 0.0, 30, 3, 122, shared=True)
    with pytest.raises(ValueError, match=r'reachable totals lie between 60 and 180'):
        allocate_kv_heads(lambda *_: 0.0, 30, 3, 182, shared=True)


def test_shared_kv_matrices_weigh_k_and_v_alike_whatever_their_scale():
    rng = np.random.default_rng(3)
    key, value = torch.as_tensor(rng.random((2, 4, 4))), torch.as_tensor(rng.random((2, 4, 4)))
    key, value = key + key.transpose(1, 2), value + value.transpose(1, 2)
    stack = torch.cat([key, value])
    torch.testing.assert_close(shared_kv_matrices(stack, normalise=False), (key + value) / 2, rtol=0, atol=0)
    # rescaling one kind's matrix (what rescaling W_k does to its Eq. 6 distances) leaves the shared matrix alone
    torch.testing.assert_close(shared_kv_matrices(torch.cat([30 * key, value])), shared_kv_matrices(stack))
    off = ~torch.eye(4, dtype=torch.bool)
    mean_off = shared_kv_matrices(stack)[:, off].abs().mean(dim=1)
    torch.testing.assert_close(mean_off, torch.ones(2, dtype=torch.float64))  # both kinds scaled to mean 1


def test_shared_grouping_gives_k_and_v_one_partition_from_both_matrices():
    """Layer 0: K clusters {0,1},{2,3}; V says nothing (flat); scaled 100x smaller. Layer 1: K flat, V clusters
    {0,2},{1,3}. The shared partition follows whichever kind has structure, at the shared counts."""
    def clusters(labels, scale=1.0):
        labels = torch.tensor(labels)
        return scale * (labels[:, None] == labels[None, :]).double()

    flat = torch.zeros(4, 4, dtype=torch.float64)
    stack = torch.stack([clusters([0, 0, 1, 1], 0.01), flat, flat, clusters([0, 1, 0, 1])])
    keys, values = group_at_allocation(stack, [(2, 2), (2, 2)], shared=True, restarts=4)
    assert keys == values
    assert sorted(map(sorted, keys[0])) == [[0, 1], [2, 3]] and sorted(map(sorted, keys[1])) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match='same K and V count'):
        group_at_allocation(stack, [(2, 1), (2, 2)], shared=True)
