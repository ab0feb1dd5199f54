"""`dha-train bench real-tables`: what each headline row says its model went through."""

from __future__ import annotations

import pytest

from dha_train.commands.bench.real.report import marked_difference
from dha_train.commands.bench.real.tables import _headline_stage


@pytest.mark.parametrize('label, method, stage', [
    ('mean-pool kv1 +KL', 'mean_pool', 'healed (refit, transfer, KL)'),
    ('mean-pool kv2 +CT', 'mean_pool', 'CT'),
    ('DHA kv2 post-fusion', 'dha', 'Fusion'),
    ('DHA kv2 +CT', 'dha', 'Fusion + CT'),
    ('aligned GQA kv1 +prune', 'aligned_gqa', 'L0 pruning + distillation'),
    # MoH pools no K/V head, so its healing has no refit
    ('MoH 7/9 +KL', 'moh', 'healed (transfer, KL), 7/9 heads active'),
    ('MoH 7/9 +CT', 'moh', 'CT, 7/9 heads active'),
])
def test_each_headline_row_names_the_stages_its_model_went_through(label, method, stage):
    assert _headline_stage({'label': label, 'method': method}) == stage


@pytest.mark.parametrize('difference, printed', [
    ([0.020, 0.0004, 0.039], '+0.020 [+0.000, +0.039]'),  # excludes 0, but not as printed: no star
    ([-0.020, -0.039, -0.0004], '-0.020 [-0.039, -0.000]'),
    ([0.020, 0.0006, 0.039], '+0.020 [+0.001, +0.039]*'),
    ([-0.020, -0.039, -0.0006], '-0.020 [-0.039, -0.001]*'),
    ([0.005, -0.010, 0.020], '+0.005 [-0.010, +0.020]'),
])
def test_a_difference_is_starred_where_its_printed_interval_excludes_0(difference, printed):
    assert marked_difference(difference) == printed


def test_the_ranking_orders_each_group_by_loss_and_pairs_each_row_with_the_one_ahead(tmp_path):
    """``add_ranking`` and ``ranking_table``: rows of one cache, kind and token count are ranked by held-out loss; each
    row after the first carries its paired difference from the row just ahead (a row right where the one ahead is
    wrong is +0.5 in accuracy, significant); the teacher, a ``same_as`` repeat, an intermediate row and a row alone
    in its group are not ranked."""
    import json

    from dha_train.commands.bench.real.report import add_intervals
    from dha_train.commands.bench.real.tables import ranking_table

    losses = [3.0 + 0.01 * i for i in range(30)]

    def row(label, method, budget, tokens, accuracy, loss, **extra):
        path = tmp_path / f'{label}.json'
        path.write_text(json.dumps({'tasks': {'piqa': [{'doc_id': i, 'acc': a} for i, a in enumerate(accuracy)]},
                                    'heldout_sequences': {'book': [v + loss for v in losses]}}))
        return {'label': label, 'method': method, 'budget': budget, 'tokens': tokens, 'metric': {'piqa': 'acc'},
                'val_loss': 3.145 + loss, 'val_loss_ci95': 0.01, 'mean_accuracy': sum(accuracy) / len(accuracy),
                'accuracy': {'piqa': sum(accuracy) / len(accuracy)}, 'kv_bytes': 1, 'documents_file': str(path),
                'evaluation': 'ranking', **extra}

    half, all_right = [0.0, 1.0] * 20, [1.0] * 40
    results = {'settings': {'training_tokens_per_method': 64, 'limit': 40}, 'rows': [
        row('teacher', 'teacher', None, 0, all_right, 0.0),
        row('mean-pool kv1 +KL', 'mean_pool', 'kv1', 64, half, 0.5, stage='kl'),
        row('DHA kv1 +KL', 'dha', 'kv1', 64, all_right, 0.2, stage='kl'),
        row('AsymGQA kv1 +KL', 'asym_gqa', 'kv1', 64, half, 0.5, stage='kl', same_as='mean-pool kv1 +KL'),
        row('mean-pool kv1 +refit', 'mean_pool', 'kv1', 0, half, 0.9, stage='refit', evaluation='intermediate'),
        row('mean-pool kv1 +CT', 'mean_pool', 'kv1', 64, half, 1.5)]}
    add_intervals(results, seed=2)
    rows = {r['label']: r for r in results['rows']}
    assert 'vs_next_better' not in rows['DHA kv1 +KL']
    ahead = rows['mean-pool kv1 +KL']['vs_next_better']
    assert ahead['label'] == 'DHA kv1 +KL' and ahead['loss'] == pytest.approx([0.3, 0.3, 0.3])
    difference, low, high = ahead['accuracy']
    assert difference == pytest.approx(-0.5) and low <= -0.5 <= high < 0
    table = ranking_table([results]).splitlines()
    assert table[2:] == [
        '| a third | healed | 1 | DHA kv1 +KL | 3.345 ± 0.010 | 1.000 ± 0.000 | - | - |',
        f'| a third | healed | 2 | mean-pool kv1 +KL | 3.645 ± 0.010 | 0.500 ± {rows["mean-pool kv1 +KL"]["accuracy_ci95"]:.3f} '
        f'| +0.300 [+0.300, +0.300]* | -0.500 [{low:+.3f}, {high:+.3f}]* |']


