"""`dha-train bench tokens` on a GQA source as `bench real` runs it: each arm's token axis is the tokens its stages
trained on, the curves start where their models do, seeds change the runs, and the summary is the curves' own
arithmetic. On the quickstart teacher: tests/commands/test_quickstart.py, which shares its short quickstart run."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dha_train.bench_settings import RealSettings
from dha_train.commands.bench.tokens import TokenBenchSettings, run_token_bench, summarise
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
    assert summarise(runs)['tokens_to_reach_dha'] == results['tokens_to_reach_dha']
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
