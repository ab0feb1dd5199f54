"""HeadMap: constructors, validation, JSON round trip, KV-cache bytes, contiguity permutation."""

from __future__ import annotations

import pytest

from dha_train.models.head_map import HeadMap, HeadMapError


def test_constructors_and_counts():
    mha = HeadMap.mha(num_layers=2, num_heads=8, head_dim=16)
    assert mha.kv_heads() == [(8, 8), (8, 8)] and mha.kv_budget_fraction() == 1.0
    assert mha.uniform_gqa_groups() == 8
    gqa = HeadMap.gqa(num_layers=2, num_heads=8, num_groups=2, head_dim=16)
    assert gqa.layers[0].key == (0, 0, 0, 0, 1, 1, 1, 1) and gqa.uniform_gqa_groups() == 2
    asym = HeadMap.from_partitions([[[0, 5], [1, 2, 3, 4, 6, 7]]] * 2, num_heads=8, head_dim=16)
    assert asym.layers[0].key == (0, 1, 1, 1, 1, 0, 1, 1) and asym.uniform_gqa_groups() is None
    dha = HeadMap.dha(key_partitions=[[[0, 1, 2, 3], [4, 5, 6, 7]], [list(range(8))]],
                      value_partitions=[[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]],
                      num_heads=8, head_dim=16)
    assert dha.kv_heads() == [(2, 4), (1, 2)]
    assert dha.kv_budget_fraction() == pytest.approx(9 / 32)


def test_kv_cache_bytes_closed_form():
    dha = HeadMap.dha([[[0, 1, 2, 3], [4, 5, 6, 7]]] * 3, [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 3, 8, 64)
    # 3 layers x (2 + 4) heads x 64 dims x batch 2 x 100 tokens x 2 bytes
    assert dha.kv_cache_bytes(batch_size=2, seq_len=100, bytes_per_element=2) == 3 * 6 * 64 * 2 * 100 * 2
    mha = HeadMap.mha(3, 8, 64)
    assert dha.kv_cache_bytes(2, 100) * 8 == mha.kv_cache_bytes(2, 100) * 3


@pytest.mark.parametrize('build, message', [
    (lambda: HeadMap.from_partitions([[[0, 1], [1, 2, 3]]], 4, 8), 'exactly once'),
    (lambda: HeadMap.from_partitions([[[0, 1], []]], 2, 8), 'empty group'),
    (lambda: HeadMap.gqa(1, 8, 3, 8), 'num_groups dividing'),
    (lambda: HeadMap.from_dict({'head_dim': 8, 'layers': [{'key': [0, 2], 'value': [0, 1]}]}), 'every head used'),
    (lambda: HeadMap.from_dict({'head_dim': 8, 'layers': [{'key': [0, 1]}]}), 'not a head map'),
    (lambda: HeadMap.dha([[[0, 1]]], [], 2, 8), '1 key partitions but 0 value partitions'),
])
def test_invalid_maps_are_named(build, message):
    with pytest.raises(HeadMapError, match=message):
        build()


def test_json_round_trip(tmp_path):
    dha = HeadMap.dha([[[0, 3], [1, 2]]], [[[0], [1, 2, 3]]], 4, 8)
    assert HeadMap.from_json(dha.to_json()) == dha
    assert HeadMap.load(dha.save(tmp_path / 'head_map.json')) == dha


def test_contiguous_permutation_makes_shared_groups_contiguous():
    asym = HeadMap.from_partitions([[[0, 5], [1, 3, 6], [2, 4, 7]]], 8, 8)
    order = asym.contiguous_permutation()
    assert order == [[0, 5, 1, 3, 6, 2, 4, 7]]
    permuted = asym.permuted(order)
    assert permuted.layers[0].key == (0, 0, 1, 1, 1, 2, 2, 2) == permuted.layers[0].value
    uniform = HeadMap.from_partitions([[[0, 5], [1, 3], [2, 4], [6, 7]]], 8, 8).permuted(
        HeadMap.from_partitions([[[0, 5], [1, 3], [2, 4], [6, 7]]], 8, 8).contiguous_permutation())
    assert uniform.uniform_gqa_groups() == 4


def test_servable_problems_name_each_layer_engines_cannot_serve():
    """Engines take, per layer, plain GQA up to a permutation of the query heads: K and V grouped together, in
    groups of one size. Each other layer is named with its problem."""
    assert HeadMap.mha(2, 4, 8).servable_problems() == []
    assert HeadMap.gqa(2, 9, 3, 8).servable_problems() == []
    # per-layer counts and scattered (non-contiguous) groups are servable: a permutation makes them contiguous
    per_layer = HeadMap.from_partitions([[[0, 5], [1, 3], [2, 4], [6, 7]], [list(range(8))]], 8, 8)
    assert per_layer.servable_problems() == []
    assert per_layer.permuted(per_layer.contiguous_permutation()).layers[0] == HeadMap.gqa(1, 8, 4, 8).layers[0]
    dha = HeadMap.dha([[[0, 1], [2, 3]], [[0, 1, 2], [3]], [[0, 2], [1, 3]]],
                      [[[0, 2], [1, 3]], [[0, 1, 2], [3]], [[1, 3], [0, 2]]], 4, 8)
    assert dha.servable_problems() == ['layer 0: K and V are grouped apart', 'layer 1: groups of sizes [3, 1]']
    # the same groups numbered differently are not apart
    assert HeadMap.from_dict({'head_dim': 8, 'layers': [{'key': [0, 1, 0, 1], 'value': [1, 0, 1, 0]}]}
                             ).servable_problems() == []
    # a GQA source's pooled map to 2 of 3 heads: unequal runs {0, 1}, {2} (query groups of 6 and 3)
    pooled = HeadMap.pooled(HeadMap.gqa(1, 9, 3, 8), 2)
    assert pooled.servable_problems() == ['layer 0: groups of sizes [6, 3]']
