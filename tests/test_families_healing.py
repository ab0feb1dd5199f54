"""MoH and healing across every source family: the MoH model is the source family's decoder with MoH attention (the
source's logits when every head is kept, through the surgery and the model class, across a save and a load), and the
healing steps take each family: refit keeps a lossless conversion lossless and brings a lossy one closer (biases and
q/k norms carried), attention transfer of the source itself costs 0 (Gemma's local/global RoPE and sliding windows
included), and a tiny transfer + KL chain runs on a Qwen2 and a Gemma 3 source in the family's own class."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from family_models import FAMILY_NAMES, logits_of, save_tiny_family_model, tiny_model

from dha_train import families
from dha_train.algorithms.attention_transfer import SOURCE_MODULE, AttentionTransfer
from dha_train.algorithms.mixture_of_heads import MixtureOfHeads
from dha_train.cli import main
from dha_train.model_folders import load_causal_lm
from dha_train.models.modeling_moh import MohLlamaAttention, MohLlamaConfig, MohLlamaForCausalLM
from helpers import tiny_recipe


def _all_heads(model_type: str) -> MixtureOfHeads:
    """query_norm routing that keeps every head (all shared): the MoH model computes the source's function."""
    return MixtureOfHeads(router='query_norm', shared_heads=tiny_model(model_type).config.num_attention_heads, top_k=0)


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_moh_surgery_keeping_every_head_is_the_source_in_its_family_decoder(model_type):
    source = tiny_model(model_type)
    model = copy.deepcopy(source)
    _all_heads(model_type).apply_surgery(model)
    family = families.get(model_type)
    for layer, source_layer in zip(model.model.layers, source.model.layers):
        attention = layer.self_attn
        assert isinstance(attention, MohLlamaAttention) and isinstance(attention, family.classes.attention)
        assert type(layer) is family.classes.decoder_layer
        assert attention.scaling == source_layer.self_attn.scaling
        assert attention.sliding_window == getattr(source_layer.self_attn, 'sliding_window',
                                                   getattr(source.config, 'sliding_window', None))
        for name, tensor in source_layer.self_attn.state_dict().items():  # biases and q/k norms kept
            assert torch.equal(attention.state_dict()[name], tensor), name
    torch.testing.assert_close(logits_of(model.eval()), logits_of(source), rtol=0, atol=1e-5)


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_moh_model_of_a_family_round_trips_through_save_and_load(tmp_path, model_type):
    """A learned-router MoH run's weights under the MoH class of the family (``from_source``): the same function,
    saved and loaded back (the folder names the family; the family's config fields survive the reload)."""
    import dha_train.models  # noqa: F401  (registers moh_llama)

    source = tiny_model(model_type)
    trained = copy.deepcopy(source)
    MixtureOfHeads(router='learned', shared_heads=2, top_k=1).apply_surgery(trained, seed=3)
    config = MohLlamaConfig.from_source(trained.config)
    assert config.source_model_type == model_type
    model = MohLlamaForCausalLM(config).eval()
    model.load_state_dict(trained.state_dict())
    assert type(model.model) is families.get(model_type).classes.model
    expected = logits_of(trained.eval())
    torch.testing.assert_close(logits_of(model), expected, rtol=0, atol=1e-6)
    model.save_pretrained(tmp_path / 'moh')
    saved = json.loads((tmp_path / 'moh' / 'config.json').read_text())
    assert saved['model_type'] == 'moh_llama' and saved['source_model_type'] == model_type
    loaded = load_causal_lm(tmp_path / 'moh', who='test', torch_dtype=torch.float32).eval()
    assert type(loaded) is MohLlamaForCausalLM and type(loaded.model) is type(model.model)
    for key, value in source.config.to_dict().items():
        if key not in ('model_type', 'architectures', 'transformers_version', 'torch_dtype', '_name_or_path',
                       'head_dim'):
            assert getattr(loaded.config, key) == value, key
    assert families.head_dim(loaded.config) == families.head_dim(source.config)  # Mistral's None is LLaMA's 16
    torch.testing.assert_close(logits_of(loaded), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_moh_export_of_a_family_run_is_the_moh_class_of_that_family(model_type):
    """What `dha-train export` does with a MoH checkpoint (``methods.export_model``): the MoH class on the run's
    source family, computing what the run computed."""
    from dha_train.methods import export_model

    trained = tiny_model(model_type)
    MixtureOfHeads(router='learned', shared_heads=2, top_k=1).apply_surgery(trained, seed=3)
    config, weights = export_model(trained.config, trained.state_dict())
    assert config.model_type == 'moh_llama' and families.source_model_type(config) == model_type
    model = MohLlamaForCausalLM(config).eval()
    model.load_state_dict(weights)
    torch.testing.assert_close(logits_of(model), logits_of(trained.eval()), rtol=0, atol=1e-6)


def test_moh_model_of_a_soft_capped_gemma_caps_its_logits_as_gemma_does():
    source = tiny_model('gemma3_text', final_logit_softcapping=2.0)
    model = MohLlamaForCausalLM(MohLlamaConfig.from_source(source.config, moh_shared_heads=4, moh_top_k=0)).eval()
    model.load_state_dict(source.state_dict())
    logits = logits_of(model)
    assert float(logits.abs().max()) <= 2.0
    torch.testing.assert_close(logits, logits_of(source), rtol=0, atol=1e-5)


@pytest.mark.parametrize('model_type', ['qwen2', 'gemma3_text'])
def test_moh_sparse_decode_equals_dense_decode_with_biases_and_sliding_windows(model_type):
    """Gemma's window (6) is shorter than the prompt: a sliding layer skips heads only over its windowed mask."""
    source = tiny_model(model_type)
    model = MohLlamaForCausalLM(MohLlamaConfig.from_source(source.config, moh_shared_heads=1, moh_top_k=1)).eval()
    model.load_state_dict(source.state_dict(), strict=False)
    for layer in model.model.layers:
        layer.self_attn.decode_merge_elements = 0  # skip every inactive head
    prompt = torch.randint(0, source.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    outputs = []
    for sparse in (False, True):
        for layer in model.model.layers:
            layer.self_attn.sparse_decode = sparse
        outputs.append(model.generate(prompt, **settings))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    for dense, sparse in zip(outputs[0].logits, outputs[1].logits):
        torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-4)


# --- healing -------------------------------------------------------------------------------------------------------


def _refit(tmp_path, data_root, model_type: str, copies: int):
    source = tiny_model(model_type, copies=copies)
    source.save_pretrained(tmp_path / 'source')
    assert main(['convert', str(tmp_path / 'source'), str(tmp_path / 'pooled'), '--kv-heads', '2']) == 0
    assert main(['refit', str(tmp_path / 'source'), str(tmp_path / 'pooled'), str(tmp_path / 'refit'),
                 '--data', str(data_root), '--tokens', '512', '--batch-size', '4']) == 0
    pooled, refit = (load_causal_lm(tmp_path / name, who='test', torch_dtype=torch.float32).eval()
                     for name in ('pooled', 'refit'))
    assert type(refit) is families.get(model_type).causal_lm_class
    return source, pooled, refit, json.loads((tmp_path / 'refit' / 'refit.json').read_text())


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_refit_of_a_lossless_conversion_stays_lossless(tmp_path, data_root, model_type):
    source, _, refit, report = _refit(tmp_path, data_root, model_type, copies=2)
    torch.testing.assert_close(logits_of(refit), logits_of(source), rtol=0, atol=1e-4)
    assert report['mean_key_error_after'] < 1e-8 and report['mean_value_error_after'] < 1e-8


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_refit_of_a_lossy_conversion_comes_closer_to_the_source_keeping_biases_and_norms(tmp_path, data_root,
                                                                                        model_type):
    source, pooled, refit, report = _refit(tmp_path, data_root, model_type, copies=1)
    reference = logits_of(source)
    before = (logits_of(pooled) - reference).pow(2).mean()
    after = (logits_of(refit) - reference).pow(2).mean()
    assert after < 0.9 * before, (float(before), float(after))
    assert report['mean_value_error_after'] < 0.5 * report['mean_value_error_before']
    assert report['mean_key_error_after'] <= report['mean_key_error_before'] + 1e-9
    biased = families.get(model_type).biased_projections(source.config)
    for layer, pooled_layer in zip(refit.model.layers, pooled.model.layers):
        attention, start = layer.self_attn, pooled_layer.self_attn
        for name in ('k_proj', 'v_proj'):
            assert (getattr(attention, name).bias is not None) == (name in biased)
            if name in biased:  # refitted, not copied
                assert not torch.equal(getattr(attention, name).bias, getattr(start, name).bias)
        for norm in ('q_norm', 'k_norm'):  # the family's norms are kept as converted
            if hasattr(start, norm):
                assert torch.equal(getattr(attention, norm).weight, getattr(start, norm).weight)


def test_refit_refuses_a_converted_folder_of_another_family_in_one_line(tmp_path, data_root, capfd):
    from helpers import refused_in_one_line

    save_tiny_family_model(tmp_path / 'qwen2', 'qwen2')
    save_tiny_family_model(tmp_path / 'llama', 'llama', copies=2)
    assert main(['convert', str(tmp_path / 'llama'), str(tmp_path / 'pooled'), '--kv-heads', '2']) == 0
    line = refused_in_one_line(['refit', str(tmp_path / 'qwen2'), str(tmp_path / 'pooled'), str(tmp_path / 'out'),
                                '--data', str(data_root)], tmp_path, capfd)
    assert 'built on llama' in line and 'qwen2' in line, line


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_attention_transfer_of_the_source_itself_costs_nothing(tmp_path, model_type):
    """The frozen source attention is the family's own (biases, q/k norms, scale), fed the layer's own position
    embeddings and mask (Gemma's local/global RoPE, its window of 6 under a 12-token input): against an identical
    student every layer's MSE is 0 and the stream is the source's."""
    source = tiny_model(model_type)
    source.save_pretrained(tmp_path / 'source')
    student = copy.deepcopy(source)
    AttentionTransfer(str(tmp_path / 'source'))._install(SimpleNamespace(model=student))
    family = families.get(model_type)
    assert all(type(getattr(layer, SOURCE_MODULE)) is family.classes.attention for layer in student.model.layers)
    torch.testing.assert_close(logits_of(student), logits_of(source), rtol=0, atol=1e-5)
    errors = torch.stack([getattr(layer, SOURCE_MODULE).transfer_mse for layer in student.model.layers])
    assert float(errors.abs().max()) < 1e-10, errors


def test_attention_transfer_refuses_a_source_of_another_family(tmp_path):
    from dha_train.config import ConfigError

    save_tiny_family_model(tmp_path / 'source', 'qwen3')
    with pytest.raises(ConfigError, match='built on gemma3_text, the source is a qwen3 model'):
        AttentionTransfer(str(tmp_path / 'source'))._install(SimpleNamespace(model=tiny_model('gemma3_text')))


def _stage(tmp_path, data_root, tokenizer_dir, name: str, model_path, algorithms: dict):
    """One 2-batch single-process healing stage from ``model_path``, exported to ``<name>-hf``."""
    from dha_train.config import load_config
    from dha_train.export import export_hf
    from dha_train.train import close_trainer, train

    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='2ba', global_train_batch_size=4,
                         device_train_microbatch_size=4, save_folder=str(tmp_path / name), save_interval='2ba',
                         algorithms=algorithms, optimizer={'lr': 1.0e-3, 'weight_decay': 0.0},
                         scheduler={'t_warmup': '0ba'})  # (any warmup of these 2 batches trains at lr 0)
    recipe['model'] = {'pretrained_path': str(model_path)}
    close_trainer(train(load_config(recipe)))
    return export_hf(tmp_path / name, tmp_path / f'{name}-hf')