def test_the_plots_draw_each_budget_apart_with_intervals_and_skip_curves_that_repeat_another(tmp_path):
    """One panel per cache budget; healing and own training start from the method's 0-token point; a point carries
    its half-width; a method whose rows at a budget are all another's models (``same_as``) draws no curve there."""
    from dha_train.commands.bench.real.report import panel_curves, plot_rows

    def row(label, method, budget, tokens, loss, stage=None, same_as=None):
        return {'label': label, 'method': method, 'budget': budget, 'tokens': tokens, 'val_loss': loss,
                'val_loss_ci95': 0.05, 'mean_accuracy': 0.4, 'accuracy_ci95': 0.02, 'stage': stage,
                'same_as': same_as}

    results = {'source': {'name': 'tiny'}, 'rows': [
        row('teacher', 'teacher', None, 0, 3.0),
        row('mean-pool kv1 @0', 'mean_pool', 'kv1', 0, 8.0),
        row('mean-pool kv1 +KL', 'mean_pool', 'kv1', 64, 4.0, stage='kl'),
        row('mean-pool kv1 +CT', 'mean_pool', 'kv1', 64, 6.0),
        row('AsymGQA kv1 @0', 'asym_gqa', 'kv1', 0, 8.0, same_as='mean-pool kv1 @0'),
        row('AsymGQA kv1 +CT', 'asym_gqa', 'kv1', 64, 6.0, same_as='mean-pool kv1 +CT'),
        row('DHA kv1 @0', 'dha', 'kv1', 0, 8.0, same_as='mean-pool kv1 @0'),
        row('DHA kv1 post-fusion', 'dha', 'kv1', 64, 7.0),
        row('mean-pool kv2 @0', 'mean_pool', 'kv2', 0, 5.0),
        row('mean-pool kv2 +CT', 'mean_pool', 'kv2', 64, 4.5)]}
    panels = panel_curves(results, 'val_loss', 'val_loss_ci95')
    assert list(panels) == ['a third of the cache', 'two thirds of the cache']
    third = panels['a third of the cache']
    assert set(third) == {'mean_pool', 'mean_pool healed', 'dha'}
    assert third['mean_pool healed']['points'] == [(0, 8.0, 0.05), (64, 4.0, 0.05)]
    assert third['dha']['points'] == [(0, 8.0, 0.05), (64, 7.0, 0.05)] and third['dha']['dashed']
    assert not third['mean_pool healed']['dashed']
    assert set(panels['two thirds of the cache']) == {'mean_pool'}
    for path in plot_rows(results, tmp_path):
        assert open(path, 'rb').read(4) == b'\x89PNG'
