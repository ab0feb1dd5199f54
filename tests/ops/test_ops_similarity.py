"""Head similarity maths: blocked Gram, running moments, CKA (DHA B.1), redundancy, AsymGQA Eq. 1."""

from __future__ import annotations

import pytest
import torch

from dha_train.ops.similarity import (
    RunningGram,
    best_match_cosine,
    cka_from_gram,
    layer_redundancy,
    symmetric_gram,
    weight_cka,
)


def direct_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """||X^T Y||_F^2 / (||X^T X||_F ||Y^T Y||_F), written out."""
    return float((x.T @ y).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm()))


@pytest.mark.parametrize('features', [3, 13, 64])
def test_symmetric_gram_equals_full_product(features):
    x = torch.randn(50, features, dtype=torch.float64)
    assert torch.allclose(symmetric_gram(x), x.T @ x, atol=1e-12)


def test_running_gram_over_chunks_equals_the_centred_gram_of_all_rows():
    x = torch.randn(301, 12, dtype=torch.float64) + 3.0
    running = RunningGram(12)
    for chunk in x.split(64):
        running.update(chunk)
    centred = x - x.mean(dim=0)
    assert running.count == 301
    assert torch.allclose(running.centered(), centred.T @ centred, atol=1e-9)
    restored = RunningGram.from_state_dict(running.state_dict())
    assert torch.equal(restored.centered(), running.centered())
    with pytest.raises(ValueError, match='12 features'):
        running.update(torch.randn(4, 11))


def test_cka_from_gram_matches_the_formula_and_is_invariant_to_rotation_and_scale():
    torch.manual_seed(0)
    heads, head_dim = 4, 6
    x = torch.randn(200, heads, head_dim, dtype=torch.float64)
    rotation, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, dtype=torch.float64))
    x[:, 3] = 2.5 * x[:, 1] @ rotation  # head 3 is a scaled rotation of head 1
    stacked = x.reshape(200, heads * head_dim)
    cka = cka_from_gram(stacked.T @ stacked, heads)
    for i in range(heads):
        for j in range(heads):
            assert cka[i, j] == pytest.approx(direct_cka(x[:, i], x[:, j]), abs=1e-12)
    assert cka[1, 3] == pytest.approx(1.0, abs=1e-12)
    assert cka[0, 2] < 0.2  # independent heads
    assert torch.allclose(cka, cka.T)


def test_weight_cka_follows_appendix_b1_with_heads_as_hidden_by_head_dim_matrices():
    torch.manual_seed(1)
    heads, head_dim, hidden = 3, 4, 10
    weight = torch.randn(heads * head_dim, hidden, dtype=torch.float64)
    per_head = [weight[h * head_dim:(h + 1) * head_dim].T for h in range(heads)]  # W_i: hidden x head_dim
    cka = weight_cka(weight, heads)
    for i in range(heads):
        for j in range(heads):
            assert cka[i, j] == pytest.approx(direct_cka(per_head[i], per_head[j]), abs=1e-12)


def test_layer_redundancy_is_the_mean_over_distinct_pairs():
    similarity = torch.tensor([[1.0, 0.2, 0.4], [0.2, 1.0, 0.9], [0.4, 0.9, 1.0]])
    assert layer_redundancy(similarity) == pytest.approx((0.2 + 0.4 + 0.9) / 3)
    with pytest.raises(ValueError, match='at least 2 heads'):
        layer_redundancy(torch.ones(1, 1))


def test_best_match_cosine_equals_equation_1_and_does_not_depend_on_blocking():
    torch.manual_seed(2)
    acts = torch.randn(5, 7, 3, dtype=torch.float64)
    acts[4] = acts[0][torch.randperm(7)] * 3.0  # same rows, shuffled and scaled: similarity 1
    unit = torch.nn.functional.normalize(acts, dim=-1)
    expected = torch.empty(5, 5, dtype=torch.float64)
    for a in range(5):
        for b in range(5):
            cos = unit[a] @ unit[b].T
            expected[a, b] = 0.5 * (cos.amax(dim=1).sum() + cos.amax(dim=0).sum()) / 7
    result = best_match_cosine(acts)
    assert torch.allclose(result, expected, atol=1e-6)
    assert result[0, 4] == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(best_match_cosine(acts, max_block_elements=49), result, atol=1e-12)
