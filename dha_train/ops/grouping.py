"""Head grouping searches on a per-layer head similarity matrix.

Everything here maximises *similarity*: S[i, j] is large when heads i and j should share a K (or V) head. Callers
holding a distance (DHA's fusion loss L_head, Eq. 6) pass its negation.

- ``within_group_score``: the objective of seed 001 Eq. 23-24 and of seed 000 Alg. 4's CALCULATE_SCORE.
- ``anneal_equal_groups`` / ``anneal_equal_groups_batch``: simulated annealing over equal-size groups with random
  restarts (seed 000 Alg. 4, seed 001 Alg. 2), with O(1) incremental swap deltas instead of a full rescore per
  proposal, and every restart of every matrix (layer, K/V) run side by side in numpy (DESIGN.md section 6).
  ``full_rescore_anneal(_batch)`` is the anchors' per-pair Python rescore on the same random draws: the reference.
- AsymGQA's fitness-driven searches are ``dha_train.ops.fitness_search``.
- ``neighbour_groups``: contiguous equal groups, the GQA baseline (seed 004 section 2.1).

A partition is a list of groups; each group is a sorted list of head indices, groups are sorted by their first head
and every head appears exactly once. An assignment is the same information as an int array head -> group id.
Scoring runs in float64 numpy; torch tensors are accepted as inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Partition = list[list[int]]


# ----------------------------------------------------------------------------------------------------------------
# Validation and conversions
# ----------------------------------------------------------------------------------------------------------------

def as_similarity(similarity: Any, *, atol: float = 1e-8) -> np.ndarray:
    """A float64 copy of a square, finite, symmetric matrix (numpy array, torch tensor or nested lists)."""
    if hasattr(similarity, 'detach'):  # torch tensor, possibly on an accelerator
        similarity = similarity.detach().cpu().double().numpy()
    matrix = np.array(similarity, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f'similarity must be a non-empty square matrix, got shape {matrix.shape}')
    if not np.isfinite(matrix).all():
        raise ValueError('similarity contains NaN or infinite entries')
    if not np.allclose(matrix, matrix.T, rtol=0.0, atol=atol * max(1.0, float(np.abs(matrix).max()))):
        raise ValueError('similarity must be symmetric (S[i, j] == S[j, i])')
    return matrix


def validate_partition(partition: Sequence[Sequence[int]], num_heads: int) -> None:
    """Raise ValueError unless ``partition`` has non-empty groups covering heads 0..num_heads-1 exactly once."""
    heads: list[int] = []
    for group in partition:
        if len(group) == 0:
            raise ValueError(f'empty group in partition {partition}')
        heads.extend(int(h) for h in group)
    if sorted(heads) != list(range(num_heads)):
        raise ValueError(f'partition {partition} must cover heads 0..{num_heads - 1} exactly once')


def canonical_partition(partition: Sequence[Sequence[int]]) -> Partition:
    """Sort heads inside each group and groups by their first head, so equal groupings compare equal."""
    return sorted((sorted(int(h) for h in group) for group in partition), key=lambda group: group[0])


def partition_to_assignment(partition: Sequence[Sequence[int]], num_heads: int) -> np.ndarray:
    """Partition -> int array head -> group id (group ids in the order the groups are given)."""
    validate_partition(partition, num_heads)
    assignment = np.empty(num_heads, dtype=np.int64)
    for group_id, group in enumerate(partition):
        assignment[list(group)] = group_id
    return assignment


def assignment_to_partition(assignment: Sequence[int] | np.ndarray) -> Partition:
    """Int array head -> group id -> canonical partition (group ids need not be contiguous)."""
    groups: dict[int, list[int]] = {}
    for head, group_id in enumerate(np.asarray(assignment).tolist()):
        groups.setdefault(group_id, []).append(head)
    return canonical_partition(groups.values())


def check_equal_groups(num_heads: int, num_groups: int) -> int:
    """Group size for an equal split; ValueError when the heads do not divide evenly."""
    if num_groups < 1 or num_groups > num_heads:
        raise ValueError(f'num_groups must be in 1..{num_heads}, got {num_groups}')
    if num_heads % num_groups:
        raise ValueError(f'{num_heads} heads cannot form {num_groups} equal groups '
                         f'({num_heads} is not divisible by {num_groups})')
    return num_heads // num_groups


# ----------------------------------------------------------------------------------------------------------------
# Objective and incremental deltas
# ----------------------------------------------------------------------------------------------------------------

def within_group_score(similarity: Any, partition: Sequence[Sequence[int]]) -> float:
    """Sum over groups of S[i, j] over unordered pairs i < j in the group (seed 001 Eq. 23-24).

    Seed 000 Alg. 4 computes the same number as the full double sum over each group divided by two; the diagonal
    (a head with itself) never counts.
    """
    matrix = as_similarity(similarity)
    validate_partition(partition, matrix.shape[0])
    return _assignment_score(_zero_diagonal(matrix), partition_to_assignment(partition, matrix.shape[0]))


def _zero_diagonal(matrix: np.ndarray) -> np.ndarray:
    out = matrix.copy()
    np.fill_diagonal(out, 0.0)
    return out


def _assignment_score(off_diagonal: np.ndarray, assignment: np.ndarray) -> float:
    """``within_group_score`` from an assignment, O(H^2): half the sum of S over same-group ordered pairs."""
    same_group = assignment[:, None] == assignment[None, :]
    return 0.5 * float(off_diagonal[same_group].sum())


def swap_delta(similarity: Any, assignment: Sequence[int] | np.ndarray, i: int, j: int) -> float:
    """Exact change of ``within_group_score`` when heads i and j (in different groups A and B) swap groups.

    After the swap i sits with B - {j} and j with A - {i}, so with A' = A - {i} and B' = B - {j} the change is
    sum_{k in B'} S[i, k] - sum_{k in A'} S[i, k] + sum_{k in A'} S[j, k] - sum_{k in B'} S[j, k].
    It reads only the two groups' members (one O(H) mask, no rescore). The annealer keeps these per-group sums
    cached (``_lockstep_anneal``), so its proposals cost O(1).
    """
    matrix = as_similarity(similarity)
    groups = np.asarray(assignment)
    if groups.shape != (matrix.shape[0],):
        raise ValueError(f'assignment must have one group id per head ({matrix.shape[0]}), got shape {groups.shape}')
    group_a, group_b = groups[i], groups[j]
    if group_a == group_b:
        raise ValueError(f'heads {i} and {j} are both in group {group_a}; a swap needs different groups')
    in_a = groups == group_a
    in_b = groups == group_b
    in_a[i] = False
    in_b[j] = False
    return float(matrix[i, in_b].sum() - matrix[i, in_a].sum() + matrix[j, in_a].sum() - matrix[j, in_b].sum())


# ----------------------------------------------------------------------------------------------------------------
# Simulated annealing over equal-size groups
# ----------------------------------------------------------------------------------------------------------------

def _default_temperatures(off_diagonal: np.ndarray, group_size: int) -> tuple[float, float]:
    """Start near the typical |swap delta| (about 2 sqrt(g) std(S)) so early swaps are accepted freely; end 1000x lower.

    Seed 000 Alg. 4 uses T = 100 -> 0.001 with alpha = 0.9 (about 110 proposals) on raw MSE scores; fixed absolute
    temperatures depend on the scale of S, so the defaults here scale with it instead.
    """
    spread = float(off_diagonal[~np.eye(off_diagonal.shape[0], dtype=bool)].std())
    t_start = 2.0 * math.sqrt(group_size) * spread if spread > 0 else 1.0
    return t_start, 1e-3 * t_start


@dataclass
class _AnnealDraws:
    """Every random number of one matrix's annealing, drawn up front so that engines consume identical proposals.

    ``starts[r]`` is restart r's initial members table (group, slot) -> head, as seed 000 Alg. 4 keeps it; proposal
    s of restart r swaps slot ``slot_a[r, s]`` of group ``group_a[r, s]`` with slot ``slot_b`` of ``group_b`` (a
    different group) and is accepted by Metropolis at ``temperatures[s]`` against ``uniforms[r, s]``.
    """

    starts: np.ndarray
    group_a: np.ndarray
    group_b: np.ndarray
    slot_a: np.ndarray
    slot_b: np.ndarray
    uniforms: np.ndarray
    temperatures: np.ndarray


def _draw(off_diagonal: np.ndarray, num_groups: int, restarts: int, steps: int, t_start: float | None,
          t_end: float | None, rng: np.random.Generator) -> _AnnealDraws:
    num_heads = off_diagonal.shape[0]
    group_size = num_heads // num_groups
    default_start, default_end = _default_temperatures(off_diagonal, group_size)
    t_start = default_start if t_start is None else t_start
    t_end = default_end if t_end is None else t_end
    if not 0 < t_end <= t_start:
        raise ValueError(f'temperatures must satisfy 0 < t_end <= t_start, got t_start={t_start}, t_end={t_end}')
    starts = np.stack([rng.permutation(num_heads).reshape(num_groups, group_size) for _ in range(restarts)])
    group_a = rng.integers(num_groups, size=(restarts, steps))
    group_b = (group_a + rng.integers(1, num_groups, size=(restarts, steps))) % num_groups
    slots = rng.integers(group_size, size=(2, restarts, steps))
    # Geometric cooling: T_s = t_start * (t_end / t_start) ** (s / (steps - 1)).
    temperatures = t_start * (t_end / t_start) ** (np.arange(steps) / max(steps - 1, 1))
    return _AnnealDraws(starts, group_a, group_b, slots[0], slots[1], rng.random((restarts, steps)), temperatures)


def _prepare(similarities: Any, num_groups: int, restarts: int, steps: int | None, t_start: float | None,
             t_end: float | None, seed: int) -> tuple[list[np.ndarray], list[_AnnealDraws] | None, int]:
    """Validate a batch of same-size similarity matrices and draw each one's proposals from stream (seed, index)."""
    if hasattr(similarities, 'detach') or isinstance(similarities, np.ndarray):
        if similarities.ndim != 3:
            raise ValueError(f'expected a (batch, H, H) stack of similarity matrices, got shape {tuple(similarities.shape)}')
    matrices = [_zero_diagonal(as_similarity(matrix)) for matrix in similarities]
    if not matrices:
        raise ValueError('no similarity matrices to group')
    num_heads = matrices[0].shape[0]
    if any(matrix.shape[0] != num_heads for matrix in matrices):
        raise ValueError(f'all matrices of a batch need the same size, got {sorted({m.shape[0] for m in matrices})}')
    group_size = check_equal_groups(num_heads, num_groups)
    steps = 100 * num_heads if steps is None else steps
    if restarts < 1 or steps < 1:
        raise ValueError(f'restarts and steps must be >= 1, got restarts={restarts}, steps={steps}')
    if num_groups == 1 or group_size == 1:  # a single partition exists up to relabelling
        return matrices, None, steps
    draws = [_draw(matrix, num_groups, restarts, steps, t_start, t_end, np.random.default_rng([seed, index]))
             for index, matrix in enumerate(matrices)]
    return matrices, draws, steps


