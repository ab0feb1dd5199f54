"""The family layer across every source family: mean-pooling and aligned GQA keep the family's own class and, where
lossless, its logits; a tiny healing chain, export, eval and plan run on each; refusals are one line; the support
matrix in docs/families.md is the family layer's."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import FAMILY_NAMES, logits_of, save_tiny_family_model, tiny_model

from dha_train import families
from dha_train.cli import main
from dha_train.model_folders import load_causal_lm
from helpers import refused_in_one_line


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_mean_pool_of_copied_heads_is_the_source_in_its_own_class(tmp_path, model_type, tokenizer_dir):
    source = tiny_model(model_type, copies=2)
    source.save_pretrained(tmp_path / 'source')
    assert main(['convert', str(tmp_path / 'source'), str(tmp_path / 'pooled'), '--kv-heads', '2']) == 0
    pooled = load_causal_lm(tmp_path / 'pooled', who='test').float().eval()
    assert type(pooled) is families.get(model_type).causal_lm_class
    assert pooled.config.num_key_value_heads == 2
    torch.testing.assert_close(logits_of(pooled), logits_of(source), rtol=0, atol=1e-5)
    card = (tmp_path / 'pooled' / 'README.md').read_text()
    assert f"{families.get(model_type).label} family" in card


def test_a_family_the_project_does_not_support_is_refused_naming_the_supported_ones(tmp_path, capfd):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / 'gpt2')
    line = refused_in_one_line(['convert', str(tmp_path / 'gpt2'), str(tmp_path / 'out'), '--kv-heads', '1'],
                               tmp_path, capfd)
    assert "'gpt2'" in line and all(name in line for name in FAMILY_NAMES), line


ALIGNABLE = [name for name in FAMILY_NAMES if families.get(name).refusal('aligned_gqa') is None]
NOT_ALIGNABLE = [name for name in FAMILY_NAMES if name not in ALIGNABLE]


@pytest.mark.parametrize('model_type', ALIGNABLE)
def test_aligned_gqa_fold_and_permute_keep_the_source_function_and_class(tmp_path, model_type, data_root):
    from dha_train.conversion.align import AlignSettings, run_align

    source = tiny_model(model_type)
    source.save_pretrained(tmp_path / 'source')
    run_align(tmp_path / 'source', tmp_path / 'aligned', AlignSettings(num_groups=2, data=str(data_root), tokens=512,
                                                                       batch_size=4))
    aligned = load_causal_lm(tmp_path / 'aligned', who='test').float().eval()
    assert type(aligned) is type(source)
    torch.testing.assert_close(logits_of(aligned), logits_of(source), rtol=0, atol=1e-4)


@pytest.mark.parametrize('model_type', NOT_ALIGNABLE)
def test_aligned_gqa_refuses_per_head_norms_in_one_line(tmp_path, model_type, data_root, capfd):
    save_tiny_family_model(tmp_path / 'source', model_type)
    line = refused_in_one_line(['align', str(tmp_path / 'source'), str(tmp_path / 'aligned'), '--num-groups', '2',
                                '--data', str(data_root)], tmp_path, capfd)
    assert 'aligned_gqa cannot carry' in line and 'q/k norms' in line, line


@pytest.mark.parametrize('model_type', ALIGNABLE)
def test_aligned_gqa_transfer_with_closed_gates_exports_the_group_heads_in_the_family_class(model_type):
    """KVHeadTransfer's surgery, gates frozen at 0: the model is its group heads (biases too); the export is the
    family's own GQA class computing the same."""
    from dha_train.algorithms.kv_head_transfer import KVHeadTransfer
    from dha_train.methods import export_model

    model = tiny_model(model_type)
    algorithm = KVHeadTransfer(num_groups=2)
    algorithm.apply_surgery(model)
    with torch.no_grad():
        for projection in algorithm.projections:
            projection.group_weight.normal_()
            if projection.group_bias is not None:
                projection.group_bias.normal_()
            projection.freeze(projection.log_alpha, close=True)
    config, weights = export_model(model.config, model.state_dict())
    exported = families.get(model_type).causal_lm_class(config).eval()
    exported.load_state_dict(weights)
    assert exported.config.num_key_value_heads == 2
    torch.testing.assert_close(logits_of(exported), logits_of(model.eval()), rtol=0, atol=1e-5)


