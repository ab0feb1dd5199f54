"""`dha-train bench mla` on a tiny geometry: every row is timed, each MLA row caches exactly as many numbers per token
as the GQA row it is compared with, and a budget that leaves no latent is refused."""

from __future__ import annotations

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