def _lockstep_anneal(matrices: list[np.ndarray], draws: list[_AnnealDraws], steps: int) -> list[np.ndarray]:
    """Run every restart of every matrix as one chain, all chains in lock-step with numpy (one step = a few
    vectorised ops over the chains). A chain's swap delta is O(1) from cached group sums
    ``sums[c, g, h] = sum of S[h, k] over heads k != h in group g`` (``swap_delta`` read from the cache, minus the
    2 S[i, j] both sums count); an accepted swap updates two rows of the cache in O(H).
    Returns each matrix's best assignment over its restarts."""
    restarts = draws[0].starts.shape[0]
    num_groups, group_size = draws[0].starts.shape[1:]
    num_heads = num_groups * group_size
    chain_matrix = np.repeat(np.arange(len(matrices)), restarts)
    off_diagonal = np.stack(matrices)
    members = np.concatenate([d.starts for d in draws]).copy()  # (chains, G, g)
    chains = np.arange(members.shape[0])
    assignment = np.empty((members.shape[0], num_heads), dtype=np.int64)
    assignment[chains[:, None, None], members] = np.arange(num_groups)[None, :, None]
    one_hot = (assignment[:, None, :] == np.arange(num_groups)[None, :, None]).astype(np.float64)
    sums = one_hot @ off_diagonal[chain_matrix]  # (chains, G, H)
    score = 0.5 * np.einsum('cgh,cgh->c', one_hot, sums)
    best_score, best_assignment = score.copy(), assignment.copy()

    group_a = np.concatenate([d.group_a for d in draws])
    group_b = np.concatenate([d.group_b for d in draws])
    slot_a = np.concatenate([d.slot_a for d in draws])
    slot_b = np.concatenate([d.slot_b for d in draws])
    uniforms = np.concatenate([d.uniforms for d in draws])
    temperatures = np.concatenate([np.broadcast_to(d.temperatures, (restarts, steps)) for d in draws])
    for step in range(steps):
        ga, gb, sa, sb = group_a[:, step], group_b[:, step], slot_a[:, step], slot_b[:, step]
        i, j = members[chains, ga, sa], members[chains, gb, sb]
        delta = (sums[chains, gb, i] - sums[chains, ga, i] + sums[chains, ga, j] - sums[chains, gb, j]
                 - 2.0 * off_diagonal[chain_matrix, i, j])
        # Metropolis: always take improvements, take a loss with probability exp(delta / T).
        accept = (delta >= 0) | (uniforms[:, step] < np.exp(np.minimum(delta / temperatures[:, step], 0.0)))
        taken = chains[accept]
        if taken.size == 0:
            continue
        ga, gb, sa, sb, i, j = ga[accept], gb[accept], sa[accept], sb[accept], i[accept], j[accept]
        change = off_diagonal[chain_matrix[taken], j] - off_diagonal[chain_matrix[taken], i]
        sums[taken, ga] += change
        sums[taken, gb] -= change
        members[taken, ga, sa], members[taken, gb, sb] = j, i
        assignment[taken, i], assignment[taken, j] = gb, ga
        score[taken] += delta[accept]
        improved = taken[score[taken] > best_score[taken]]
        best_score[improved] = score[improved]
        best_assignment[improved] = assignment[improved]
    per_matrix = best_score.reshape(len(matrices), restarts)
    winners = np.arange(len(matrices)) * restarts + per_matrix.argmax(axis=1)  # first restart wins a tie
    return [best_assignment[chain] for chain in winners]


