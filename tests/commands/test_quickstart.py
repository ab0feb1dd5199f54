"""The quickstart pipeline end to end with a short pretrain, then a second run that reuses every stage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO


def _quickstart(out, *args):
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    return subprocess.run([sys.executable, '-m', 'dha_train.cli', 'quickstart', '--out', str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope='module')
def short_quickstart(tmp_path_factory):
    """A 12-step quickstart (4-batch conversions), run once for this file's tests: (its folder, the first run)."""
    out = tmp_path_factory.mktemp('quickstart') / 'qs'
    return out, _quickstart(out, '--steps', '12', '--conversion-steps', '4')


@pytest.mark.slow
def test_quickstart_short_run_then_reuse(short_quickstart, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, first = short_quickstart
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    summary = json.loads((out / 'summary.json').read_text())
    rows = summary['per_domain_val_loss']
    assert sorted(rows) == ['github', 'wikipedia']
    for row in rows.values():
        assert row['first_batch'] == 0 and row['final_batch'] == 12
        assert row['final_loss'] < row['first_loss']
    assert (out / 'loss_curve.png').stat().st_size > 10_000
    manifest = json.loads((out / 'data' / 'manifest.json').read_text())
    assert manifest['vocab_size'] == 4096 and manifest['seq_len'] == 256

    # The conversions at a 25% KV budget: DHA (Search -> Fusion -> CT) and mean-pool GQA with equal CT tokens.
    table = {row['model']: row for row in summary['conversions']['rows']}
    assert list(table) == ['MHA teacher', 'GQA at init (mean-pool)', 'GQA after CT', 'DHA after fusion (baked)',
                           'DHA after CT']
    mha_bytes = 4 * 8 * 24 * 2 * 256 * 2  # layers x heads x head dim x (K, V) x tokens x bf16 bytes
    assert table['MHA teacher']['kv_cache_bytes'] == mha_bytes
    assert all(table[name]['kv_cache_bytes'] * 4 == mha_bytes for name in list(table)[1:])
    assert table['GQA after CT']['train_tokens'] == 4 * 16 * 256  # as many CT tokens as DHA's CT
    assert sum(k + v for k, v in summary['conversions']['dha_kv_heads']) == 16
    for plot in summary['conversions']['plots']:
        assert Path(plot).stat().st_size > 10_000
    assert 'conversions at a 25% KV budget' in first.stdout

    model = AutoModelForCausalLM.from_pretrained(out / 'export' / 'hf', local_files_only=True)
    assert model.config.num_hidden_layers >= 4 and model.config.num_attention_heads >= 8
    assert model.config.num_key_value_heads == model.config.num_attention_heads  # an MHA teacher
    tokenizer = AutoTokenizer.from_pretrained(out / 'export' / 'hf', local_files_only=True)
    assert len(tokenizer) == 4096

    second = _quickstart(out, '--steps', '12', '--conversion-steps', '4')
    assert second.returncode == 0, second.stderr[-3000:]
    for stage in ('corpus', 'eval_task', 'tokenizer', 'data', 'pretrain', 'export', 'dha_search', 'dha_fusion',
                  'dha_ct', 'gqa_convert', 'gqa_ct'):
        assert f'{stage}: reusing finished stage' in second.stdout
    assert json.loads((out / 'summary.json').read_text())['per_domain_val_loss'] == rows

    # Healing on the quickstart teacher: launch/heal.sh refits its mean-pool GQA model, then attention transfer and
    # KL distillation, each a real `composer -n 1` FSDP2 run (heal.sh with 2 processes: test_deepseek_healing.py);
    # run again, every stage is found done.
    from helpers import launcher_env

    heal = ['bash', str(REPO / 'launch' / 'heal.sh'), str(out / 'export' / 'hf'), str(out / 'gqa_convert' / 'hf'),
            str(out / 'data'), str(tmp_path / 'heal'), '1', str(REPO / 'yamls' / 'healing' / 'tiny_transfer.yaml'),
            str(REPO / 'yamls' / 'healing' / 'tiny_kl.yaml'), 'variables.steps=4ba', 'save_interval=2ba',
            'global_train_batch_size=8', 'device_train_microbatch_size=4', 'console_log_interval=1ba']
    healed = subprocess.run(heal, capture_output=True, text=True, env=launcher_env(HEAL_NAME='qs'), cwd=REPO,
                            timeout=900)
    log = healed.stdout + healed.stderr
    assert healed.returncode == 0, log[-4000:]
    assert 'dha-train refit: wrote' in log and 'Train transfer/mse' in log and 'distill/kl' in log
    refit = json.loads((tmp_path / 'heal' / 'qs-refit' / 'refit.json').read_text())
    assert refit['mean_key_error_after'] < refit['mean_key_error_before']
    assert refit['mean_value_error_after'] < refit['mean_value_error_before']
    for stage in ('refit', 'transfer-hf', 'kl-hf'):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / 'heal' / f'qs-{stage}')
        assert type(model).__name__ == 'LlamaForCausalLM' and model.config.num_key_value_heads == 2
    again = subprocess.run(heal, capture_output=True, text=True, env=launcher_env(HEAL_NAME='qs'), cwd=REPO,
                           timeout=120)
    assert again.returncode == 0 and again.stdout.strip().endswith(f'heal: {tmp_path}/heal/qs-kl-hf')
    assert 'Train' not in again.stdout + again.stderr  # nothing trained twice