@pytest.mark.parametrize('model_type', ['qwen2', 'gemma3_text'])
def test_a_tiny_healing_chain_runs_on_the_family_in_its_own_class(tmp_path, data_root, tokenizer_dir, model_type):
    """convert -> refit -> attention transfer (2 batches) -> KL distillation from the source (2 batches): each
    stage's folder is the family's own class; transfer trains the attention alone."""
    from safetensors.torch import load_file

    source = save_tiny_family_model(tmp_path / 'source', model_type, tokenizer_dir)
    assert main(['convert', str(source), str(tmp_path / 'pooled'), '--kv-heads', '2']) == 0
    assert main(['refit', str(source), str(tmp_path / 'pooled'), str(tmp_path / 'refit'), '--data', str(data_root),
                 '--tokens', '512', '--batch-size', '4']) == 0
    transfer = _stage(tmp_path, data_root, tokenizer_dir, 'transfer', tmp_path / 'refit',
                         {'attention_transfer': {'source_path': str(source)}})
    before, after = load_file(tmp_path / 'refit' / 'model.safetensors'), load_file(transfer / 'model.safetensors')
    assert before.keys() == after.keys()  # the frozen source attention is not exported
    changed = {name for name, tensor in before.items() if not torch.equal(tensor, after[name])}
    assert changed and all('.self_attn.' in name for name in changed), sorted(changed)
    assert any(name.endswith('k_proj.bias') for name in changed) == (model_type == 'qwen2')
    healed = _stage(tmp_path, data_root, tokenizer_dir, 'kl', transfer,
                       {'distillation': {'teacher_path': str(source), 'trainable': 'attention'}})
    family = families.get(model_type)
    for folder in (tmp_path / 'refit', transfer, healed):
        model = load_causal_lm(folder, who='test', torch_dtype=torch.float32).eval()
        assert type(model) is family.causal_lm_class and model.config.num_key_value_heads == 2
        assert torch.isfinite(logits_of(model)).all()