def _alg4_score(similarity: np.ndarray, members: np.ndarray) -> float:
    """Seed 000 Alg. 4's CALCULATE_SCORE as written: every ordered pair of every group, halved (diagonal is zero)."""
    score = 0.0
    for group in members:
        for a in group:
            for b in group:
                score += similarity[a][b]
    return score / 2


def _full_rescore_chain(similarity: np.ndarray, draws: _AnnealDraws, restart: int,
                        steps: int) -> tuple[float, np.ndarray]:
    """One restart as Alg. 4 anneals: copy the groups array, swap, rescore everything, compare. O(H^2) per proposal."""
    members = draws.starts[restart].copy()
    score = _alg4_score(similarity, members)
    best_score, best_members = score, members.copy()
    for step in range(steps):
        ga, gb = draws.group_a[restart, step], draws.group_b[restart, step]
        sa, sb = draws.slot_a[restart, step], draws.slot_b[restart, step]
        proposal = members.copy()
        proposal[ga][sa], proposal[gb][sb] = members[gb][sb], members[ga][sa]
        delta = _alg4_score(similarity, proposal) - score
        if delta >= 0 or draws.uniforms[restart, step] < math.exp(min(delta / draws.temperatures[step], 0.0)):
            members, score = proposal, score + delta
            if score > best_score:
                best_score, best_members = score, members.copy()
    return best_score, best_members


