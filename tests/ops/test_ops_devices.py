"""The conversion maths makes every tensor on its inputs' device.

`convert --method mla --device cuda` once failed on an H200: `balance_scales` concatenated a tensor made on the CPU
with CUDA ones. CI has no GPU, so these tests set the default device to `meta` and feed CPU inputs: a tensor made
without the inputs' device lands on `meta`, and mixing it with the inputs raises (or leaves a `meta` result, which
the checks below catch). Host-side values (loop bounds, index lists) say `device='cpu'` explicitly.
"""

from __future__ import annotations

import pytest
import torch

from dha_train.ops import alignment, deepseek, refit, similarity
from dha_train.ops.mla import (
    BALANCES,
    folded_pair_bases,
    joint_latent_rows,
    kept_rope_pairs,
    latent_energies,
    mix_head_pairs,
    mla_layer_weights,
    pair_key_cross_energy,
    rope_pair_scores,
)

HEADS, KV_HEADS, DIM, HIDDEN, TOKENS = 4, 2, 8, 24, 64


def _on_cpu(*tensors) -> bool:
    return all(t.device.type == 'cpu' for t in tensors)


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN) + 0.5
    q, k, v = (torch.randn(n * DIM, HIDDEN) for n in (HEADS, KV_HEADS, KV_HEADS))
    o = torch.randn(HIDDEN, HEADS * DIM)
    return {'x': x, 'q': q, 'k': k, 'v': v, 'o': o, 'covariance': (x.T @ x / TOKENS).double()}


def _same_values_under_a_meta_default_device(maths, inputs, *args) -> None:
    """Run ``maths`` plainly, then with `meta` as the default device under deterministic mode, and compare.

    Deterministic mode fills every uninitialised tensor with NaN: a CPU tensor indexed by a stray `meta` index reads
    such memory instead of raising, so its values differ from the plain run's and the comparison fails."""
    reference = maths(inputs, *args)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.device('meta'):
            results = maths(inputs, *args)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert _on_cpu(*results)
    for got, want in zip(results, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('balance', BALANCES)
def test_mla_and_deepseek_conversion_maths(inputs, balance):
    _same_values_under_a_meta_default_device(_mla_and_deepseek_conversion_maths, inputs, balance)


def _mla_and_deepseek_conversion_maths(inputs, balance) -> list[torch.Tensor]:
    q, k, v, x, covariance = inputs['q'], inputs['k'], inputs['v'], inputs['x'], inputs['covariance']
    scores = rope_pair_scores(x @ q.T, x @ k.T, DIM, [0, 0, 1, 1])
    kept = kept_rope_pairs(KV_HEADS, DIM, 2, 'norm', scores)
    bases, centres, fold_energy = folded_pair_bases(pair_key_cross_energy(k, covariance, KV_HEADS, DIM), 2)
    folded_keys = mix_head_pairs(x @ k.T, bases, DIM)
    kept_folded = kept_rope_pairs(KV_HEADS, DIM, 2, 'norm', rope_pair_scores(
        mix_head_pairs(x @ q.T, bases, DIM, [0, 0, 1, 1]), folded_keys, DIM, [0, 0, 1, 1]), centres)
    rows, scales = joint_latent_rows(k, v, kept, DIM, covariance, balance)
    spectrum = latent_energies(rows, covariance, scales)
    converted = mla_layer_weights(k, v, kept, DIM, 6, covariance, balance)
    mix, _ = deepseek.shared_key_mix(pair_key_cross_energy(k, covariance, KV_HEADS, DIM), [0, 2])
    folded, _ = deepseek.shared_key_mix(pair_key_cross_energy(k, covariance, KV_HEADS, DIM), [0, 2], 2, 2)
    layer = deepseek.deepseek_attention_weights(q, k, v, HEADS, KV_HEADS, DIM, mix, 6, covariance,
                                                balance, pin_inputs=x)
    fitted = deepseek.latent_norm_fit('regression', layer['up'], layer['kv_a_proj_with_mqa.weight'][:6],
                                      layer['targets'], x)[1]
    linear = deepseek.latent_norm_fit('linear', layer['up'], layer['kv_a_proj_with_mqa.weight'][:6],
                                      layer['targets'], x)
    kv_b = deepseek.kv_b_weight(fitted, HEADS, KV_HEADS, DIM)
    return [spectrum, *converted.values(), *layer.values(), kv_b, *linear, folded, bases, fold_energy, folded_keys,
            kept_folded.double()]


def test_alignment_similarity_and_refit_maths(inputs):
    _same_values_under_a_meta_default_device(_alignment_similarity_and_refit_maths, inputs)


def _alignment_similarity_and_refit_maths(inputs) -> list[torch.Tensor]:
    q, k, v, o, covariance = inputs['q'], inputs['k'], inputs['v'], inputs['o'], inputs['covariance']
    # its own generator and dtype: the global RNG state and default dtype depend on which tests ran before
    caches = torch.randn(TOKENS, HEADS * DIM, generator=torch.Generator(device='cpu').manual_seed(1),
                         dtype=torch.float32, device='cpu')
    partition = [[0, 1], [2, 3]]
    gram = similarity.symmetric_gram(caches)
    results = [gram, similarity.cka_from_gram(gram, HEADS),
               similarity.best_match_cosine(caches.reshape(TOKENS, HEADS, DIM).transpose(0, 1)),
               torch.tensor(similarity.layer_redundancy(similarity.cka_from_gram(gram, HEADS)), device='cpu')]
    for kind in ('key', 'value'):
        results += [alignment.aligned_similarity(gram, HEADS, kind, criterion, TOKENS)
                    for criterion in ('cos', 'dist')]
        maps = alignment.group_maps(gram, partition, kind)
        results.append(torch.tensor(alignment.within_group_cosine(gram, partition, TOKENS, maps), device='cpu'))
        head_q = torch.cat([q, q])  # MHA: one K and V head per query head
        folded = (alignment.fold_value_maps(torch.cat([v, v]), o, maps) if kind == 'value'
                  else alignment.fold_key_maps(head_q, torch.cat([k, k]), maps))
        results += [maps, *folded]
    layer = refit.refit_head_map_layer({'q': q, 'k': k, 'v': v, 'o': o}, covariance, DIM,
                                       source_kv_of_query=[0, 0, 1, 1], query_source=[0, 1, 2, 3],
                                       key_of_query=[0, 0, 0, 0], value_of_query=[0, 0, 0, 0])
    return results + [value for value in vars(layer).values() if isinstance(value, torch.Tensor)]
