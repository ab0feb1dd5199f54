"""AsymGQA's fitness-driven head groupings (seed 004 App. A): ``symmetric_search`` (Alg. 1: equal groups, swaps)
and ``asymmetric_search`` (Alg. 2: groups of any size, moves), each maximising a caller's fitness of a partition from a
start drawn with the head similarity. Partitions and assignments as in ``dha_train.ops.grouping``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from dha_train.ops.grouping import (
    Partition,
    as_similarity,
    assignment_to_partition,
    check_equal_groups,
    partition_to_assignment,
)

Fitness = Callable[[Partition], float]


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f'{name} must be a probability in [0, 1], got {value}')


def _random_assignment(rng: np.random.Generator, num_heads: int, num_groups: int) -> np.ndarray:
    """A random grouping with near-equal sizes (equal when H divides): Alg. 1/2's P ~ Uniform(permutation(S))."""
    assignment = np.empty(num_heads, dtype=np.int64)
    for group_id, heads in enumerate(np.array_split(rng.permutation(num_heads), num_groups)):
        assignment[heads] = group_id
    return assignment


def _similar_head(rng: np.random.Generator, matrix: np.ndarray, assignment: np.ndarray, head: int,
                  top_k: int) -> int:
    """Uniform pick among the top-k heads most similar to ``head`` outside its group (Alg. 1/2: H <- top-k(S, a))."""
    outside = np.flatnonzero(assignment != assignment[head])
    order = np.argsort(-matrix[head, outside], kind='stable')[:top_k]
    return int(outside[order[rng.integers(len(order))]])


def _start(rng: np.random.Generator, initial: Sequence[Sequence[int]] | None, num_heads: int,
           num_groups: int) -> np.ndarray:
    if initial is None:
        return _random_assignment(rng, num_heads, num_groups)
    if len(initial) != num_groups:
        raise ValueError(f'initial partition has {len(initial)} groups, expected {num_groups}')
    return partition_to_assignment(initial, num_heads)


def _fitness_search(similarity: Any, num_groups: int, fitness: Fitness, propose: Callable[..., np.ndarray | None],
                    iterations: int, top_k: int, p_acc: float, p_reset: float, reset_to: str, seed: int,
                    initial: Sequence[Sequence[int]] | None) -> tuple[Partition, float]:
    """The loop shared by Alg. 1 and 2: reset, propose a move towards a similar head, accept, track the best.

    Acceptance: a proposal is taken when it beats the *current* grouping, or with probability p_acc otherwise. Alg. 1
    compares against the best accuracy seen instead; with ``reset_to='best'`` the two differ only after a p_acc step.
    """
    matrix = as_similarity(similarity)
    num_heads = matrix.shape[0]
    if not 1 <= num_groups <= num_heads:
        raise ValueError(f'num_groups must be in 1..{num_heads}, got {num_groups}')
    if iterations < 0 or top_k < 1:
        raise ValueError(f'need iterations >= 0 and top_k >= 1, got iterations={iterations}, top_k={top_k}')
    _check_probability('p_acc', p_acc)
    _check_probability('p_reset', p_reset)
    if reset_to not in ('best', 'random'):
        raise ValueError(f"reset_to must be 'best' or 'random', got {reset_to!r}")

    rng = np.random.default_rng(seed)
    current = _start(rng, initial, num_heads, num_groups)
    current_fitness = float(fitness(assignment_to_partition(current)))
    best, best_fitness = current.copy(), current_fitness
    if num_groups in (1, num_heads):  # one group, or H groups of one (none may be empty): nothing to search
        return assignment_to_partition(best), best_fitness
    for _ in range(iterations):
        if rng.random() < p_reset:
            if reset_to == 'best':
                current, current_fitness = best.copy(), best_fitness
            else:
                current = _random_assignment(rng, num_heads, num_groups)
                current_fitness = float(fitness(assignment_to_partition(current)))
        head = int(rng.integers(num_heads))
        target = _similar_head(rng, matrix, current, head, top_k)
        proposal = propose(rng, current, head, target)
        if proposal is None:
            continue
        proposal_fitness = float(fitness(assignment_to_partition(proposal)))
        if proposal_fitness > current_fitness or rng.random() < p_acc:
            current, current_fitness = proposal, proposal_fitness
            if current_fitness > best_fitness:
                best, best_fitness = current.copy(), current_fitness
    return assignment_to_partition(best), best_fitness


