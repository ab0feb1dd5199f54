"""Head grouping searches: objective, incremental deltas, annealing, AsymGQA searches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dha_train.ops.fitness_search import asymmetric_search, symmetric_search
from dha_train.ops.grouping import (
    anneal_equal_groups,
    anneal_equal_groups_batch,
    assignment_to_partition,
    canonical_partition,
    full_rescore_anneal,
    full_rescore_anneal_batch,
    neighbour_groups,
    partition_to_assignment,
    swap_delta,
    validate_partition,
    within_group_score,
)


def planted(sizes: list[int], seed: int = 0, noise: float = 0.1) -> tuple[np.ndarray, list[list[int]]]:
    """Block similarity (1 inside a group, 0 across, plus symmetric noise) over randomly permuted heads."""
    rng = np.random.default_rng(seed)
    num_heads = sum(sizes)
    labels = np.repeat(np.arange(len(sizes)), sizes)[rng.permutation(num_heads)]
    similarity = (labels[:, None] == labels[None, :]).astype(float)
    jitter = rng.normal(scale=noise, size=(num_heads, num_heads))
    similarity += (jitter + jitter.T) / 2
    return similarity, assignment_to_partition(labels)


def random_symmetric(num_heads: int, rng: np.random.Generator) -> np.ndarray:
    a = rng.normal(size=(num_heads, num_heads))
    return a + a.T


def brute_score(similarity: np.ndarray, partition: list[list[int]]) -> float:
    return sum(similarity[i, j] for group in partition for i in group for j in group if i < j)


def test_within_group_score_counts_unordered_pairs_and_accepts_torch():
    similarity = random_symmetric(6, np.random.default_rng(0))
    partition = [[0, 3], [1, 2, 5], [4]]
    expected = brute_score(similarity, partition)
    assert within_group_score(similarity, partition) == pytest.approx(expected, abs=1e-12)
    assert within_group_score(torch.tensor(similarity), partition) == pytest.approx(expected, abs=1e-12)


def test_swap_delta_equals_full_rescore_difference():
    rng = np.random.default_rng(1)
    for _ in range(300):
        num_heads = int(rng.integers(2, 13))
        similarity = random_symmetric(num_heads, rng)
        assignment = rng.integers(int(rng.integers(2, num_heads + 1)), size=num_heads)
        i, j = rng.choice(num_heads, size=2, replace=False)
        if assignment[i] == assignment[j]:
            continue
        swapped = assignment.copy()
        swapped[i], swapped[j] = assignment[j], assignment[i]
        before = within_group_score(similarity, assignment_to_partition(assignment))
        after = within_group_score(similarity, assignment_to_partition(swapped))
        assert swap_delta(similarity, assignment, i, j) == pytest.approx(after - before, abs=1e-9)


def test_swap_delta_rejects_same_group():
    with pytest.raises(ValueError, match='different groups'):
        swap_delta(np.eye(4), [0, 0, 1, 1], 0, 1)


def test_annealing_recovers_planted_partition():
    similarity, truth = planted([4, 4, 4, 4], seed=3)
    assert anneal_equal_groups(similarity, 4, restarts=4, steps=1500, seed=0) == truth


def test_incremental_annealing_matches_full_rescore_and_is_deterministic():
    similarity = random_symmetric(16, np.random.default_rng(2))
    fast = anneal_equal_groups(similarity, 4, restarts=2, steps=800, seed=7)
    assert fast == full_rescore_anneal(similarity, 4, restarts=2, steps=800, seed=7)
    assert fast == anneal_equal_groups(similarity, 4, restarts=2, steps=800, seed=7)
    assert {len(group) for group in fast} == {4}
    validate_partition(fast, 16)
    assert within_group_score(similarity, fast) > within_group_score(similarity, neighbour_groups(16, 4))


def test_annealing_errors():
    with pytest.raises(ValueError, match='not divisible'):
        anneal_equal_groups(np.eye(6), 4)
    with pytest.raises(ValueError, match='symmetric'):
        anneal_equal_groups(np.triu(np.ones((4, 4))), 2)
    with pytest.raises(ValueError, match='square'):
        anneal_equal_groups(np.ones((4, 3)), 2)


def test_neighbour_groups_are_contiguous():
    assert neighbour_groups(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert neighbour_groups(6, 1) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match='not divisible'):
        neighbour_groups(6, 4)


def test_partition_validation_and_conversions():
    with pytest.raises(ValueError, match='exactly once'):
        validate_partition([[0, 1], [1, 2]], 3)
    with pytest.raises(ValueError, match='empty group'):
        validate_partition([[0, 1, 2], []], 3)
    assert canonical_partition([[3, 2], [1, 0]]) == [[0, 1], [2, 3]]
    assert assignment_to_partition(partition_to_assignment([[2, 0], [1, 3]], 4)) == [[0, 2], [1, 3]]


def recording_fitness(similarity: np.ndarray, num_groups: int, seen: list[list[list[int]]]):
    """Within-group score of S - 0.5: the planted partition is the unique best one with ``num_groups`` groups."""
    shifted = similarity - 0.5

    def fitness(partition: list[list[int]]) -> float:
        validate_partition(partition, len(similarity))
        assert len(partition) == num_groups and all(partition)
        seen.append(partition)
        return within_group_score(shifted, partition)

    return fitness


def _search_problem(sizes: list[int], seed: int):
    """A planted problem over 16 heads in 4 groups, its recording fitness, and the neighbour-grouping start."""
    similarity, truth = planted(sizes, seed=seed)
    seen: list[list[list[int]]] = []
    return similarity, truth, seen, recording_fitness(similarity, 4, seen), neighbour_groups(16, 4)


def test_symmetric_search_beats_neighbour_start_and_finds_planted():
    similarity, truth, seen, fitness, start = _search_problem([4, 4, 4, 4], seed=5)
    best, best_fitness = symmetric_search(similarity, 4, fitness, iterations=300, seed=0, initial=start)
    assert best_fitness > fitness(start)
    assert best == truth and best_fitness == pytest.approx(fitness(truth))
    assert all({len(group) for group in partition} == {4} for partition in seen)
    again = symmetric_search(similarity, 4, recording_fitness(similarity, 4, []), iterations=300, seed=0,
                             initial=start)
    assert again == (best, best_fitness)


def test_asymmetric_search_finds_unequal_planted_groups_without_empty_groups():
    similarity, truth, seen, fitness, start = _search_problem([2, 6, 4, 4], seed=11)
    best, best_fitness = asymmetric_search(similarity, 4, fitness, iterations=600, seed=0, initial=start)
    assert best_fitness > fitness(start)
    assert best == truth
    assert sorted(len(group) for group in best) == [2, 4, 4, 6]
    assert len(seen) > 100  # the recording fitness checked every evaluated partition for 4 non-empty groups


def test_asymmetric_search_respects_min_group_size_and_random_reset():
    similarity, _ = planted([2, 6, 4, 4], seed=11)
    seen: list[list[list[int]]] = []
    best, _ = asymmetric_search(similarity, 4, recording_fitness(similarity, 4, seen), iterations=200, seed=1,
                                min_group_size=3, reset_to='random', p_reset=0.2)
    assert min(len(group) for partition in seen for group in partition) >= 3
    with pytest.raises(ValueError, match='min_group_size'):
        asymmetric_search(similarity, 4, lambda p: 0.0, iterations=1, min_group_size=5)


def test_batched_annealing_matches_reference_and_ignores_its_neighbours_in_the_batch():
    rng = np.random.default_rng(5)
    matrices = [random_symmetric(12, rng) for _ in range(3)]
    batch = anneal_equal_groups_batch(matrices, 3, restarts=3, steps=400, seed=11)
    assert batch == full_rescore_anneal_batch(matrices, 3, restarts=3, steps=400, seed=11)
    # Matrix b draws from stream (seed, b): replacing another matrix of the batch changes nothing for it.
    other = anneal_equal_groups_batch([random_symmetric(12, rng), matrices[1], matrices[2]], 3, restarts=3,
                                      steps=400, seed=11)
    assert other[1:] == batch[1:]
    assert batch[0] == anneal_equal_groups(matrices[0], 3, restarts=3, steps=400, seed=11)


def test_batched_annealing_recovers_planted_partitions_per_matrix():
    cases = [planted([4, 4, 4, 4], seed=seed) for seed in range(6)]
    found = anneal_equal_groups_batch(np.stack([s for s, _ in cases]), 4, restarts=4, steps=1500, seed=0)
    assert found == [truth for _, truth in cases]
    with pytest.raises(ValueError, match='same size'):
        anneal_equal_groups_batch([np.eye(4), np.eye(6)], 2)
