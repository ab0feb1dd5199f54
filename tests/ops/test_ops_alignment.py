"""Procrustes alignment (seed 001 sections 3.2-3.4): closed forms, RoPE-compatible key rotations, generalised
Procrustes, and folding into the weights without changing the model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from dha_train.ops.alignment import (
    align_llama_state_dict,
    aligned_similarity,
    best_map,
    cross_blocks,
    explicit_aligned_similarity,
    generalized_procrustes,
    group_maps,
    plane_rotation,
    within_group_cosine,
)


def gram_of(caches: torch.Tensor, normalise: bool) -> torch.Tensor:
    """Layer Gram (H d, H d) of caches (H, N, d), rows normalised per head for the cos criterion."""
    caches = caches.double()
    if normalise:
        caches = caches / caches.norm(dim=-1, keepdim=True)
    stacked = caches.transpose(0, 1).reshape(caches.shape[1], -1)  # (N, H d)
    return stacked.T @ stacked


def planted_caches(num_heads=6, tokens=300, head_dim=8, noise=0.3, seed=0) -> torch.Tensor:
    """Heads that are randomly rotated (per RoPE plane for keys: a special case of orthogonal) noisy copies of a
    few base caches, with different scales."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(2, tokens, head_dim, generator=generator, dtype=torch.float64)
    heads = []
    for h in range(num_heads):
        rotation = plane_rotation(torch.rand(head_dim // 2, generator=generator, dtype=torch.float64) * 6.0)
        scale = 0.5 + torch.rand((), generator=generator, dtype=torch.float64)
        noisy = base[h % 2] + noise * torch.randn(tokens, head_dim, generator=generator, dtype=torch.float64)
        heads.append(scale * noisy @ rotation)
    return torch.stack(heads)


@pytest.mark.parametrize('kind', ['key', 'value'])
@pytest.mark.parametrize('criterion', ['cos', 'dist'])
def test_closed_form_similarity_equals_align_then_measure(kind, criterion):
    caches = planted_caches()
    closed = aligned_similarity(gram_of(caches, criterion == 'cos'), 6, kind, criterion, tokens=300)
    explicit = explicit_aligned_similarity(caches, kind, criterion)
    torch.testing.assert_close(closed, explicit, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(closed, closed.T)
    if criterion == 'cos':  # planted: heads 0, 2, 4 share a base, as do 1, 3, 5
        same, other = closed[0, 2], closed[0, 1]
        assert same > 0.9 > 0.3 > other


def test_key_maps_are_proper_rope_plane_rotations_that_commute_with_rope():
    cross = torch.randn(16, 16, dtype=torch.float64)
    rotation = best_map(cross, 'key')
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(16, dtype=torch.float64))
    assert torch.linalg.det(rotation) == pytest.approx(1.0)
    a, b = torch.arange(8), torch.arange(8) + 8
    planes = torch.stack([rotation[[i, j]][:, [i, j]].det() for i, j in zip(a.tolist(), b.tolist())])
    torch.testing.assert_close(planes, torch.ones(8, dtype=torch.float64))  # each 2x2 block is a proper rotation
    off_plane = rotation.clone()
    off_plane[a, a] = off_plane[b, b] = off_plane[a, b] = off_plane[b, a] = 0.0
    assert float(off_plane.abs().max()) == 0.0
    # RoPE(x R) = RoPE(x) R at every position (HF rotate_half convention).
    x = torch.randn(1, 1, 5, 16, dtype=torch.float64)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * (1.0 / 10000 ** (torch.arange(8) / 8.0))[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None]
    rotated_then_rope, _ = apply_rotary_pos_emb(x @ rotation, x @ rotation, cos, sin)
    rope_then_rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(rotated_then_rope, rope_then_rotated @ rotation)
    # And it is the best such rotation: no random plane rotation agrees more.
    best = torch.trace(rotation.T @ cross)
    for seed in range(20):
        other = plane_rotation(torch.rand(8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 7)
        assert torch.trace(other.T @ cross) <= best + 1e-12


@pytest.mark.parametrize('kind', ['key', 'value'])
def test_generalized_procrustes_raises_the_within_group_cosine(kind):
    caches = planted_caches(noise=0.2)
    gram = gram_of(caches, normalise=True)
    partition = [[0, 2, 4], [1, 3, 5]]
    maps = group_maps(gram, partition, kind)
    before = within_group_cosine(gram, partition, 300)
    after = within_group_cosine(gram, partition, 300, maps)
    assert before < 0.5 and after > 0.9
    torch.testing.assert_close(maps @ maps.transpose(1, 2), torch.eye(8, dtype=torch.float64).expand(6, 8, 8))
    torch.testing.assert_close(maps[0], torch.eye(8, dtype=torch.float64))  # the group's frame is its first head
    # Never worse than pairwise alignment onto the first head alone.
    cross = cross_blocks(gram, 6)[[0, 2, 4]][:, [0, 2, 4]]
    pairwise = torch.stack([torch.eye(8, dtype=torch.float64)] + [best_map(cross[k, 0], kind) for k in (1, 2)])
    gpa = generalized_procrustes(cross, kind)

    def agreement(m):
        return float(torch.einsum('iab,ikac,kcb->', m, cross, m))

    assert agreement(gpa) >= agreement(pairwise) - 1e-9


def tiny_llama(trained: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    if trained:  # a few optimiser steps on a repeating sequence, so the weights are not i.i.d. any more
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.arange(32).remainder(7)[None].repeat(4, 1)
        for _ in range(15):
            loss = model(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


@pytest.mark.parametrize('trained', [False, True])
def test_folding_key_and_value_maps_leaves_the_model_unchanged(trained):
    model = tiny_llama(trained)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
    generator = torch.Generator().manual_seed(2)
    key_maps = [plane_rotation(torch.rand(4, 8, generator=generator, dtype=torch.float64) * 6) for _ in range(2)]
    value_maps = [torch.linalg.qr(torch.randn(4, 16, 16, generator=generator, dtype=torch.float64))[0]
                  for _ in range(2)]
    aligned = align_llama_state_dict(model.state_dict(), key_maps, value_maps)
    assert not torch.allclose(aligned['model.layers.0.self_attn.k_proj.weight'],
                              model.state_dict()['model.layers.0.self_attn.k_proj.weight'])
    model.load_state_dict(aligned)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=1e-4)