@pytest.mark.slow
def test_moh_exports_of_every_family_load_and_generate_alike_in_transformers_5(tmp_path, tokenizer_dir):
    """The MoH folder of each non-LLaMA family (LLaMA's: tests/commands/test_export_transformers5.py), loaded with
    ``trust_remote_code`` in transformers 5.x without dha_train: the same logits, attention weights and greedy
    generations as here (its modeling file, family_classes.py and moh_decode.py travel with the folder)."""
    import importlib.util
    import os
    import subprocess

    from transformers import AutoTokenizer

    import export_probe
    from helpers import REPO

    spec = importlib.util.spec_from_file_location(
        'transformers5_env', REPO / 'tests' / 'commands' / 'test_export_transformers5.py')
    environment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(environment)
    python = environment.transformers5_python()
    folders = {}
    for model_type in FAMILY_NAMES[1:]:
        source = tiny_model(model_type)
        MixtureOfHeads(router='learned', shared_heads=1, top_k=2).apply_surgery(source, seed=5)
        model = MohLlamaForCausalLM(MohLlamaConfig.from_source(source.config)).eval()
        model.load_state_dict(source.state_dict())
        folders[model_type] = tmp_path / model_type
        model.save_pretrained(folders[model_type])
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folders[model_type])
    env = {key: value for key, value in os.environ.items() if key not in ('PYTHONPATH', 'PYTHONHOME')}
    env.update(PYTHONNOUSERSITE='1', HF_HOME=str(tmp_path / 'hf_home'), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1',
               OMP_NUM_THREADS='1')
    out = tmp_path / 'transformers5.pt'
    done = subprocess.run([python, export_probe.__file__, json.dumps({k: str(v) for k, v in folders.items()}),
                           json.dumps(environment.PROMPTS), str(environment.NEW_TOKENS), str(out)],
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    theirs_all = torch.load(out, weights_only=False)
    assert theirs_all.pop('environment')['transformers'].startswith('5.')
    for name, folder in folders.items():
        ours, theirs = export_probe.probe(str(folder), environment.PROMPTS, environment.NEW_TOKENS), theirs_all[name]
        assert theirs['model_class'].startswith('transformers_modules.'), theirs['model_class']
        torch.testing.assert_close(theirs['logits'], ours['logits'], rtol=0, atol=1e-4, msg=name)
        for got, expected in zip(theirs['attentions'], ours['attentions'], strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=name)
        assert torch.equal(theirs['sequences'], ours['sequences']), name
        assert torch.equal(ours['sequences'], ours['argmax_sequences']), name
        assert theirs['cache_heads'] == ours['cache_heads'], name
