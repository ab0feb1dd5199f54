"""The refit's closed forms (dha_train.ops.refit) against brute force on explicit tokens: objectives equal to their
sample values, optima that no gradient step improves, and exact recovery where the maths allows it."""

from __future__ import annotations

import pytest
import torch

from dha_train.ops import refit as fit

D, HEAD_DIM, TOKENS = 12, 6, 400


@pytest.fixture()
def tokens():
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(D, D, dtype=torch.float64, generator=generator)
    return torch.randn(TOKENS, D, dtype=torch.float64, generator=generator) @ mixing


def _gram(x):
    return x.T @ x / x.shape[0]


def _pairs(x, rows):
    """Complex per-pair projections (tokens, d/2) of rows (d, D)."""
    out = x @ rows.T
    return torch.complex(out[:, :HEAD_DIM // 2], out[:, HEAD_DIM // 2:])


def _key_objective(x, members, weights, rows, scales):
    shared = _pairs(x, rows)
    return sum((weights[m] * (_pairs(x, members[m]) - scales[m] * shared).abs().pow(2).mean(0)).sum()
               for m in range(members.shape[0]))


def test_shared_key_objective_equals_its_sample_value_and_no_gradient_improves_it(tokens):
    generator = torch.Generator().manual_seed(1)
    members = torch.randn(3, HEAD_DIM, D, dtype=torch.float64, generator=generator)
    weights = torch.rand(3, HEAD_DIM // 2, dtype=torch.float64, generator=generator) + 0.1
    result = fit.fit_shared_key(members, weights, _gram(tokens))
    sampled = _key_objective(tokens, members, weights, result.rows, result.scales)
    assert float(sampled) == pytest.approx(result.residual, rel=1e-9)
    assert 0 < result.residual < result.total
    rows = result.rows.clone().requires_grad_(True)
    scales = result.scales.clone().requires_grad_(True)
    _key_objective(tokens, members, weights, rows, scales).backward()
    assert rows.grad.abs().max() < 1e-6 * result.total and scales.grad.abs().max() < 1e-6 * result.total
    # a rank-1 fit cannot beat the eigenvalue bound; random perturbations only raise the objective
    for seed in range(5):
        noise = torch.Generator().manual_seed(10 + seed)
        worse = _key_objective(tokens, members, weights,
                               result.rows + 1e-2 * torch.randn(result.rows.shape, dtype=torch.float64, generator=noise),
                               result.scales)
        assert float(worse) > result.residual


def test_one_member_or_equal_members_give_the_source_key_back(tokens):
    generator = torch.Generator().manual_seed(2)
    key = torch.randn(HEAD_DIM, D, dtype=torch.float64, generator=generator)
    weights = torch.rand(3, HEAD_DIM // 2, dtype=torch.float64, generator=generator) + 0.1
    for members in (key[None], key.expand(3, -1, -1)):
        result = fit.fit_shared_key(members, weights[:members.shape[0]], _gram(tokens))
        torch.testing.assert_close(result.rows, key, rtol=0, atol=1e-10)
        torch.testing.assert_close(result.scales, torch.ones_like(result.scales), rtol=0, atol=1e-10)
        assert result.residual < 1e-9 * result.total


def test_members_equal_up_to_a_per_pair_rotation_and_scale_are_fitted_exactly(tokens):
    """Keys that differ by a RoPE-commuting 2x2 rotation-and-scale per pair share one head with no error (mean-pool
    cannot do this: the rotated keys average towards zero)."""
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(HEAD_DIM, D, dtype=torch.float64, generator=generator)
    turn = torch.polar(torch.rand(HEAD_DIM // 2, dtype=torch.float64, generator=generator) + 0.5,
                       torch.rand(HEAD_DIM // 2, dtype=torch.float64, generator=generator) * 6.28)
    z = torch.complex(key[:HEAD_DIM // 2], key[HEAD_DIM // 2:]) * turn[:, None]
    rotated = torch.cat([z.real, z.imag])
    result = fit.fit_shared_key(torch.stack([key, rotated]), torch.ones(2, HEAD_DIM // 2, dtype=torch.float64),
                                _gram(tokens))
    assert result.residual < 1e-9 * result.total
    pooled = (key + rotated) / 2
    assert float(_key_objective(tokens, torch.stack([key, rotated]), torch.ones(2, HEAD_DIM // 2),
                                pooled, torch.ones(2, HEAD_DIM // 2))) > 1e-2 * result.total


def test_logit_error_equals_the_mean_over_independent_token_pairs(tokens):
    """The folded query against the shared key: the closed-form logit error equals the average over every
    (query token, key token) pair of the squared change in the complex pair logits, and equals the key fit's
    residual when the weights are the query energies."""
    generator = torch.Generator().manual_seed(4)
    queries = torch.randn(2, HEAD_DIM, D, dtype=torch.float64, generator=generator)
    keys = torch.randn(2, HEAD_DIM, D, dtype=torch.float64, generator=generator)
    x = tokens[:60]
    gram = _gram(x)
    energy = fit.pair_energy(queries.reshape(-1, D), gram, HEAD_DIM)
    result = fit.fit_shared_key(keys, energy, gram)
    total_error = 0.0
    for m in range(2):
        folded = fit.scale_query_pairs(queries[m], result.scales[m])
        error, _ = fit.logit_error(queries[m], keys[m], folded, result.rows, gram)
        before = _pairs(x, queries[m])[:, None, :] * _pairs(x, keys[m])[None, :, :].conj()
        after = _pairs(x, folded)[:, None, :] * _pairs(x, result.rows)[None, :, :].conj()
        assert error == pytest.approx(float((before - after).abs().pow(2).mean((0, 1)).sum()), rel=1e-9)
        total_error += error
    assert total_error == pytest.approx(result.residual, rel=1e-9)


def _value_objective(x, values, outputs, rows, new_outputs):
    return sum(((x @ (outputs[h] @ values[h]).T) - (x @ (new_outputs[h] @ rows).T)).pow(2).sum(1).mean()
               for h in range(values.shape[0]))


def test_shared_value_objective_equals_its_sample_value_and_is_optimal(tokens):
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(3, HEAD_DIM, D, dtype=torch.float64, generator=generator)
    outputs = torch.randn(3, 10, HEAD_DIM, dtype=torch.float64, generator=generator)
    result = fit.fit_shared_value(values, outputs, _gram(tokens))
    sampled = _value_objective(tokens, values, outputs, result.rows, result.output_columns)
    assert float(sampled) == pytest.approx(result.residual, rel=1e-9)
    rows = result.rows.clone().requires_grad_(True)
    new_outputs = result.output_columns.clone().requires_grad_(True)
    _value_objective(tokens, values, outputs, rows, new_outputs).backward()
    assert rows.grad.abs().max() < 1e-6 * result.total and new_outputs.grad.abs().max() < 1e-6 * result.total
    for h in range(3):
        error, _ = fit.value_output_error(values[h], outputs[h], result.rows, result.output_columns[h], _gram(tokens))
        assert error >= 0
    # the whitened basis: the new values have unit second moment
    torch.testing.assert_close(result.rows @ _gram(tokens) @ result.rows.T, torch.eye(HEAD_DIM, dtype=torch.float64))


def test_values_equal_up_to_an_invertible_map_are_fitted_exactly(tokens):
    generator = torch.Generator().manual_seed(6)
    value = torch.randn(HEAD_DIM, D, dtype=torch.float64, generator=generator)
    mix = torch.randn(HEAD_DIM, HEAD_DIM, dtype=torch.float64, generator=generator) + 3 * torch.eye(HEAD_DIM)
    outputs = torch.randn(2, 10, HEAD_DIM, dtype=torch.float64, generator=generator)
    result = fit.fit_shared_value(torch.stack([value, mix @ value]), outputs, _gram(tokens))
    assert result.residual < 1e-9 * result.total
    torch.testing.assert_close(result.output_columns[1] @ result.rows, outputs[1] @ mix @ value, rtol=0, atol=1e-8)


def test_regression_onto_a_latent_is_least_squares(tokens):
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(4, D, dtype=torch.float64, generator=generator)
    down = torch.randn(5, D, dtype=torch.float64, generator=generator)
    mapped, latent_gram = fit.regress_onto_latent(rows, _gram(tokens), down)
    latent = tokens @ down.T
    expected = torch.linalg.lstsq(latent, tokens @ rows.T).solution.T
    torch.testing.assert_close(mapped, expected, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(latent_gram, _gram(latent))


def _layer(generator, query_heads, kv_heads):
    return {'q': torch.randn(query_heads * HEAD_DIM, D, dtype=torch.float64, generator=generator),
            'k': torch.randn(kv_heads * HEAD_DIM, D, dtype=torch.float64, generator=generator),
            'v': torch.randn(kv_heads * HEAD_DIM, D, dtype=torch.float64, generator=generator),
            'o': torch.randn(D, query_heads * HEAD_DIM, dtype=torch.float64, generator=generator)}


def test_layer_refit_at_the_identity_budget_returns_the_source_in_the_converted_order(tokens):
    layer = _layer(torch.Generator().manual_seed(8), 4, 2)
    order = [2, 3, 0, 1]  # the converted model lists the source's query heads in another order
    result = fit.refit_head_map_layer(layer, _gram(tokens), HEAD_DIM, source_kv_of_query=[0, 0, 1, 1],
                                      query_source=order, key_of_query=[0, 0, 1, 1], value_of_query=[0, 0, 1, 1])
    heads = lambda rows: rows.reshape(-1, HEAD_DIM, D)  # noqa: E731
    torch.testing.assert_close(heads(result.q), heads(layer['q'])[order], rtol=0, atol=1e-9)
    torch.testing.assert_close(result.k, heads(layer['k'])[[1, 0]].reshape(-1, D), rtol=0, atol=1e-9)
    # values are whitened, so compare the value-output maps each query head adds
    o_new = result.o.T.reshape(4, HEAD_DIM, D).transpose(1, 2)
    o_src = layer['o'].T.reshape(4, HEAD_DIM, D).transpose(1, 2)
    v_new, v_src = heads(result.v), heads(layer['v'])
    for head, source in enumerate(order):
        torch.testing.assert_close(o_new[head] @ v_new[[0, 0, 1, 1][head]], o_src[source] @ v_src[source // 2],
                                   rtol=0, atol=1e-8)
    assert result.key_residual < 1e-9 * result.key_total and result.value_residual < 1e-9 * result.value_total


def test_layer_refit_lowers_both_errors_below_mean_pooling(tokens):
    layer = _layer(torch.Generator().manual_seed(9), 4, 4)
    gram = _gram(tokens)
    result = fit.refit_head_map_layer(layer, gram, HEAD_DIM, source_kv_of_query=[0, 1, 2, 3],
                                      query_source=[0, 1, 2, 3], key_of_query=[0, 0, 0, 1],
                                      value_of_query=[0, 1, 1, 1])
    heads = lambda rows: rows.reshape(-1, HEAD_DIM, D)  # noqa: E731
    q, k, v = heads(layer['q']), heads(layer['k']), heads(layer['v'])
    o = layer['o'].T.reshape(4, HEAD_DIM, D).transpose(1, 2)
    pooled_k = [k[:3].mean(0), k[3]]
    pooled_v = [v[0], v[1:].mean(0)]
    new_q, new_k, new_v = heads(result.q), heads(result.k), heads(result.v)
    new_o = result.o.T.reshape(4, HEAD_DIM, D).transpose(1, 2)
    key_map, value_map = [0, 0, 0, 1], [0, 1, 1, 1]
    pooled_key = sum(fit.logit_error(q[h], k[h], q[h], pooled_k[key_map[h]], gram)[0] for h in range(4))
    refit_key = sum(fit.logit_error(q[h], k[h], new_q[h], new_k[key_map[h]], gram)[0] for h in range(4))
    pooled_value = sum(fit.value_output_error(v[h], o[h], pooled_v[value_map[h]], o[h], gram)[0] for h in range(4))
    refit_value = sum(fit.value_output_error(v[h], o[h], new_v[value_map[h]], new_o[h], gram)[0] for h in range(4))
    assert refit_key == pytest.approx(result.key_residual, rel=1e-9) and refit_key < pooled_key
    assert refit_value == pytest.approx(result.value_residual, rel=1e-9) and refit_value < pooled_value
