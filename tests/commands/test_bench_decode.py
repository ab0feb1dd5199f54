"""`dha-train bench decode` at a toy size: every row is measured in both sections, each model's cache holds the
numbers its row claims (DHA at 25% / 50% of MHA's, MLA at the GQA row's), and the verdicts are taken at the target
length only. Timings are printed, never asserted."""

from __future__ import annotations

import json

import pytest

from dha_train.cli import main
from dha_train.commands.bench.decode import ROWS, DecodeSettings, build_models, cache_numbers_per_token, dha_head_map


@pytest.mark.slow
def test_every_row_is_measured_and_holds_the_cache_it_claims(tmp_path, capsys):
    assert main(['bench', 'decode', '--batch-sizes', '1', '2', '--seq-lens', '32', '--heads', '8', '--head-dim', '8',
                 '--kv-heads', '2', '--rope-pairs', '1', '--calls', '2', '--decode-tokens', '2', '--repeats', '1',
                 '--out', str(tmp_path)]) == 0
    results = json.loads((tmp_path / 'results.json').read_text())
    for section in ('attention', 'decode'):
        measured = {(row['row'], row['batch']) for row in results['rows'] if row['measure'] == section}
        rows = ROWS if section == 'attention' else [row for row in ROWS if not row.endswith('-expanded')]
        assert measured == {(row, batch) for row in rows for batch in (1, 2)}
    cache = {row['row']: row['cache_numbers_per_token'] for row in results['rows']}
    mha = 2 * 8 * 8
    assert cache['mha'] == cache['moh75'] == mha
    assert cache['gqa8'] == cache['mla@gqa8'] == cache['dha25'] == mha // 4
    assert cache['dha50'] == mha // 2
    assert results['targets'] == []  # the targets are read at seq 8192 only
    assert 'attention: us/step' in capsys.readouterr().out


def test_the_dha_rows_have_uneven_groups_that_differ_between_keys_and_values():
    settings = DecodeSettings(heads=32, layers=2, seq_lens=(64,))
    for fraction in (0.25, 0.5):
        head_map = dha_head_map(settings, fraction)
        for layer in head_map.layers:
            assert layer.num_key_heads + layer.num_value_heads == round(2 * 32 * fraction)
            sizes = [list(layer.key).count(head) for head in range(layer.num_key_heads)]
            assert len(set(sizes)) > 1 and list(layer.key) != list(layer.value)
    models = build_models(DecodeSettings(heads=8, head_dim=8, kv_heads=2, rope_pairs=1, layers=1, seq_lens=(16,)))
    assert cache_numbers_per_token(models['dha25']) == 2 * 8 * 8 // 4