def anneal_equal_groups_batch(similarities: Any, num_groups: int, *, restarts: int = 8, steps: int | None = None,
                              t_start: float | None = None, t_end: float | None = None,
                              seed: int = 0) -> list[Partition]:
    """``anneal_equal_groups`` for a batch of same-size matrices (e.g. every layer's K and V), all at once.

    Matrix b draws its proposals from the random stream (seed, b): its result depends on its own entries, its index
    and the seed, never on the other matrices of the batch. Returns one partition per matrix.
    """
    matrices, draws, steps = _prepare(similarities, num_groups, restarts, steps, t_start, t_end, seed)
    if draws is None:
        return [neighbour_groups(matrices[0].shape[0], num_groups) for _ in matrices]
    return [assignment_to_partition(best) for best in _lockstep_anneal(matrices, draws, steps)]


def anneal_equal_groups(similarity: Any, num_groups: int, *, restarts: int = 8, steps: int | None = None,
                        t_start: float | None = None, t_end: float | None = None, seed: int = 0) -> Partition:
    """Equal-size grouping maximising ``within_group_score`` by simulated annealing (seed 000 Alg. 4, seed 001 Alg. 2).

    Each of ``restarts`` runs starts from a random equal split and makes ``steps`` proposals (default 100 x H); a
    proposal swaps two heads from different groups and is accepted by the Metropolis rule under a geometric schedule
    from ``t_start`` to ``t_end`` (defaults scale with the spread of S, see ``_default_temperatures``). Returns the
    best partition seen over all restarts; deterministic for a seed. Each proposal costs O(1) and each accepted swap
    O(H), against O(H^2) for a full rescore; the restarts run side by side (``anneal_equal_groups_batch``).
    """
    return anneal_equal_groups_batch([similarity], num_groups, restarts=restarts, steps=steps, t_start=t_start,
                                     t_end=t_end, seed=seed)[0]


