"""DHA head fusion maths (seed 000 section 4, appendix B.2-B.3). Pure tensors, no modules, no Composer.

Shapes, per layer and per kind (K or V), with H query heads, head dim d and input width D:

- ``source``: the MHA projection weight (H * d, D), head j in rows [j d, (j + 1) d).
- ``members``: (H, g) long; row h lists the g source heads of query head h's group (every head of a group has
  the same row). Groups of one layer and kind have equal size g.
- ``omega``: (H, g, d) fusion weights: query head h reads W^(h) = sum_j omega[h, j] (.) W^{members[h, j]}, the
  product scaling each output dimension (Eq. 5). Mixing is done on the weights, so the projection then costs what
  an MHA projection costs; appendix Alg. 2's mixing of g-fold expanded activations is not reproduced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dha_train.ops.grouping import Partition, anneal_equal_groups


def group_members(partition: Sequence[Sequence[int]], num_heads: int) -> torch.Tensor:
    """(H, g) source heads per query head from an equal-size partition of the heads (each group in sorted order)."""
    sizes = {len(group) for group in partition}
    if len(sizes) != 1:
        raise ValueError(f'fusion needs equal-size groups within a layer, got sizes {sorted(sizes)}')
    covered = sorted(h for group in partition for h in group)
    if covered != list(range(num_heads)):
        raise ValueError(f'partition {partition} must cover heads 0..{num_heads - 1} exactly once')
    members = torch.empty(num_heads, sizes.pop(), dtype=torch.long, device='cpu')
    for group in partition:
        members[list(group)] = torch.tensor(sorted(group), device='cpu')
    return members


def kronecker_omega(members: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """omega[h, j, :] = 1 where members[h, j] == h, else 0: every query head reads its own MHA head (Eq. 5 at init)."""
    own = (members == torch.arange(members.shape[0], device=members.device)[:, None]).to(dtype)
    if not bool((own.sum(dim=1) == 1).all()):
        raise ValueError('every query head must be a member of its own group')
    return own[:, :, None].expand(-1, -1, head_dim).clone()


def fuse_weight(source: torch.Tensor, omega: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """(H * d, ...) fused projection rows: head h is sum_j omega[h, j] (.) source head members[h, j] (Eq. 5)."""
    num_heads, _, head_dim = omega.shape
    heads = source.reshape(source.shape[0] // head_dim, head_dim, -1)[members]  # (H, g, d, D)
    fused = (omega.unsqueeze(-1).to(heads.dtype) * heads).sum(dim=1)  # (H, d, D)
    return fused.reshape(num_heads * head_dim, *source.shape[1:])


def pair_index(members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All pairs (h, h') with h < h' in the same group."""
    same = (members[:, None, :] == members[None, :, :]).all(dim=-1)
    return torch.nonzero(torch.triu(same, diagonal=1), as_tuple=True)


def pair_square_sum(omega: torch.Tensor, members: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum over within-group pairs h < h' of ||omega_h - omega_h'||^2, and how many squared differences it holds."""
    first, second = pair_index(members.to(omega.device))
    return (omega[first] - omega[second]).square().sum(), int(first.numel()) * omega.shape[1] * omega.shape[2]


def fusion_loss(omegas: Sequence[torch.Tensor], members: Sequence[torch.Tensor]) -> torch.Tensor:
    """One layer's fusion loss (Eq. 7 normalised as Alg. 3): the mean over every within-group pair (h, h') of every
    kind given (K and V) and over the g x d weights of the squared difference of omega_h and omega_h'.

    Alg. 3's normaliser H x G_s x D x 2 x (G_s - 1) / 2 is exactly that element count for K and V. Zero when every
    group agrees; 2 / g at the Kronecker init. The model's total is the mean over layers (``Alg. 3: L / len(B)``).
    """
    terms = [pair_square_sum(omega, member) for omega, member in zip(omegas, members)]
    count = sum(elements for _, elements in terms)
    if count == 0:  # groups of one head: nothing to fuse
        return omegas[0].new_zeros(())
    return sum(squares for squares, _ in terms) / count


def with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A projection's rows with its bias as one more input column, ``[W | b]`` acting on ``[x; 1]``: Eq. 6's head
    distance on it compares what two heads compute, bias included (Qwen2's k/v biases). ``weight`` when no bias."""
    return weight if bias is None else torch.cat([weight, bias.to(weight.dtype)[:, None]], dim=1)


