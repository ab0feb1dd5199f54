"""`dha-train bench fusion` on a tiny GQA LLaMA (9 query heads, 3 K/V heads, as SmolLM2): each setting is one Fusion
run from the same pooled map, recorded with its L_fusion per batch and the baked model's losses with intervals."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dha_train.commands.bench.fusion import FusionBenchSettings, grid, markdown_table, run_fusion_bench
from dha_train.config import ConfigError
from dha_train.paths import recipe_path
from helpers import SEQ_LEN, save_tiny_smollm2_shape


@pytest.mark.slow
def test_bench_fusion_runs_each_setting_from_the_same_map_and_records_where_fusion_got(
        tmp_path, tokenizer_dir, data_root):
    save_tiny_smollm2_shape(tmp_path / 'gqa', tokenizer_dir)
    (tmp_path / 'validation').mkdir()
    for index in range(12):  # documents of 2,000+ characters, enough that the split's cuts span several
        (tmp_path / 'validation' / f'{index}.txt').write_text(f'validation text number {index}. ' * 120)
    settings = FusionBenchSettings(
        out=str(tmp_path / 'bench'), batches=(4,), omega_lr=(0.01, 0.4), lambda_lr=(20.0,), margin_steps=(0,),
        validation=str(tmp_path / 'validation'), text_tokens=4 * SEQ_LEN, source=str(tmp_path / 'gqa'),
        device='cpu', train_data=str(data_root), seq_len=SEQ_LEN, val_tokens=4 * SEQ_LEN, isolate_stages=False,
        results=str(tmp_path / 'fusion.json'))
    results = run_fusion_bench(settings)
    slow, fast = results['rows']
    for row in (slow, fast):
        # one group of 3 K/V heads a layer: L_fusion starts at 2 / g = 2/3 (every query head reads its own head)
        assert row['fusion_loss'][0] == pytest.approx(2 / 3, abs=1e-6)
        assert row['batches_run'] == len(row['fusion_loss']) <= 4
        assert all(math.isfinite(row[key]) and row[key.replace('_loss', '_ci95')] > 0
                   for key in ('validation_loss', 'heldout_loss'))
    # the setting reaches the algorithm: the same map and batches, another fusion lr, another path
    assert fast['fusion_loss'][1:] != slow['fusion_loss'][1:]
    assert all(row['converged_at'] is None or row['final_fusion_loss'] < 1e-3 for row in (slow, fast))
    # neither reached the threshold: no CT, the model at the budget is the baked one
    assert all(row['ct_batches'] == 0 and row['budget_validation_loss'] == row['validation_loss']
               for row in (slow, fast))
    value, low, high = fast['vs_first']['validation']
    assert low <= value <= high and 'vs_first' not in slow
    table = markdown_table(results)
    assert len(table.splitlines()) == 4 and '4 batches, omega lr 0.4, lambda lr 20, margin 0' in table
    first_folder = Path(results['plots'][0]).parent  # this grid's own folder under fusion/
    assert first_folder.parent == tmp_path / 'bench' / 'fusion'
    assert (tmp_path / 'fusion.json').read_text() == (first_folder / 'results.json').read_text()
    # run again: every Fusion and its scoring are reused, with the same figures
    again = run_fusion_bench(settings)
    assert [row['fusion_loss'] for row in again['rows']] == [row['fusion_loss'] for row in results['rows']]
    assert [row['validation_loss'] for row in again['rows']] == [row['validation_loss'] for row in results['rows']]
    # a budget curve at a margin of 1 batch, each budget its own run
    curve = run_fusion_bench(replace(settings, batches=(2, 4), omega_lr=(0.4,), margin_steps=(1,), results=None))
    short, long = curve['rows']
    assert (short['batches'], long['batches']) == (2, 4) and [row['margin_steps'] for row in curve['rows']] == [1, 1]
    # lambda is 0 in the first batch under either margin; after it, margin 0 constrains (lambda 20 x 2/3) and a
    # margin of 1 does not (its slack is 1 > 2/3), so the two 4-batch paths part at the third batch
    assert long['fusion_loss'][:2] == fast['fusion_loss'][:2] and long['fusion_loss'][2] != fast['fusion_loss'][2]
    assert short['batches_run'] <= 2 and short['tokens'] == (
        short['batches_run'] * curve['settings']['batch'] * curve['settings']['seq_len'])
    assert [Path(plot).name for plot in curve['plots']] == ['fusion.png', 'fusion_budgets.png']
    # another grid writes beside the first, never over it
    assert Path(curve['plots'][0]).parent != first_folder
    assert (tmp_path / 'fusion.json').read_text() == (first_folder / 'results.json').read_text()
    # a run that reaches the threshold (here one every run reaches) stops Fusion and trains CT for the rest
    early = run_fusion_bench(replace(settings, omega_lr=(0.4,), overrides={'threshold': 1.0e6}, results=None))
    (stopped,) = early['rows']
    assert stopped['converged_at'] == stopped['batches_run'] == 1 and stopped['ct_batches'] == 3
    assert stopped['tokens'] == early['settings']['batch'] * early['settings']['seq_len']
    assert stopped['budget_heldout_loss'] != stopped['heldout_loss'] and stopped['budget_heldout_ci95'] > 0
    with pytest.raises(ConfigError, match='--kv-heads 2'):
        run_fusion_bench(replace(settings, kv_heads=2))
    with pytest.raises(ConfigError, match='--omega-lr'):
        run_fusion_bench(replace(settings, omega_lr=(0.0,)))
    with pytest.raises(ConfigError, match='--margin-steps'):
        run_fusion_bench(replace(settings, margin_steps=(-1,)))


def test_the_default_margin_is_the_recipe_s_and_every_setting_is_a_run():
    recipe_margin = OmegaConf.load(recipe_path('real/fusion.yaml')).variables.margin_steps
    runs = grid(FusionBenchSettings(omega_lr=(0.1, 0.2), lambda_lr=(1000.0,)), [16, 32])
    assert runs == [(16, 0.1, 1000.0, recipe_margin), (16, 0.2, 1000.0, recipe_margin),
                    (32, 0.1, 1000.0, recipe_margin), (32, 0.2, 1000.0, recipe_margin)]
    assert len(grid(FusionBenchSettings(omega_lr=(0.1,), lambda_lr=(20.0, 200.0), margin_steps=(0, 4)), [16])) == 4
