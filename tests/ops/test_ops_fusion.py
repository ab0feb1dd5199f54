"""DHA fusion maths: weight-space mixing (Eq. 5), fusion loss (Eq. 7 / Alg. 3), head distances (Eq. 6), margin and
dual ascent (Eq. 8), baking."""

from __future__ import annotations

import math

import pytest
import torch

from dha_train.ops.fusion import (
    bake,
    dual_ascent,
    fuse_weight,
    fusion_loss,
    fusion_margin,
    group_members,
    head_distances,
    kronecker_omega,
    lagrangian_penalty,
    progressive_sizes,
    split_into_subgroups,
)
from dha_train.ops.heads import gather_heads

HEADS, HEAD_DIM, WIDTH = 6, 4, 5
PARTITION = [[0, 3, 4], [1, 2, 5]]


def setup(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(HEADS * HEAD_DIM, WIDTH, generator=generator, dtype=torch.float64)
    members = group_members(PARTITION, HEADS)
    omega = torch.randn(HEADS, 3, HEAD_DIM, generator=generator, dtype=torch.float64)
    return source, members, omega


def test_kronecker_init_reproduces_the_mha_projection_exactly():
    source, members, _ = setup()
    omega = kronecker_omega(members, HEAD_DIM, dtype=torch.float64)
    assert torch.equal(fuse_weight(source, omega, members), source)
    assert members.tolist()[3] == [0, 3, 4] and members.tolist()[5] == [1, 2, 5]


def test_fuse_weight_is_equation_5_per_output_dimension():
    source, members, omega = setup()
    fused = fuse_weight(source, omega, members)
    heads = source.reshape(HEADS, HEAD_DIM, WIDTH)
    for h in range(HEADS):
        expected = sum(omega[h, j][:, None] * heads[members[h, j]] for j in range(3))
        assert torch.allclose(fused[h * HEAD_DIM:(h + 1) * HEAD_DIM], expected, atol=1e-12)


def test_fusion_loss_equals_the_hand_computed_mean_and_is_two_over_g_at_init():
    source, members, omega = setup()
    squares, count = 0.0, 0
    for group in PARTITION:
        for a in range(3):
            for b in range(a + 1, 3):
                squares += float((omega[group[a]] - omega[group[b]]).square().sum())
                count += 3 * HEAD_DIM
    assert float(fusion_loss([omega], [members])) == pytest.approx(squares / count, rel=1e-12)
    # K and V together: one mean over both kinds' pairs.
    other = omega.flip(0)
    both = float(fusion_loss([omega, other], [members, members]))
    assert both == pytest.approx(0.5 * (squares / count + float(fusion_loss([other], [members]))), rel=1e-12)
    init = kronecker_omega(members, HEAD_DIM, dtype=torch.float64)
    assert float(fusion_loss([init], [members])) == pytest.approx(2 / 3)
    agreed = omega.clone()
    for group in PARTITION:
        agreed[group] = omega[group].mean(dim=0)
    assert float(fusion_loss([agreed], [members])) == pytest.approx(0.0, abs=1e-15)


def test_fusion_loss_gradient_only_pulls_omega_towards_its_group_mean():
    source, members, omega = setup()
    omega.requires_grad_(True)
    source.requires_grad_(True)
    loss = fusion_loss([omega], [members])
    loss.backward()
    assert source.grad is None  # the loss reads omega only
    for group in PARTITION:
        deviation = omega.detach()[group] - omega.detach()[group].mean(dim=0)
        grad = omega.grad[group]
        assert torch.allclose(grad.sum(dim=0), torch.zeros_like(grad[0]), atol=1e-12)  # group mean stays put
        scale = float((grad * deviation).sum() / deviation.square().sum())
        assert scale > 0 and torch.allclose(grad, scale * deviation, atol=1e-12)


def test_head_distances_match_equations_6_and_7():
    source, members, omega = setup()
    weight_space, omega_only = head_distances(source, omega, members)
    fused = fuse_weight(source, omega, members).reshape(HEADS, HEAD_DIM, WIDTH)
    assert float(weight_space[0, 3]) == pytest.approx(float((fused[0] - fused[3]).square().sum()) / 3, rel=1e-9)
    assert float(omega_only[1, 5]) == pytest.approx(float((omega[1] - omega[5]).square().sum()) / 3, rel=1e-9)
    assert math.isinf(float(weight_space[0, 1])) and math.isinf(float(omega_only[2, 4]))
    assert float(weight_space[2, 2]) == 0.0 and torch.equal(weight_space, weight_space.T)


def test_margin_penalty_and_dual_ascent_closed_forms():
    assert fusion_margin(0, 100) == 1.0
    assert fusion_margin(50, 100) == pytest.approx(0.999 ** 50 * 0.5)
    assert fusion_margin(100, 100) == 0.0 and fusion_margin(150, 100) == 0.0
    loss = torch.tensor(0.3)
    assert float(lagrangian_penalty(loss, 0.1, lam=2.0)) == pytest.approx(0.4)
    assert float(lagrangian_penalty(loss, 0.1, lam=2.0, rho=4.0)) == pytest.approx(0.4 + 0.5 * 4.0 * 0.04)
    assert float(lagrangian_penalty(loss, 0.5, lam=2.0)) == 0.0
    assert dual_ascent(1.0, 0.3, 0.1, lr=0.5) == pytest.approx(1.1)
    assert dual_ascent(0.01, 0.0, 0.1, lr=0.5) == 0.0


def test_baked_compact_heads_equal_the_fused_model_when_groups_agree():
    source, members, omega = setup()
    for group in PARTITION:
        omega[group] = omega[group].mean(dim=0)
    compact = bake(source, omega, members, PARTITION)
    assert compact.shape == (2 * HEAD_DIM, WIDTH)
    head_to_group = [0 if h in PARTITION[0] else 1 for h in range(HEADS)]
    expanded = gather_heads(compact, head_to_group, HEAD_DIM)
    assert torch.allclose(expanded, fuse_weight(source, omega, members), atol=1e-12)
    with pytest.raises(ValueError, match='equal-size'):
        group_members([[0, 1], [2, 3, 4, 5]], HEADS)


@pytest.mark.parametrize('group_size, stages, expected', [
    (8, [2, 4], [2, 4, 8]), (4, [2, 4], [2, 4, 4]), (2, [2], [2, 2]), (6, [4], [3, 6]), (3, [2], [1, 3]),
    (6, [2, 4], [2, 2, 6]), (12, [2, 4], [2, 4, 12])])
def test_progressive_sizes_divide_the_group_and_nest(group_size, stages, expected):
    assert progressive_sizes(group_size, stages) == expected


def test_split_into_subgroups_pairs_the_closest_heads_then_joins_the_closest_pairs():
    # Two groups of 8 heads; in the first, heads 0-5, 1-4, 2-7, 3-6 are nearly identical (distance 0.1), pair
    # (0, 5) is close to pair (2, 7) (distance 1) and (1, 4) to (3, 6); everything else is 5.
    distance = torch.full((16, 16), 5.0)
    for a, b, d in [(0, 5, 0.1), (1, 4, 0.1), (2, 7, 0.1), (3, 6, 0.1)]:
        distance[a, b] = distance[b, a] = d
    for first, second in [((0, 5), (2, 7)), ((1, 4), (3, 6))]:
        for a in first:
            for b in second:
                distance[a, b] = distance[b, a] = 1.0
    distance.fill_diagonal_(0.0)
    groups = [list(range(8)), list(range(8, 16))]
    pairs = split_into_subgroups(distance, groups, 2)
    assert pairs[:4] == [[0, 5], [1, 4], [2, 7], [3, 6]] and sorted(h for p in pairs[4:] for h in p) == groups[1]
    quads = split_into_subgroups(distance, groups, 4, previous=pairs)
    assert [[0, 2, 5, 7], [1, 3, 4, 6]] == [q for q in quads if q[0] < 8]
    assert all(any(set(pair) <= set(quad) for quad in quads) for pair in pairs)  # quads are unions of the pairs
    assert split_into_subgroups(distance, groups, 8, previous=quads) == groups
    with pytest.raises(ValueError, match='cannot split'):
        split_into_subgroups(distance, groups, 3)
