"""ops.mla: partial-RoPE pair scores and choices, the (activation-aware, balanced) joint latent factorisation and
the per-layer rank allocation, against closed forms and brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from dha_train.ops.mla import (
    allocate_latent_ranks,
    balance_scales,
    cache_values_per_token,
    fold_windows,
    folded_pair_bases,
    head_rows,
    kept_rope_pairs,
    latent_factors,
    latent_spectrum,
    left_out_energy,
    mix_head_pairs,
    nope_dims,
    pair_key_cross_energy,
    pair_norms,
    recovered_pair_bases,
    rope_dims,
    rope_pair_scores,
)

HEAD_DIM = 8


def _rotate(states: torch.Tensor, positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """LLaMA's RoPE (rotate_half) on (tokens, heads * head_dim)."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    angles = positions.double().unsqueeze(1) * inv_freq  # (tokens, half)
    cos, sin = torch.cat([angles, angles], 1).cos(), torch.cat([angles, angles], 1).sin()
    heads = states.reshape(states.shape[0], -1, head_dim)
    rotated_half = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    return (heads * cos.unsqueeze(1) + rotated_half * sin.unsqueeze(1)).reshape(states.shape)


def test_pair_norms_are_the_closed_form_and_unchanged_by_rope():
    one = torch.zeros(1, HEAD_DIM, dtype=torch.float64)
    one[0, 1], one[0, 1 + HEAD_DIM // 2] = 3.0, 4.0  # pair 1 is (3, 4)
    assert pair_norms(one, HEAD_DIM).tolist() == [[0.0, 5.0, 0.0, 0.0]]
    states = torch.randn(50, 3 * HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rotated = _rotate(states, torch.arange(50) * 7 + 3, HEAD_DIM)
    assert not torch.allclose(rotated, states)
    torch.testing.assert_close(pair_norms(rotated, HEAD_DIM), pair_norms(states, HEAD_DIM), rtol=0, atol=1e-12)


def test_pair_scores_sum_the_query_heads_of_each_kv_head():
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(20, 4 * HEAD_DIM, generator=generator)
    keys = torch.randn(20, 2 * HEAD_DIM, generator=generator)
    query_to_kv = [0, 0, 1, 1]
    scores = rope_pair_scores(queries, keys, HEAD_DIM, query_to_kv)
    half = HEAD_DIM // 2
    for kv, pair in itertools.product(range(2), range(half)):
        key_norm = sum(float(torch.hypot(keys[t, kv * HEAD_DIM + pair], keys[t, kv * HEAD_DIM + pair + half]))
                       for t in range(20)) / 20
        query_norm = sum(float(torch.hypot(queries[t, h * HEAD_DIM + pair], queries[t, h * HEAD_DIM + pair + half]))
                         for h in range(4) if query_to_kv[h] == kv for t in range(20)) / 20
        assert float(scores[kv, pair]) == pytest.approx(query_norm * key_norm, rel=1e-6)
    with pytest.raises(ValueError, match='query heads'):
        rope_pair_scores(queries, keys, HEAD_DIM, [0, 1])


def test_kept_pairs_by_norm_uniform_and_high_frequency():
    scores = torch.tensor([[0.1, 5.0, 0.2, 3.0], [9.0, 0.0, 1.0, 1.0]])
    assert kept_rope_pairs(2, HEAD_DIM, 2, 'norm', scores).tolist() == [[1, 3], [0, 2]]  # tie: lower pair
    assert kept_rope_pairs(2, HEAD_DIM, 2, 'uniform').tolist() == [[0, 2], [0, 2]]
    assert kept_rope_pairs(1, 16, 3, 'uniform').tolist() == [[0, 2, 5]]
    assert kept_rope_pairs(1, HEAD_DIM, 3, 'high_frequency').tolist() == [[0, 1, 2]]
    assert kept_rope_pairs(1, HEAD_DIM, 0, 'uniform').shape == (1, 0)
    with pytest.raises(ValueError, match='within 0..4'):
        kept_rope_pairs(1, HEAD_DIM, 5, 'uniform')
    with pytest.raises(ValueError, match='needs scores'):
        kept_rope_pairs(2, HEAD_DIM, 2, 'norm')
    with pytest.raises(ValueError, match='criterion'):
        kept_rope_pairs(2, HEAD_DIM, 2, 'largest')


def test_kept_pairs_with_a_fold_are_chosen_among_the_window_centres():
    scores = torch.tensor([[0.1, 5.0, 0.2, 3.0], [9.0, 0.0, 1.0, 1.0]])
    centres = torch.tensor([[0, 3], [1, 2]])  # one candidate per window of two pairs
    assert kept_rope_pairs(2, HEAD_DIM, 1, 'norm', scores, centres).tolist() == [[3], [2]]
    assert kept_rope_pairs(2, HEAD_DIM, 1, 'uniform', centres=centres).tolist() == [[0], [1]]
    assert kept_rope_pairs(2, HEAD_DIM, 2, 'high_frequency', centres=centres).tolist() == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match='2 candidate pairs'):
        kept_rope_pairs(2, HEAD_DIM, 3, 'uniform', centres=centres)


@pytest.mark.parametrize('fold', [1, 3])
def test_fold_bases_are_orthogonal_per_window_keep_the_top_energy_and_every_position_free_score(fold):
    """FreqFold per K/V head: an orthogonal re-basis inside each window (pairs 0-2 and 3 at a fold of 3), the same
    for a K/V head and its query heads, so q . k is unchanged; the component at each window's centre holds the
    window's top key energy, at least any one pair's own."""
    generator = torch.Generator().manual_seed(4)
    kv_heads, hidden, half = 2, 12, HEAD_DIM // 2
    k_weight = torch.randn(kv_heads * HEAD_DIM, hidden, dtype=torch.float64, generator=generator)
    q_weight = torch.randn(4 * HEAD_DIM, hidden, dtype=torch.float64, generator=generator)
    inputs = torch.randn(64, hidden, dtype=torch.float64, generator=generator)
    covariance = inputs.T @ inputs / 64
    bases, centres, kept = folded_pair_bases(pair_key_cross_energy(k_weight, covariance, kv_heads, HEAD_DIM), fold)
    windows = fold_windows(half, fold)
    assert windows == ([[0], [1], [2], [3]] if fold == 1 else [[0, 1, 2], [3]])
    for head in range(kv_heads):
        torch.testing.assert_close(bases[head].T @ bases[head], torch.eye(half, dtype=torch.float64))
        inside = torch.zeros(half, half, dtype=torch.bool)
        for window in windows:
            inside[window[0]:window[-1] + 1, window[0]:window[-1] + 1] = True
        assert not bases[head][~inside].any()
    if fold == 1:
        torch.testing.assert_close(bases, torch.eye(half, dtype=torch.float64).expand(kv_heads, half, half))
        assert centres.tolist() == [[0, 1, 2, 3]] * kv_heads
    query_to_kv = [0, 0, 1, 1]
    keys, queries = inputs @ k_weight.T, inputs @ q_weight.T
    mixed_keys = mix_head_pairs(keys, bases, HEAD_DIM)
    mixed_queries = mix_head_pairs(queries, bases, HEAD_DIM, query_to_kv)
    for head, kv in enumerate(query_to_kv):
        q, k = (slice(head * HEAD_DIM, (head + 1) * HEAD_DIM), slice(kv * HEAD_DIM, (kv + 1) * HEAD_DIM))
        torch.testing.assert_close(mixed_queries[:, q] @ mixed_keys[:, k].T, queries[:, q] @ keys[:, k].T)
    pair_energy = lambda states, head, pair: float(  # noqa: E731
        (states[:, head * HEAD_DIM + pair] ** 2 + states[:, head * HEAD_DIM + pair + half] ** 2).mean())
    torch.testing.assert_close(inputs @ mix_head_pairs(k_weight.T, bases, HEAD_DIM), mixed_keys)  # weights as states
    # what the refit reads off a converted folder's queries: these bases, or a large mismatch for another source
    converted_queries = mix_head_pairs(q_weight.T, bases, HEAD_DIM, query_to_kv).T
    recovered, mismatch = recovered_pair_bases(q_weight, converted_queries, HEAD_DIM, kv_heads)
    torch.testing.assert_close(recovered, bases)
    assert mismatch < 1e-10
    assert recovered_pair_bases(torch.randn(q_weight.shape, dtype=torch.float64, generator=generator),
                                converted_queries, HEAD_DIM, kv_heads)[1] > 0.5
    for head, (window_index, window) in itertools.product(range(kv_heads), enumerate(windows)):
        centre = int(centres[head, window_index])
        assert centre in window
        assert pair_energy(mixed_keys, head, centre) == pytest.approx(float(kept[head, window_index]))
        assert float(kept[head, window_index]) >= max(pair_energy(keys, head, pair) for pair in window) - 1e-9


def test_rope_and_nope_dims_split_every_head():
    kept = torch.tensor([[1, 3], [0, 2]])
    rope, nope = rope_dims(kept, HEAD_DIM), nope_dims(kept, HEAD_DIM)
    assert rope.tolist() == [[1, 3, 5, 7], [0, 2, 4, 6]]
    assert nope.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert head_rows(rope, HEAD_DIM).tolist() == [1, 3, 5, 7, 8, 10, 12, 14]


def _anisotropic(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return basis @ torch.diag(torch.logspace(2, -3, n, dtype=torch.float64)) @ basis.T


def test_latent_factors_are_exact_at_full_rank_with_and_without_covariance_and_scales():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(12, 20, dtype=torch.float64, generator=generator)
    scales = torch.rand(12, dtype=torch.float64, generator=generator) + 0.5
    for covariance, row_scale in itertools.product((None, _anisotropic(20, 3)), (None, scales)):
        up, down = latent_factors(weight, 12, covariance, row_scale)
        torch.testing.assert_close(up @ down, weight, rtol=0, atol=1e-10)


def test_plain_factorisation_is_the_truncated_svd():
    weight = torch.randn(10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    singular = torch.linalg.svdvals(weight)
    for rank in (1, 4, 9):
        up, down = latent_factors(weight, rank)
        error = float((weight - up @ down).pow(2).sum())
        assert error == pytest.approx(float(singular[rank:].pow(2).sum()), rel=1e-9)  # Eckart-Young
        spectrum, _ = latent_spectrum(weight)
        assert left_out_energy(spectrum, rank) == pytest.approx(error / float(weight.pow(2).sum()), rel=1e-9)


def test_activation_aware_factorisation_minimises_the_output_error_under_the_covariance():
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(10, 16, dtype=torch.float64, generator=generator)
    covariance = _anisotropic(16, 6)

    def output_error(up, down):
        residual = weight - up @ down
        return float(torch.einsum('ij,jk,ik->', residual, covariance, residual))  # E ||(W - UD) x||^2

    spectrum, _ = latent_spectrum(weight, covariance)
    for rank in (2, 5):
        aware = output_error(*latent_factors(weight, rank, covariance))
        plain = output_error(*latent_factors(weight, rank))
        assert aware == pytest.approx(float(spectrum[rank:].sum()), rel=1e-9)
        assert aware < 0.5 * plain  # the planted anisotropy makes plain SVD clearly worse where inputs live
        for seed in range(5):  # no other rank-r factorisation does better
            g = torch.Generator().manual_seed(100 + seed)
            up = torch.randn(10, rank, dtype=torch.float64, generator=g)
            down = torch.linalg.lstsq(up, weight).solution
            assert output_error(up, down) >= aware - 1e-9


def test_balance_gives_keys_the_values_energy():
    generator = torch.Generator().manual_seed(7)
    keys = 10 * torch.randn(6, 12, dtype=torch.float64, generator=generator)
    values = torch.randn(4, 12, dtype=torch.float64, generator=generator)
    covariance = _anisotropic(12, 8)
    scales = balance_scales(keys, values, covariance)
    balanced = torch.cat([keys, values]) * scales.unsqueeze(1)
    key_energy = torch.einsum('ij,jk,ik->', balanced[:6], covariance, balanced[:6])
    value_energy = torch.einsum('ij,jk,ik->', balanced[6:], covariance, balanced[6:])
    assert float(key_energy) == pytest.approx(float(value_energy), rel=1e-9)
    assert torch.all(scales[6:] == 1)


def test_feature_norm_balance_gives_keys_the_values_mean_feature_norm_over_the_tokens():
    """TransMLA's balance, checked on token samples: the mean over features of each feature's norm over the tokens
    is equal for the scaled keys and the values (and differs from the energy balance when the key features do)."""
    generator = torch.Generator().manual_seed(8)
    keys = torch.randn(6, 12, dtype=torch.float64, generator=generator) * torch.tensor([40.0, 1, 1, 1, 1, 1],
                                                                                      dtype=torch.float64)[:, None]
    values = torch.randn(4, 12, dtype=torch.float64, generator=generator)
    inputs = torch.randn(20000, 12, dtype=torch.float64, generator=generator) @ torch.diag(
        torch.linspace(0.2, 3.0, 12, dtype=torch.float64))
    covariance = (inputs.T @ inputs / inputs.shape[0]).double()  # as calibration hands it over
    scales = balance_scales(keys, values, covariance, 'feature_norm')
    outputs = inputs @ (torch.cat([keys, values]) * scales.unsqueeze(1)).T  # (tokens, features)
    per_feature = outputs.norm(dim=0)
    assert float(per_feature[:6].mean()) == pytest.approx(float(per_feature[6:].mean()), rel=1e-9)
    assert float(scales[0]) != pytest.approx(float(balance_scales(keys, values, covariance)[0]), rel=0.1)
    with pytest.raises(ValueError, match='balance must be one of'):
        balance_scales(keys, values, covariance, 'none')


def test_rank_allocation_matches_brute_force_and_meets_the_total():
    generator = torch.Generator().manual_seed(9)
    spectra = [torch.sort(torch.rand(6, dtype=torch.float64, generator=generator) ** power, descending=True).values
               for power in (1, 4, 8)]
    for total in (3, 7, 12):
        ranks = allocate_latent_ranks(spectra, total)
        best = min((r for r in itertools.product(range(1, 7), repeat=3) if sum(r) == total),
                   key=lambda r: sum(left_out_energy(s, k) for s, k in zip(spectra, r)))
        assert sum(ranks) == total
        assert sum(left_out_energy(s, k) for s, k in zip(spectra, ranks)) == pytest.approx(
            sum(left_out_energy(s, k) for s, k in zip(spectra, best)), abs=1e-12)
    assert all(rank % 2 == 0 for rank in allocate_latent_ranks(spectra, 8, step=2))
    with pytest.raises(ValueError, match='out of reach'):
        allocate_latent_ranks(spectra, 19)
    with pytest.raises(ValueError, match='multiple of step'):
        allocate_latent_ranks(spectra, 7, step=2)


def test_cache_at_full_rank_with_every_pair_kept_is_the_source_cache():
    kv_heads, layers = 3, 4
    for pairs in (0, 2, HEAD_DIM // 2):
        full_rank = kv_heads * (HEAD_DIM - 2 * pairs) + kv_heads * HEAD_DIM  # position-free keys + values
        assert cache_values_per_token([full_rank] * layers, [pairs] * layers, kv_heads) == \
            layers * 2 * kv_heads * HEAD_DIM
    assert cache_values_per_token([16, 8], [1, 2], 2) == 16 + 4 + 8 + 8