def full_rescore_anneal_batch(similarities: Any, num_groups: int, *, restarts: int = 8, steps: int | None = None,
                              t_start: float | None = None, t_end: float | None = None,
                              seed: int = 0) -> list[Partition]:
    """Reference for ``anneal_equal_groups_batch``, for benchmarks and tests only: one chain at a time, each proposal
    copying the groups array and rescoring every pair in Python on the numpy matrix (``M[i][j]``), as seed 000 Alg. 4
    (the anchors' code) does. Same random draws and acceptance rule, so for a seed it returns the same partitions (up
    to float round-off ties)."""
    matrices, draws, steps = _prepare(similarities, num_groups, restarts, steps, t_start, t_end, seed)
    if draws is None:
        return [neighbour_groups(matrices[0].shape[0], num_groups) for _ in matrices]
    partitions = []
    for matrix, matrix_draws in zip(matrices, draws):
        chains = [_full_rescore_chain(matrix, matrix_draws, restart, steps) for restart in range(restarts)]
        best = max(range(restarts), key=lambda restart: (chains[restart][0], -restart))
        partitions.append(canonical_partition(chains[best][1].tolist()))
    return partitions


def full_rescore_anneal(similarity: Any, num_groups: int, *, restarts: int = 8, steps: int | None = None,
                        t_start: float | None = None, t_end: float | None = None, seed: int = 0) -> Partition:
    """``full_rescore_anneal_batch`` for one matrix: the reference for ``anneal_equal_groups``."""
    return full_rescore_anneal_batch([similarity], num_groups, restarts=restarts, steps=steps, t_start=t_start,
                                     t_end=t_end, seed=seed)[0]


def neighbour_groups(num_heads: int, num_groups: int) -> Partition:
    """Contiguous equal groups [0..g-1], [g..2g-1], ...: the neighbour-grouping baseline (seed 004 section 2.1)."""
    group_size = check_equal_groups(num_heads, num_groups)
    return [list(range(start, start + group_size)) for start in range(0, num_heads, group_size)]