def _swap_into_group(rng: np.random.Generator, assignment: np.ndarray, head: int, target: int) -> np.ndarray | None:
    """Move ``head`` into the group of ``target`` and send back another member of that group (sizes preserved).

    The member sent back excludes ``target`` itself, else the swap would separate the pair it meant to join.
    """
    group_a, group_b = assignment[head], assignment[target]
    others = np.flatnonzero(assignment == group_b)
    others = others[others != target]
    if len(others) == 0:
        return None
    proposal = assignment.copy()
    proposal[head] = group_b
    proposal[others[rng.integers(len(others))]] = group_a
    return proposal


def symmetric_search(similarity: Any, num_groups: int, fitness: Fitness, *, iterations: int, top_k: int = 3,
                     p_acc: float = 0.1, p_reset: float = 0.1, reset_to: Literal['best', 'random'] = 'best',
                     seed: int = 0, initial: Sequence[Sequence[int]] | None = None) -> tuple[Partition, float]:
    """Equal-size grouping search driven by a caller's fitness (seed 004 App. A, Alg. 1). Higher fitness is better.

    Per iteration: with probability p_reset reset the current grouping; pick a random head a, pick b uniformly among
    the top_k heads most similar to a outside a's group, swap a with another member of b's group; evaluate the
    fitness (one call per iteration); accept when it improves on the current grouping, or with probability p_acc.
    ``reset_to='best'`` returns to the best grouping seen (no extra fitness call); ``'random'`` draws a fresh random
    equal grouping as Alg. 1 line 292 does (one extra fitness call). The start is random unless ``initial`` is given.
    Paper settings: top_k=3, p_acc=0.1, p_reset=0.1. Returns (best partition, its fitness).
    """
    matrix = as_similarity(similarity)
    check_equal_groups(matrix.shape[0], num_groups)
    if initial is not None and len({len(group) for group in initial}) != 1:
        raise ValueError(f'initial partition {initial} must have equal group sizes')
    return _fitness_search(matrix, num_groups, fitness, _swap_into_group, iterations, top_k, p_acc, p_reset,
                           reset_to, seed, initial)


def asymmetric_search(similarity: Any, num_groups: int, fitness: Fitness, *, iterations: int,
                      p_preserve: float = 0.2, top_k: int = 3, p_acc: float = 0.1, p_reset: float = 0.1,
                      reset_to: Literal['best', 'random'] = 'best', seed: int = 0, min_group_size: int = 1,
                      initial: Sequence[Sequence[int]] | None = None) -> tuple[Partition, float]:
    """Grouping search whose groups may differ in size (AsymGQA, seed 004 App. A, Alg. 2). Higher fitness is better.

    As ``symmetric_search``, but the move is: with probability p_preserve a size-preserving swap (a joins b's group,
    another member of b's group goes back to a's group, Alg. 2 lines "if y < p_preserve"), otherwise a alone moves
    into b's group, changing both sizes by one. The number of groups stays ``num_groups``: a move that would leave
    a's group below ``min_group_size`` (never empty) is replaced by the swap, and a swap impossible because b is
    alone in its group is replaced by the move; when neither is allowed the iteration is skipped.

    Paper ambiguity: the text says a larger p_preserve gives more unbalanced groups, but Alg. 2 and the parameter's
    name make p_preserve the probability of keeping sizes; we follow the algorithm (paper setting p_preserve=0.2).
    Random starts and ``reset_to='random'`` resets use near-equal sizes (Alg. 2 draws groups of size m).
    """
    matrix = as_similarity(similarity)
    num_heads = matrix.shape[0]
    _check_probability('p_preserve', p_preserve)
    if min_group_size < 1 or num_groups * min_group_size > num_heads:
        raise ValueError(f'min_group_size={min_group_size} is impossible for {num_groups} groups of {num_heads} heads')
    if initial is not None and min(len(group) for group in initial) < min_group_size:
        raise ValueError(f'initial partition {initial} has a group smaller than min_group_size={min_group_size}')

    def move_into_group(rng: np.random.Generator, assignment: np.ndarray, head: int,
                        target: int) -> np.ndarray | None:
        can_move = int((assignment == assignment[head]).sum()) > min_group_size
        if rng.random() < p_preserve or not can_move:
            swapped = _swap_into_group(rng, assignment, head, target)
            if swapped is not None or not can_move:
                return swapped
        proposal = assignment.copy()
        proposal[head] = assignment[target]
        return proposal

    return _fitness_search(matrix, num_groups, fitness, move_into_group, iterations, top_k, p_acc, p_reset,
                           reset_to, seed, initial)
