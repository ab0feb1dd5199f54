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
