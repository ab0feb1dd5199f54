"""`dha-train search`: head maps from an MHA folder plus streamed calibration data (neighbour, similarity, asym)."""

from __future__ import annotations

import json

import pytest
import torch

from dha_train.cli import main
from dha_train.models.head_map import HeadMap
from dha_train.ops.budget import divisors
from helpers import HEAD_DIM, HEADS, LAYERS, PNG, planted_mha


def search(model_dir, out, *args) -> int:
    return main(['search', str(model_dir), str(out), *map(str, args)])


def test_similarity_search_recovers_planted_key_and_value_groups(tmp_path, data_root):
    truth = planted_mha(tmp_path / 'mha')
    out = tmp_path / 'search'
    assert search(tmp_path / 'mha', out, '--method', 'similarity', '--kv-heads', 2, '--data', data_root,
                  '--tokens', 1000, '--batch-size', 4) == 0
    head_map = HeadMap.load(out / 'head_map.json')
    for layer, planted in enumerate(truth):
        assert head_map.layers[layer].key_groups() == planted['key']
        assert head_map.layers[layer].value_groups() == planted['value']
    assert head_map.kv_budget_fraction() == 0.25
    report = json.loads((out / 'search.json').read_text())
    assert report['calibration_tokens'] == 1000 and report['measure'] == 'cka'
    for entry in report['layers']:
        # the found grouping scores higher than contiguous groups on the same similarity
        assert entry['key_within_group_similarity'] > entry['key_within_group_similarity_neighbour']
        assert set(entry) >= {'redundancy_W_q', 'redundancy_W_k', 'redundancy_W_v', 'redundancy_key activations'}
    for name in ('redundancy', 'similarity_key', 'similarity_value', 'similarity_W_q', 'similarity_W_k',
                 'similarity_W_v', 'kv_heads'):
        assert (out / f'{name}.png').read_bytes()[:4] == PNG
    saved = torch.load(out / 'similarity.pt')
    assert saved['activations']['key'].shape == (LAYERS, HEADS, HEADS)


@pytest.mark.parametrize('method', ['similarity', 'asym'])
def test_search_on_a_gqa_source_groups_its_shared_heads(tmp_path, data_root, capsys, method):
    """16 query heads sharing the 8 planted K/V heads: the search groups the shared heads (one K and one V head per
    layer per group of 4 source heads), and the map it writes serves the query heads."""
    truth = planted_mha(tmp_path / 'gqa', query_heads=16)
    out = tmp_path / 'search'
    extra = ('--iterations', 4, '--fitness-batches', 1) if method == 'asym' else ()
    assert search(tmp_path / 'gqa', out, '--method', method, '--kv-heads', 2, '--data', data_root,
                  '--tokens', 1000, '--batch-size', 4, *extra) == 0
    assert '25.0% of the source KV cache, 12.5% of MHA' in capsys.readouterr().out
    head_map = HeadMap.load(out / 'head_map.json')
    source = HeadMap.gqa(LAYERS, 16, HEADS, HEAD_DIM)
    key_partitions, value_partitions = head_map.source_partitions(source)
    assert head_map.num_query_heads == 16 and head_map.kv_heads() == [(2, 2)] * LAYERS
    if method == 'similarity':
        assert key_partitions == [planted['key'] for planted in truth]
        assert value_partitions == [planted['value'] for planted in truth]


def test_shared_kv_and_best_match_measure_give_one_map_for_k_and_v(tmp_path, data_root):
    planted_mha(tmp_path / 'mha')
    out = tmp_path / 'search'
    assert search(tmp_path / 'mha', out, '--method', 'similarity', '--kv-budget', 0.5, '--shared-kv',
                  '--measure', 'best-match', '--sample-tokens', 64, '--data', data_root, '--tokens', 512) == 0
    head_map = HeadMap.load(out / 'head_map.json')
    assert all(layer.key == layer.value for layer in head_map.layers)
    assert head_map.kv_heads() == [(4, 4)] * LAYERS
    report = json.loads((out / 'search.json').read_text())
    assert report['subsample_tokens'] == 64 and report['measure'] == 'best-match'


def test_dp_allocation_meets_the_total_exactly_with_allowed_counts(tmp_path, data_root):
    planted_mha(tmp_path / 'mha')
    out = tmp_path / 'search'
    assert search(tmp_path / 'mha', out, '--method', 'similarity', '--kv-budget', 0.375, '--allocation', 'dp',
                  '--data', data_root, '--tokens', 512) == 0
    counts = HeadMap.load(out / 'head_map.json').kv_heads()
    assert sum(k + v for k, v in counts) == 12  # 0.375 of 2 x 2 x 8
    assert all(count in divisors(HEADS) for pair in counts for count in pair)
    # Merging two planted groups (count 1) is far costlier than keeping them (count 2): no slot drops below 2.
    assert min(count for pair in counts for count in pair) == 2