def test_quickstart_refuses_to_reuse_a_run_folder_made_with_other_settings(tmp_path):


    from dha_train.quickstart import run_quickstart

    (tmp_path / 'quickstart.json').write_text(json.dumps({'seed': 17, 'steps': 12, 'conversion_steps': 4}))
    with pytest.raises(ValueError, match='other settings'):
        run_quickstart(tmp_path, steps=12, conversion_steps=4, teacher=['model.config.hidden_size=256'])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['quickstart.json']  # nothing was run or overwritten


def test_quickstart_refuses_a_teacher_the_budget_cannot_split_before_training(tmp_path):


    from dha_train.quickstart import run_quickstart

    with pytest.raises(ValueError, match='6 heads'):
        run_quickstart(tmp_path / 'run', teacher=['model.config.num_attention_heads=6',
                                                  'model.config.num_key_value_heads=6'])
    assert not (tmp_path / 'run').exists()


BATCH_TOKENS = 16 * 256  # the tiny recipes' global batch x the quickstart's sequence length


@pytest.mark.slow
def test_bench_tokens_curves_on_the_short_quickstart_run(short_quickstart, tmp_path):
    """`dha-train bench tokens` on the quickstart teacher, the short run reused: each arm's token axis is the tokens
    its stages trained on, the curves start where their models do, seeds change the runs, and the summary is the
    curves' own arithmetic."""
    from dha_train.commands.bench.tokens import TokenBenchSettings, markdown_table, run_token_bench, summarise
    from dha_train.config import ConfigError
    from dha_train.stages import DONE_MARKER

    run = short_quickstart[0]
    settings = TokenBenchSettings(run=str(run), seeds=(1, 2), ct_batches=4, gqa_batches=8, heal_batches=2,
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
    pooled = json.loads((run / 'gqa_ct' / DONE_MARKER).read_text())['initial']['mean']
    assert all(math.isclose(run['points'][0][1], pooled, rel_tol=1e-5) for run in gqa)
    assert gqa[0]['points'][-1][1] != gqa[1]['points'][-1][1]
    assert all(run['points'][-1][1] < run['points'][0][1] for run in gqa)  # CT lowers the loss
    for healed in runs['healed_gqa']:
        # refit at 0 tokens, transfer after 2 batches, then KL's 2 more: CT's first point is the KL model
        xs = [x for x, _ in healed['points']]
        assert xs == [0, 2 * BATCH_TOKENS] + [4 * BATCH_TOKENS + b * BATCH_TOKENS for b in (0, 2, 4)]
        assert healed['points'][0][1] < pooled  # the refit alone improves on mean-pool

    # the summary is the curves' arithmetic: recomputed from the per-seed points it is the same
    again = summarise(runs)
    assert again['tokens_to_reach_dha'] == results['tokens_to_reach_dha']
    first = results['curves']['gqa'][0]
    assert math.isclose(first['loss'], np.mean([run['points'][0][1] for run in gqa])) and first['ci95'] < 1e-5
    assert len(results['tokens_to_reach_dha']['gqa']) == len(results['curves']['dha']) == 3
    assert markdown_table(results).count('\n') == 2 + 3 - 1
    out = run / 'bench_tokens'
    assert json.loads((out / 'results.json').read_text()) == json.loads((tmp_path / 'copy.json').read_text())
    assert (out / 'tokens.png').stat().st_size > 10_000