def head_distances(source: torch.Tensor, omega: torch.Tensor, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, H) head distances for the Search stage, one kind of one layer.

    Weight space (Eq. 6): L(h, h') = 1/g || W^(h) - W^(h') ||^2 with W^(h) the fused rows of head h. Heads in
    different groups get +inf (they cannot share). Omega only (Eq. 7's per-pair term): 1/g sum_j ||omega_hj -
    omega_h'j||^2, over the same pairs. Both are zero on the diagonal.
    """
    num_heads, group, head_dim = omega.shape
    fused = fuse_weight(source, omega, members).reshape(num_heads, -1).double()
    norms = fused.square().sum(dim=1)
    weight_space = (norms[:, None] + norms[None, :] - 2.0 * fused @ fused.T).clamp_min(0.0) / group
    flat = omega.reshape(num_heads, -1).double()
    omega_norms = flat.square().sum(dim=1)
    omega_only = (omega_norms[:, None] + omega_norms[None, :] - 2.0 * flat @ flat.T).clamp_min(0.0) / group
    same = (members[:, None, :] == members[None, :, :]).all(dim=-1)
    infinity = torch.full_like(weight_space, float('inf'))
    weight_space = torch.where(same, weight_space, infinity).fill_diagonal_(0.0)
    omega_only = torch.where(same, omega_only, infinity).fill_diagonal_(0.0)
    return weight_space, omega_only


def progressive_sizes(group_size: int, stage_sizes: Sequence[int]) -> list[int]:
    """Sub-group size of each progressive-fusion stage (seed 000 B.2: fuse 2x, then 4x, ...) for groups of
    ``group_size`` heads: for each requested size, the largest divisor of ``group_size`` not above it that is a
    multiple of the previous stage's size (so each stage's sub-groups are unions of the last one's); the final
    stage is always the whole group. E.g. g = 8, [2, 4] -> [2, 4, 8]; g = 4, [2, 4] -> [2, 4, 4]; g = 6, [4] -> [3, 6].
    """
    sizes, previous = [], 1
    for requested in stage_sizes:
        size = max(d for d in range(previous, min(requested, group_size) + 1, previous) if group_size % d == 0)
        sizes.append(size)
        previous = size
    return sizes + [group_size]


def split_into_subgroups(distance: torch.Tensor, partition: Sequence[Sequence[int]], size: int,
                         previous: Sequence[Sequence[int]] | None = None, seed: int = 0) -> Partition:
    """Split every group of ``partition`` into sub-groups of ``size`` heads that are unions of ``previous``'s
    sub-groups (single heads when None), minimising the mean within-sub-group head distance (the clustering at the
    start of each progressive-fusion stage, seed 000 B.2). ``distance`` is (H, H), e.g. Eq. 6's weight-space head
    distance; blocks are compared by their mean pairwise distance and grouped by the annealing search."""
    distance = (distance.double() if torch.is_tensor(distance)
                else torch.tensor(distance, dtype=torch.float64, device='cpu'))
    blocks_of = [[list(block) for block in (previous or [[h] for group in partition for h in group])
                  if set(block) <= set(group)] for group in partition]
    subgroups: Partition = []
    for group, blocks in zip(partition, blocks_of):
        block_size = len(blocks[0])
        if len(group) % size or size % block_size or sum(len(block) for block in blocks) != len(group):
            raise ValueError(f'cannot split group {list(group)} into sub-groups of {size} made of blocks {blocks}')
        if size == block_size or size == len(group):
            subgroups += blocks if size == block_size else [sorted(group)]
            continue
        block_distance = torch.tensor([[float(distance[a][:, b].mean()) for b in blocks] for a in blocks],
                                      device='cpu')
        for chosen in anneal_equal_groups(-block_distance, len(group) // size, seed=seed):
            subgroups.append(sorted(h for index in chosen for h in blocks[index]))
    return sorted(subgroups, key=lambda subgroup: subgroup[0])


def fusion_margin(step: int, warmup_steps: int, base: float = 0.999) -> float:
    """t(s) = max(0, b^s (1 - s / k)) (Eq. 8): the slack the constraint allows, shrinking to 0 at step k."""
    if warmup_steps <= 0:
        return 0.0
    return max(0.0, base ** step * (1.0 - step / warmup_steps))


def lagrangian_penalty(loss: torch.Tensor, margin: float, lam: float, rho: float = 0.0) -> torch.Tensor:
    """lambda max(L - t, 0) + rho / 2 max(L - t, 0)^2 (Eq. 8 with the optional quadratic term)."""
    violation = (loss - margin).clamp_min(0.0)
    return lam * violation + 0.5 * rho * violation.square()


def dual_ascent(lam: float, loss: float, margin: float, lr: float) -> float:
    """lambda <- max(0, lambda + eta (L - t)): grows while the constraint is violated, shrinks (to 0) once it holds."""
    return max(0.0, lam + lr * (loss - margin))


def bake(source: torch.Tensor, omega: torch.Tensor, members: torch.Tensor,
         partition: Sequence[Sequence[int]]) -> torch.Tensor:
    """Compact DHA projection (groups * d, ...) after fusion: each group's omega is averaged over its query heads
    and the group's one head is sum_j mean_omega[j] (.) W^{members[j]} (seed 000 B.2 post-processing). Group n of
    ``partition`` becomes compact head n, as ``HeadMap``'s key/value maps number them."""
    num_heads, _, head_dim = omega.shape
    heads = source.reshape(source.shape[0] // head_dim, head_dim, -1)
    compact = []
    for group in partition:
        group = sorted(group)
        mean_omega = omega[group].mean(dim=0)  # (g, d)
        sources = heads[members[group[0]]]  # (g, d, D)
        compact.append((mean_omega.unsqueeze(-1).to(sources.dtype) * sources).sum(dim=0))
    return torch.cat(compact).reshape(len(partition) * head_dim, *source.shape[1:])


def groups_of(members: torch.Tensor) -> list[list[int]]:
    """The partition a members table encodes, groups ordered by their first head."""
    return [list(group) for group in sorted({tuple(row) for row in members.tolist()}, key=lambda group: group[0])]


def bake_llama_state_dict(state_dict: dict[str, torch.Tensor], head_dim: int):
    """A fusion model's state dict (``FusedProjection`` k_proj / v_proj with ``omega`` and ``members``) -> the
    state dict of the DHA model with one compact head per group, and the per-layer K and V partitions (compact
    head n is group n, groups ordered by their first head as ``HeadMap`` numbers them). Omega is averaged within
    each group (``bake``); when the groups agree the baked model computes what the fusion model computes."""
    baked = dict(state_dict)
    key_partitions: list[list[list[int]]] = []
    value_partitions: list[list[list[int]]] = []
    layer = 0
    while f'model.layers.{layer}.self_attn.k_proj.omega' in state_dict:
        for projection, partitions in (('k_proj', key_partitions), ('v_proj', value_partitions)):
            prefix = f'model.layers.{layer}.self_attn.{projection}.'
            omega, members = baked.pop(prefix + 'omega'), baked.pop(prefix + 'members')
            partition = groups_of(members)
            for param in ('weight', 'bias'):
                if prefix + param in state_dict:
                    baked[prefix + param] = bake(state_dict[prefix + param], omega, members, partition)
            partitions.append(partition)
        layer += 1
    if layer == 0:
        raise ValueError('no fusion weights (model.layers.<i>.self_attn.k_proj.omega) in the state dict')
    return baked, key_partitions, value_partitions
