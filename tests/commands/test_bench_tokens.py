"""`dha-train bench tokens` on a short quickstart run: each arm's token axis is the tokens its stages trained on,
the curves start where their models do, seeds change the runs, and the summary is the curves' own arithmetic."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from dha_train.bench_settings import RealSettings
from dha_train.commands.bench.tokens import TokenBenchSettings, markdown_table, run_token_bench, summarise
from dha_train.config import ConfigError
from dha_train.stages import DONE_MARKER
from helpers import SEQ_LEN, save_tiny_smollm2_shape

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


@pytest.mark.slow
def test_bench_tokens_on_a_gqa_source_at_two_thirds_runs_bench_reals_stages(tmp_path, tokenizer_dir, data_root):
    """The SmolLM2 arms on a tiny GQA source (9 query, 3 K/V heads): the Search chooses counts per layer at two
    thirds, each CT is evaluated on the held-out text from its start, and the token axes count every stage."""
    source = save_tiny_smollm2_shape(tmp_path / 'gqa', tokenizer_dir)
    text = tmp_path / 'text'
    text.mkdir()
    words = 'the cache holds keys and values for every head of every layer while the model decodes'.split()
    for index in range(6):
        rng = np.random.default_rng(index)
        (text / f'chapter{index}.txt').write_text(' '.join(rng.choice(words, 600)))
    batch_tokens = 2 * SEQ_LEN
    real = RealSettings(source=str(source), train_data=str(data_root), tokens=4 * batch_tokens, seq_len=SEQ_LEN,
                        batch=2, val_tokens=4 * SEQ_LEN, refit_tokens=2 * SEQ_LEN, search_batches=1)
    settings = TokenBenchSettings(teacher='smollm2', run=str(tmp_path / 'bench'), seeds=(1, 2), ct_batches=2,
                                  gqa_batches=4, heal_batches=1, eval_every=2, fusion_batches=2, text=str(text),
                                  text_tokens=4 * SEQ_LEN, device='cpu', real=real, isolate_stages=False)
    with pytest.raises(ConfigError, match='no held-out text'):
        run_token_bench(replace(settings, text=str(tmp_path / 'nothing-here')))
    with pytest.raises(ConfigError, match='--budget must be kv1 or kv2'):
        run_token_bench(replace(settings, budget='kv3'))
    results = run_token_bench(settings)
    assert results['kv_budget'] == pytest.approx(2 / 3) and results['fusion_cap_batches'] == 2
    runs = results['runs']
    for dha in runs['dha']:
        heads = [k + v for k, v in dha['kv_heads_per_layer']]
        assert sum(heads) == 2 * 2 * 2  # two thirds of 3 K + 3 V heads in each of the 2 layers
        assert dha['search_tokens'] == batch_tokens and 1 <= dha['fusion_batches'] <= 2
        start = dha['search_tokens'] + dha['fusion_tokens']
        assert [x for x, _ in dha['points']] == [start, start + 2 * batch_tokens]
    assert [x for x, _ in runs['gqa'][0]['points']] == [0, 2 * batch_tokens, 4 * batch_tokens]
    # both seeds start from the one mean-pooled model; their batches differ
    assert runs['gqa'][0]['points'][0][1] == pytest.approx(runs['gqa'][1]['points'][0][1], rel=1e-5)
    assert runs['gqa'][0]['points'][-1][1] != runs['gqa'][1]['points'][-1][1]
    for healed in runs['healed_gqa']:  # transfer and KL, a batch each, before CT's first point
        assert [x for x, _ in healed['points']] == [2 * batch_tokens, 4 * batch_tokens]
    assert summarise(runs, seed=1)['tokens_to_reach_dha'] == results['tokens_to_reach_dha']
    assert (tmp_path / 'bench' / 'bench_tokens_kv2' / 'tokens.png').is_file()
