"""`dha-train bench mla` on a tiny geometry: every row is timed, each MLA row caches exactly as many numbers per token
as the GQA row it is compared with, and a budget that leaves no latent is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dha_train.commands.bench.mla import run_mla_bench
from dha_train.config import ConfigError


def test_rows_time_every_attention_at_the_stated_cache(tmp_path):
    results = run_mla_bench(seq_lens=[16, 32], out=str(tmp_path), heads=4, head_dim=8, kv_heads=[2, 1], kv_source=2,
                            rope_pairs=1, calls=1, repeats=1, cold_bytes=2 ** 16)
    rows = {(row['seq'], row['row']): row for row in results['attention']}
    assert set(rows) == {(seq, name) for seq in (16, 32) for name in ('mha', 'gqa2', 'mla@gqa2', 'gqa1', 'mla@gqa1')}
    for seq in (16, 32):
        assert rows[(seq, 'mha')]['ratio_to_mha'] == 1.0 and rows[(seq, 'mha')]['cache_values_per_token'] == 64
        for groups in (2, 1):
            gqa, mla = rows[(seq, f'gqa{groups}')], rows[(seq, f'mla@gqa{groups}')]
            assert mla['cache_values_per_token'] == gqa['cache_values_per_token'] == 2 * groups * 8
            assert mla['us'] > 0 and gqa['us'] > 0
    assert (tmp_path / 'results.json').is_file()
    assert torch.is_grad_enabled()  # the bench left the process's grad mode as it was


def test_a_budget_without_room_for_the_latent_is_refused():
    with pytest.raises(ConfigError, match='leave no latent'):
        run_mla_bench(seq_lens=[16], heads=4, head_dim=8, kv_heads=[1], kv_source=4, rope_pairs=2, calls=1, repeats=1, cold_bytes=2 ** 16)


@pytest.mark.slow
def test_conversion_bench_mla_rows_sit_at_the_gqa_rows_cache_bytes_and_train(tmp_path, data_root, tokenizer_dir):
    """The MLA rows of `bench conversion`: each conversion caches exactly the bytes of 1 K/V head in 4 (the GQA row's),
    and the default conversion trains, with and without distillation from the teacher, from the same start."""
    from transformers import LlamaConfig

    from dha_train.commands.bench.conversion_mla import mla_paired, mla_rows, sequence_scorer
    from dha_train.methods import kv_cache_bytes
    from dha_train.stages import SEQ_LEN as BENCH_SEQ_LEN
    from helpers import save_tiny_llama

    teacher = tmp_path / 'teacher'
    config = save_tiny_llama(teacher, tokenizer_dir, num_attention_heads=4, num_key_value_heads=4)
    gqa_bytes = kv_cache_bytes(LlamaConfig(**{**config.to_dict(), 'num_key_value_heads': 1}), seq_len=1)

    saved, sequences = [], {}
    rows = mla_rows(teacher, data_root, tmp_path / 'work', 0.25, batches=6, seed=0,
                    variants=['default', 'weight SVD'], save=lambda: saved.append(1),
                    score=sequence_scorer(data_root, sequences))
    assert [row['variant'] for row in rows] == ['default', 'default, distilled', 'weight SVD'] and len(saved) == 3
    for row in rows:
        assert row['kv_bytes_per_token'] == gqa_bytes == 2 * 2 * 2 * 16  # 2 layers, K+V, 16 dims, 2 bytes
        assert row['fraction_of_source'] == 0.25
    default, distilled, weight = rows
    assert weight['settings']['factorisation'] == 'weight' and weight['after_training'] is None
    assert distilled['after_conversion'] == default['after_conversion']
    assert default['tokens'] == distilled['tokens'] == 6 * 16 * BENCH_SEQ_LEN  # the quickstart data's length
    assert default['after_training'] < default['after_conversion'] - 0.1  # from a random model: CT must help
    assert distilled['after_training'] != default['after_training']  # the teacher's loss changed the updates

    # every model scored per sequence too: the same losses as the evaluation's (its mean of domain means), with an
    # interval, and the trained ones exported to be scored
    assert sorted(sequences) == ['MLA default +CT', 'MLA default @0', 'MLA default, distilled +CT', 'MLA weight SVD @0']
    assert default['scored_as'] == {'after_conversion': 'MLA default @0', 'after_training': 'MLA default +CT'}
    assert distilled['scored_as']['after_training'] == 'MLA default, distilled +CT'
    for row in rows:
        for point, label in row['scored_as'].items():
            means = [np.mean(values) for values in sequences[label].values()]
            assert abs(np.mean(means) - row[point]) < 1e-4 and 0 < row[f'{point}_ci95'] < 1
    # paired against a reference scored on the same sequences: a model against itself differs by exactly 0
    reference = {'gqa_at_0': {'label': 'MLA weight SVD @0'}, 'gqa_after_ct': {'label': 'MLA default +CT'},
                 'dha_after_ct': {'label': 'MLA default, distilled +CT'}}
    paired = {(entry['row'], entry['against']): entry for entry in mla_paired(rows, reference, sequences, data_root, seed=0)}
    assert paired['MLA default +CT', 'MLA default +CT']['difference'] == 0
    assert paired['MLA default +CT', 'MLA default +CT']['ci95'] == [0, 0]
    gap = paired['MLA default @0', 'MLA weight SVD @0']
    assert math.isclose(gap['difference'], default['after_conversion'] - weight['after_conversion'], abs_tol=1e-4)
    assert gap['ci95'][0] <= gap['difference'] <= gap['ci95'][1]
