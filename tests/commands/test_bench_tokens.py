"""`dha-train bench tokens` on a GQA source as `bench real` runs it: each arm's token axis is the tokens its stages
trained on, the curves start where their models do, seeds change the runs, and the summary is the curves' own
arithmetic. On the quickstart teacher: tests/commands/test_quickstart.py, which shares its short quickstart run."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dha_train.bench_settings import RealSettings
from dha_train.commands.bench.tokens import TokenBenchSettings, run_token_bench
from dha_train.config import ConfigError
from helpers import SEQ_LEN, save_tiny_smollm2_shape


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
    # the summary from the recorded points by hand: each arm's mean over seeds at each point (t(1) = 12.706 for the
    # interval over 2 seeds), and at each DHA point the tokens where GQA's mean curve, linear between its points,
    # first reaches DHA's mean loss there
    for arm, per_seed in runs.items():
        losses = np.array([[y for _, y in run['points']] for run in per_seed])
        for point, summary in zip(losses.T, results['curves'][arm]):
            assert summary['loss'] == pytest.approx(point.mean(), abs=1e-12)
            assert summary['ci95'] == pytest.approx(12.706 * point.std(ddof=1) / np.sqrt(2), rel=1e-3)
    dha_tokens = np.mean([[x for x, _ in run['points']] for run in runs['dha']], axis=0)
    dha_losses = np.mean([[y for _, y in run['points']] for run in runs['dha']], axis=0)
    for arm in ('gqa', 'healed_gqa'):
        xs = np.array([x for x, _ in runs[arm][0]['points']], dtype=float)
        mean_curve = np.mean([[y for _, y in run['points']] for run in runs[arm]], axis=0)
        for tokens, loss, reach in zip(dha_tokens, dha_losses, results['tokens_to_reach_dha'][arm]):
            assert (reach['tokens'], reach['loss']) == (pytest.approx(tokens), pytest.approx(loss, abs=1e-12))
            at_or_below = np.flatnonzero(mean_curve <= loss)
            if not at_or_below.size:
                assert reach['other_tokens_needed'] is None and reach['ratio'] is None
                continue
            first = at_or_below[0]
            needed = xs[0] if first == 0 else xs[first - 1] + (xs[first] - xs[first - 1]) * (
                (mean_curve[first - 1] - loss) / (mean_curve[first - 1] - mean_curve[first]))
            assert reach['other_tokens_needed'] == pytest.approx(needed, rel=1e-9)
            assert reach['ratio'] == pytest.approx(needed / tokens, rel=1e-9)
    assert (tmp_path / 'bench' / 'bench_tokens_kv2' / 'tokens.png').is_file()


def test_a_setting_of_the_other_teacher_is_refused_not_ignored():
    from dha_train.commands.bench.tokens import resolve

    with pytest.raises(ConfigError, match='--budget, --text do not apply to --teacher quickstart'):
        resolve(TokenBenchSettings(budget='kv1', text='/somewhere'))
    with pytest.raises(ConfigError, match='--conversion-steps do not apply to --teacher smollm2'):
        resolve(TokenBenchSettings(teacher='smollm2', conversion_steps=4))
    with pytest.raises(ConfigError, match="--teacher must be one of quickstart, smollm2, got 'llama'"):
        resolve(TokenBenchSettings(teacher='llama'))
    filled = resolve(TokenBenchSettings(teacher='smollm2'))
    assert (filled.run, filled.budget, filled.gqa_batches, filled.text_tokens) == ('bench_real', 'kv2', 16, 8192)
    assert resolve(TokenBenchSettings()).text_tokens is None  # the quickstart scores its own validation split


def test_the_summary_is_the_seeds_mean_curves_and_where_gqas_first_reaches_dhas_mean_loss():
    """Two seeds an arm whose answers are known: DHA's means are 3.1 at 105 tokens and 2.1 at 205; mean-pool's mean
    curve (4.1, 3.5, 2.5, 1.5 at 0, 100, 200, 300) crosses 3.1 at 100 + 0.4 x 100 = 140 and 2.1 at 240; the healed
    arm stays at 5 and never reaches either."""
    from dha_train.commands.bench.tokens import summarise

    def arm(points_per_seed):
        return [{'seed': seed, 'points': points} for seed, points in enumerate(points_per_seed)]

    runs = {'dha': arm([[(100, 3.0), (200, 2.0)], [(110, 3.2), (210, 2.2)]]),
            'gqa': arm([[(0, 4.0), (100, 3.4), (200, 2.4), (300, 1.4)], [(0, 4.2), (100, 3.6), (200, 2.6), (300, 1.6)]]),
            'healed_gqa': arm([[(0, 5.0), (300, 5.0)], [(0, 5.0), (300, 5.0)]])}
    summary = summarise(runs)
    # two seeds 0.2 apart: sd 0.1414, t(1) 12.706, half-width 12.706 x 0.1414 / sqrt(2) = 1.2706
    assert [(p['tokens'], p['tokens_range'], p['loss'], p['ci95']) for p in summary['curves']['dha']] == [
        (105, [100, 110], pytest.approx(3.1), pytest.approx(1.2706, abs=1e-4)),
        (205, [200, 210], pytest.approx(2.1), pytest.approx(1.2706, abs=1e-4))]
    reach = summary['tokens_to_reach_dha']
    assert [(r['other_tokens_needed'], r['ratio']) for r in reach['gqa']] == [
        (pytest.approx(140), pytest.approx(140 / 105)), (pytest.approx(240), pytest.approx(240 / 205))]
    assert [(r['other_tokens_needed'], r['ratio']) for r in reach['healed_gqa']] == [(None, None)] * 2