@pytest.fixture(scope='module')
def healed(tmp_path_factory, data_root, tokenizer_dir):
    """Per family: a source, its mean-pool to 2 K/V heads, 4 batches of KL healing from the source in-process (the
    tiny healing recipe), the export of that checkpoint, and the held-out losses before and after."""
    from dha_train.config import load_config
    from dha_train.train import train
    from helpers import REPO

    runs = {}
    for model_type in FAMILY_NAMES:
        root = tmp_path_factory.mktemp(f'heal-{model_type}')
        save_tiny_family_model(root / 'source', model_type, tokenizer_dir)
        assert main(['convert', str(root / 'source'), str(root / 'pooled'), '--kv-heads', '2']) == 0
        overrides = [f'variables.model_path={root / "pooled"}', f'variables.source_path={root / "source"}',
                     f'variables.data_root={data_root}', f'variables.save_root={root}', 'variables.steps=4ba',
                     'variables.lr=3e-3', 'fsdp=null', 'global_train_batch_size=4', 'device_train_microbatch_size=4',
                     'device_eval_batch_size=4', 'save_interval=4ba', 'eval_loader.subset_num_batches=2']
        trainer = train(load_config(REPO / 'yamls' / 'healing' / 'tiny_kl.yaml', overrides))
        trainer.close()
        assert main(['export', str(root / 'tiny-kl'), str(root / 'healed')]) == 0
        runs[model_type] = root
    return runs


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_a_healed_export_of_each_family_is_its_own_class_and_trained(healed, model_type):
    root = healed[model_type]
    exported = load_causal_lm(root / 'healed', who='test').float().eval()
    pooled = load_causal_lm(root / 'pooled', who='test').float().eval()
    assert type(exported) is families.get(model_type).causal_lm_class
    assert exported.config.num_key_value_heads == 2
    moved = [name for name, value in exported.state_dict().items()
             if not torch.equal(value, pooled.state_dict()[name])]
    assert moved and all('self_attn' in name for name in moved), moved  # healing trains the attention alone
    header = (root / 'healed' / 'README.md').read_text()
    assert f'{families.get(model_type).label} family' in header


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_eval_and_plan_run_on_each_family(healed, model_type, data_root, tmp_path, capsys):
    from helpers import REPO

    root = healed[model_type]
    assert main(['eval', str(root / 'healed'), '--tasks', 'arc_easy', '--limit', '4', '--data', str(data_root),
                 '--out', str(tmp_path / 'eval')]) == 0
    results = json.loads((tmp_path / 'eval' / 'eval_results.json').read_text())
    assert 0.0 <= results['scores']['arc_easy']['acc'] <= 1.0
    capsys.readouterr()
    assert main(['plan', str(REPO / 'yamls' / 'healing' / 'tiny_kl.yaml'), f'variables.model_path={root / "healed"}',
                 f'variables.source_path={root / "source"}', f'variables.data_root={data_root}',
                 f'variables.save_root={tmp_path}', '--world-size', '2', '--json']) == 0
    plan = json.loads(capsys.readouterr().out)
    student = load_causal_lm(root / 'healed', who='test')
    # every parameter of the family's model is planned for (tied embeddings are counted once per use there)
    assert plan['parameters'] >= sum(p.numel() for p in student.parameters()) and plan['layers'] == 2, plan
    assert plan['peak_gib'] > 0, plan


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_an_mla_folders_stated_kv_bytes_are_what_its_cache_holds(tmp_path, model_type, capfd):
    """The registry's KV bytes of an MLA folder (cards, bench tables) count what the model caches, the key scales of
    a k_norm family included (``convert`` reports the same numbers)."""
    from dha_train.methods import kv_cache_bytes
    from dha_train.model_folders import load_model_config

    save_tiny_family_model(tmp_path / 'source', model_type)
    assert main(['convert', str(tmp_path / 'source'), str(tmp_path / 'mla'), '--method', 'mla',
                 '--cache-fraction', '0.5', '--pair-criterion', 'uniform', '--factorisation', 'weight']) == 0
    reported = [line for line in capfd.readouterr().out.splitlines() if 'cache numbers per token' in line]
    numbers = int(reported[0].split(' cache numbers per token')[0].rsplit(' ', 1)[1])
    config = load_model_config(tmp_path / 'mla', who='test')
    assert kv_cache_bytes(config, seq_len=1, bytes_per_value=1) == numbers
