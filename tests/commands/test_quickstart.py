"""The quickstart pipeline end to end with a short pretrain, then a second run that reuses every stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


def _quickstart(out, *args):
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    return subprocess.run([sys.executable, '-m', 'dha_train.cli', 'quickstart', '--out', str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_quickstart_short_run_then_reuse(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / 'qs'
    first = _quickstart(out, '--steps', '12', '--conversion-steps', '4')
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
