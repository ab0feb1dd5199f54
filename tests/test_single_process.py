"""One in-process training run with an offline W&B logger and full checkpoints: logging and HF export."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tiny_recipe, wandb_history_keys


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_root, tokenizer_dir):
    from dha_train.config import load_config
    from dha_train.train import train

    tmp = tmp_path_factory.mktemp('single')
    recipe = tiny_recipe(
        data_root, tokenizer_dir,
        max_duration='10ba',
        save_folder=str(tmp / 'ckpt'),
        save_interval='5ba',
        eval_loader={'root': '${variables.data_root}'},
        eval_interval='10ba',
        loggers={'wandb': {'project': 'dha-tests', 'mode': 'offline', 'dir': str(tmp)}},
    )
    trainer = train(load_config(recipe))
    yield tmp, trainer
    trainer.close()


def test_offline_wandb_run_has_the_logged_loss(trained):
    tmp, trainer = trained
    trainer.close()  # flushes and finishes the W&B run
    run_files = list((tmp / 'wandb').glob('offline-run-*/run-*.wandb'))
    assert len(run_files) == 1, list((tmp / 'wandb').rglob('*'))
    history = wandb_history_keys(run_files[0])
    losses = history.get('loss/train/total')
    assert losses is not None and len(losses) == 10, sorted(history)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    for domain in ('github', 'wikipedia'):
        assert math.isfinite(history[f'metrics/eval_{domain}/LanguageCrossEntropy'][-1])


def test_checkpoints_record_py_cpuinfos_cpu_model_read_without_its_process(trained):
    """Composer records the CPU's name in each checkpoint; the run read it from /proc/cpuinfo (no py-cpuinfo process
    at each rank's start), and it is the name py-cpuinfo gives."""
    import cpuinfo
    from composer.utils import collect_env

    from dha_train.export import load_composer_state

    tmp, _ = trained
    assert getattr(collect_env.get_cpu_model, 'reads_proc_cpuinfo', False)
    recorded = load_composer_state(tmp / 'ckpt')['state']['metadata']['composer_env_info']['cpu_model']
    assert recorded == cpuinfo.get_cpu_info()['brand_raw']


def test_export_gives_the_same_logits_as_the_composer_model(trained, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dha_train.export import export_hf

    tmp, trainer = trained
    out = export_hf(tmp / 'ckpt', tmp_path / 'hf')
    assert (out / 'model.safetensors').is_file() and (out / 'tokenizer.json').is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    composer_model = trainer.state.model.model.eval()
    with torch.no_grad():
        expected = composer_model(input_ids=ids).logits
        got = hf(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()

    # The export's card: one training stage with the tokens Composer counted and the run's name.
    from dha_train.methods import kv_cache_bytes
    from dha_train.model_card import read_model_card
    header, _ = read_model_card(out)
    stage = header['dha_train']['stages'][-1]
    assert stage['tokens'] == int(trainer.state.timestamp.token) > 0
    assert stage['recipe'] == trainer.state.run_name
    assert header['dha_train']['kv_bytes_per_4096_tokens_bf16'] == kv_cache_bytes(hf.config, 4096, 2)


def test_export_refuses_corrupted_or_missing_checkpoints(trained, tmp_path):
    from dha_train.export import CheckpointError, export_hf

    tmp, _ = trained
    real = (tmp / 'ckpt' / 'latest-rank0.pt').resolve()
    broken = tmp_path / 'broken.pt'
    broken.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    with pytest.raises(CheckpointError, match='corrupted or incomplete'):
        export_hf(broken, tmp_path / 'out')
    with pytest.raises(CheckpointError, match='not found'):
        export_hf(tmp_path / 'nowhere', tmp_path / 'out')
    assert not (tmp_path / 'out').exists()
    (tmp_path / 'taken').mkdir()
    (tmp_path / 'taken' / 'keep.txt').write_text('x')
    with pytest.raises(FileExistsError, match='--overwrite'):
        export_hf(tmp / 'ckpt', tmp_path / 'taken')
    assert (tmp_path / 'taken' / 'keep.txt').read_text() == 'x'