def test_asym_search_beats_neighbour_grouping_on_its_fitness(tmp_path, data_root):
    planted_mha(tmp_path / 'mha')
    out = tmp_path / 'search'
    assert search(tmp_path / 'mha', out, '--method', 'asym', '--kv-heads', 2, '--data', data_root, '--tokens', 512,
                  '--sample-tokens', 64, '--iterations', 25, '--fitness', 'kl', '--batch-size', 4) == 0
    report = json.loads((out / 'search.json').read_text())
    asym = report['asym']
    assert asym['criterion'] == 'kl' and asym['mha_loss'] == 0.0
    assert asym['final_loss'] < asym['neighbour_loss']
    head_map = HeadMap.load(out / 'head_map.json')
    assert all(layer.key == layer.value and layer.num_key_heads == 2 for layer in head_map.layers)


def test_neighbour_needs_no_data_and_bad_requests_fail_early(tmp_path, data_root, capsys):
    planted_mha(tmp_path / 'mha')
    assert search(tmp_path / 'mha', tmp_path / 'nb', '--method', 'neighbour', '--kv-heads', 4) == 0
    assert HeadMap.load(tmp_path / 'nb' / 'head_map.json') == HeadMap.gqa(LAYERS, HEADS, 4, HEAD_DIM)
    capsys.readouterr()
    assert search(tmp_path / 'mha', tmp_path / 'nb', '--method', 'neighbour', '--kv-heads', 4) == 2
    assert 'not empty' in capsys.readouterr().err
    assert search(tmp_path / 'mha', tmp_path / 'x', '--method', 'similarity', '--kv-heads', 2) == 2
    assert 'needs calibration data' in capsys.readouterr().err
    assert search(tmp_path / 'mha', tmp_path / 'x', '--kv-heads', 3, '--data', data_root) == 2
    assert 'cannot form equal groups' in capsys.readouterr().err
    assert search(tmp_path / 'mha', tmp_path / 'x', '--kv-heads', 2, '--data', data_root, '--tokens', 10 ** 7) == 2
    assert 'calibration asked for 10000000 tokens' in capsys.readouterr().err
    assert not (tmp_path / 'x').exists()


@pytest.mark.parametrize('query_heads', [HEADS, 16])
def test_servable_dp_search_shares_k_and_v_with_per_layer_counts(tmp_path, data_root, capsys, query_heads):
    """``--servable --allocation dp``: the shared K/V grouping of ``--shared-kv`` with one count per layer from the
    divisors of the source's K/V heads (8, also under 16 query heads), K and V priced together; every layer is
    plain GQA after a permutation of the query heads. Budgets it cannot meet fail before any calibration."""
    from dha_train.ops.budget import allocate_kv_heads

    planted_mha(tmp_path / 'src', query_heads=query_heads)
    out = tmp_path / 'search'
    assert search(tmp_path / 'src', out, '--method', 'similarity', '--kv-budget', 0.375, '--allocation', 'dp',
                  '--servable', '--data', data_root, '--tokens', 512) == 0
    head_map = HeadMap.load(out / 'head_map.json')
    report = json.loads((out / 'search.json').read_text())
    assert report['servable'] is True and report['servable_problems'] == [] == head_map.servable_problems()
    assert all(layer.key == layer.value for layer in head_map.layers)
    counts = head_map.kv_heads()
    assert sum(k + v for k, v in counts) == 12 and all(k == v and HEADS % k == 0 for k, v in counts)
    # the counts are the shared DP's on the report's cost table (the K and V cost of each layer's shared grouping)
    costs = [[{int(count): value for count, value in kind.items()} for kind in layer]
             for layer in report['allocation_costs']]
    assert allocate_kv_heads(costs, LAYERS, HEADS, 12, shared=True) == counts
    assert head_map.num_query_heads == query_heads
    head_map.source_partitions(HeadMap.gqa(LAYERS, query_heads, HEADS, HEAD_DIM))  # whole source heads only

    capsys.readouterr()
    assert search(tmp_path / 'src', tmp_path / 'x', '--kv-budget', 0.4375, '--allocation', 'dp', '--servable',
                  '--data', data_root) == 2
    assert 'reachable totals are 4 to 12 in steps of 2, 16 to 20 in steps of 2, 24, 32' in capsys.readouterr().err
    assert search(tmp_path / 'src', tmp_path / 'x', '--method', 'asym', '--kv-heads', 2, '--servable',
                  '--data', data_root) == 2
    assert 'servable needs groups of equal size' in capsys.readouterr().err
    assert not (tmp_path / 'x').exists()
