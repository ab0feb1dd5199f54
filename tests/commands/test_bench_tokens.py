"""`dha-train bench tokens` on a short quickstart run: each arm's token axis is the tokens its stages trained on,
the curves start where their models do, seeds change the runs, and the summary is the curves' own arithmetic."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from dha_train.commands.bench.tokens import TokenBenchSettings, markdown_table, run_token_bench, summarise
from dha_train.config import ConfigError
from dha_train.stages import DONE_MARKER

BATCH_TOKENS = 16 * 256  # the tiny recipes' global batch x the quickstart's sequence length


@pytest.mark.slow
def test_bench_tokens_curves_on_a_short_quickstart_run(tmp_path):
    settings = TokenBenchSettings(run=str(tmp_path / 'qs'), seeds=(1, 2), ct_batches=4, gqa_batches=8, heal_batches=2,
                                  eval_every=2, quickstart_steps=12, conversion_steps=4, isolate_stages=False,
                                  results=str(tmp_path / 'copy.json'))
    with pytest.raises(ConfigError, match='2 or more distinct seeds'):
        run_token_bench(replace(settings, seeds=(1, 1)))
    with pytest.raises(ConfigError, match='multiple of --eval-every'):
        run_token_bench(replace(settings, gqa_batches=7))
    results = run_token_bench(settings)
    runs = results['runs']
    assert [run['seed'] for run in runs['dha']] == [1, 2]

    for dha in runs['dha']:
        # Search (capped at 4 batches) and Fusion (at most 4) come before CT's first point, the baked model
        assert dha['search_tokens'] == 4 * BATCH_TOKENS and 1 <= dha['fusion_batches'] <= 4
        start = dha['search_tokens'] + dha['fusion_tokens']
        assert [x for x, _ in dha['points']] == [start + b * BATCH_TOKENS for b in (0, 2, 4)]
    gqa = runs['gqa']
    assert [x for x, _ in gqa[0]['points']] == [b * BATCH_TOKENS for b in (0, 2, 4, 6, 8)]
    # every seed starts from the same mean-pooled model, the quickstart's, at its loss; the seeds' batches differ
    pooled = json.loads((tmp_path / 'qs' / 'gqa_ct' / DONE_MARKER).read_text())['initial']['mean']
    assert all(math.isclose(run['points'][0][1], pooled, rel_tol=1e-5) for run in gqa)
    assert gqa[0]['points'][-1][1] != gqa[1]['points'][-1][1]
    assert all(run['points'][-1][1] < run['points'][0][1] for run in gqa)  # CT lowers the loss
    for healed in runs['healed_gqa']:
        # refit at 0 tokens, transfer after 2 batches, then KL's 2 more: CT's first point is the KL model
        xs = [x for x, _ in healed['points']]
        assert xs == [0, 2 * BATCH_TOKENS] + [4 * BATCH_TOKENS + b * BATCH_TOKENS for b in (0, 2, 4)]
        assert healed['points'][0][1] < pooled  # the refit alone improves on mean-pool

    # the summary is the curves' arithmetic: recomputed from the per-seed points it is the same
    again = summarise(runs, seed=1)
    assert again['tokens_to_reach_dha'] == results['tokens_to_reach_dha']
    first = results['curves']['gqa'][0]
    assert math.isclose(first['loss'], np.mean([run['points'][0][1] for run in gqa])) and first['ci95'] < 1e-5
    assert len(results['tokens_to_reach_dha']['gqa']) == len(results['curves']['dha']) == 3
    assert markdown_table(results).count('\n') == 2 + 3 - 1
    out = tmp_path / 'qs' / 'bench_tokens'
    assert json.loads((out / 'results.json').read_text()) == json.loads((tmp_path / 'copy.json').read_text())
    assert (out / 'tokens.png').stat().st_size > 10_000
