"""The family layer across every source family: mean-pooling and aligned GQA keep the family's own class and, where
lossless, its logits; a tiny healing chain, export, eval and plan run on each; refusals are one line; the support
matrix in docs/families.md is the family layer's."""

from __future__ import annotations

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
