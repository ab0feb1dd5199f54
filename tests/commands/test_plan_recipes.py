"""Every shipped 7B/8B-scale recipe plans and fits at the world size and GPU docs/planning.md states for it (8 x A100-80G),
each from config-only folders of the real models' shapes (no weights, no data), as a user plans before a download.

The converted folders a recipe starts from (a GQA, DHA or MLA export, a Fusion head map) are written with the shapes
the conversion gives at the recipe's budget; a DHA map is uniform over the layers here (a searched one differs per
layer, which the plan counts layer by layer). Also: a deep model's extrapolation from its first 3 and 4 layers equals
tracking every layer, for a uniform model and for one whose layers differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

LLAMA = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'tie_word_embeddings': False,
         'rms_norm_eps': 1e-5, 'hidden_act': 'silu'}
LLAMA2_7B = {**LLAMA, 'hidden_size': 4096, 'intermediate_size': 11008, 'num_hidden_layers': 32,
             'num_attention_heads': 32, 'num_key_value_heads': 32, 'vocab_size': 32000,
             'max_position_embeddings': 4096}
SHEARED_1_3B = {**LLAMA, 'hidden_size': 2048, 'intermediate_size': 5504, 'num_hidden_layers': 24,
                'num_attention_heads': 16, 'num_key_value_heads': 16, 'vocab_size': 32000,
                'max_position_embeddings': 4096}
SHEARED_2_7B = {**LLAMA, 'hidden_size': 2560, 'intermediate_size': 6912, 'num_hidden_layers': 32,
                'num_attention_heads': 20, 'num_key_value_heads': 20, 'vocab_size': 32000,
                'max_position_embeddings': 4096}
LLAMA3_8B = {**LLAMA, 'hidden_size': 4096, 'intermediate_size': 14336, 'num_hidden_layers': 32,
             'num_attention_heads': 32, 'num_key_value_heads': 8, 'vocab_size': 128256,
             'max_position_embeddings': 8192, 'rope_theta': 500000.0}


def _uniform_head_map(config: dict, groups: int) -> dict:
    """Every layer's key and value heads in ``groups`` contiguous groups (a 25% budget of an MHA model at H/4)."""
    heads = config['num_attention_heads']
    mapping = [head * groups // heads for head in range(heads)]
    return {'head_dim': config['hidden_size'] // heads, 'num_query_heads': heads,
            'layers': [{'key': mapping, 'value': mapping}] * config['num_hidden_layers']}


def _mla(config: dict, cache_fraction: float, rope_pairs: int = 4) -> dict:
    """The MLA export's config at ``cache_fraction`` of the source's K/V cache, uniform ranks (`--ranks uniform`)."""
    layers, kv_heads = config['num_hidden_layers'], config['num_key_value_heads']
    head_dim = config['hidden_size'] // config['num_attention_heads']
    latent = int(cache_fraction * layers * 2 * kv_heads * head_dim) - layers * kv_heads * 2 * rope_pairs
    return {**config, 'architectures': ['MlaLlamaForCausalLM'], 'model_type': 'mla_llama',
            'mla_ranks': [latent // layers] * layers,
            'mla_rope_pairs': [[list(range(rope_pairs))] * kv_heads] * layers}


def _dha(config: dict, groups: int) -> dict:
    return {**config, 'architectures': ['DhaLlamaForCausalLM'], 'model_type': 'dha_llama',
            'head_map': _uniform_head_map(config, groups)}


FOLDERS = {
    'llama2-7b': LLAMA2_7B, 'llama2-7b-gqa8': {**LLAMA2_7B, 'num_key_value_heads': 8},
    'llama2-7b-dha25': _dha(LLAMA2_7B, 8), 'llama2-7b-mla25': _mla(LLAMA2_7B, 0.25),
    'sheared-1.3b': SHEARED_1_3B, 'sheared-1.3b-gqa4': {**SHEARED_1_3B, 'num_key_value_heads': 4},
    'sheared-1.3b-dha25': _dha(SHEARED_1_3B, 4),
    'sheared-2.7b': SHEARED_2_7B, 'sheared-2.7b-dha25': _dha(SHEARED_2_7B, 5),
    'llama3-8b': LLAMA3_8B, 'llama3-8b-gqa2': {**LLAMA3_8B, 'num_key_value_heads': 2},
    'llama3-8b-mla33': _mla(LLAMA3_8B, 1 / 3),
}
HEAD_MAPS = {'llama2-7b': _uniform_head_map(LLAMA2_7B, 8), 'sheared-1.3b': _uniform_head_map(SHEARED_1_3B, 4),
             'sheared-2.7b': _uniform_head_map(SHEARED_2_7B, 5)}

# recipe -> (variables naming the folders above, the training sequence of the recipe's data)
RECIPES = {
    'pretrain/llama2_7b_cpt.yaml': ({'model_path': 'llama2-7b'}, None),
    'gqa/llama2_7b_ct.yaml': ({'model_path': 'llama2-7b-gqa8'}, None),
    'gqa/sheared_llama_1.3b_ct.yaml': ({'model_path': 'sheared-1.3b-gqa4'}, None),
    'asym_gqa/llama2-7b/ct.yaml': ({'model_path': 'llama2-7b-gqa8'}, None),
    'aligned_gqa/llama2-7b/prune.yaml': ({'model_path': 'llama2-7b', 'teacher_path': 'llama2-7b'}, 2048),
    'aligned_gqa/sheared-llama-1.3b/prune.yaml': ({'model_path': 'sheared-1.3b', 'teacher_path': 'sheared-1.3b'},
                                                  2048),
    'dha/llama2-7b/search.yaml': ({'model_path': 'llama2-7b'}, None),
    'dha/llama2-7b/fusion.yaml': ({'model_path': 'llama2-7b', 'head_map': 'map:llama2-7b'}, None),
    'dha/llama2-7b/ct.yaml': ({'model_path': 'llama2-7b-dha25'}, None),
    'dha/sheared-llama-1.3b/search.yaml': ({'model_path': 'sheared-1.3b'}, None),
    'dha/sheared-llama-1.3b/fusion.yaml': ({'model_path': 'sheared-1.3b', 'head_map': 'map:sheared-1.3b'}, None),
    'dha/sheared-llama-1.3b/ct.yaml': ({'model_path': 'sheared-1.3b-dha25'}, None),
    'dha/sheared-llama-2.7b/search.yaml': ({'model_path': 'sheared-2.7b'}, None),
    'dha/sheared-llama-2.7b/fusion.yaml': ({'model_path': 'sheared-2.7b', 'head_map': 'map:sheared-2.7b'}, None),
    'dha/sheared-llama-2.7b/ct.yaml': ({'model_path': 'sheared-2.7b-dha25'}, None),
    'healing/llama2_7b_transfer.yaml': ({'model_path': 'llama2-7b-gqa8', 'source_path': 'llama2-7b'}, None),
    'healing/llama2_7b_kl.yaml': ({'model_path': 'llama2-7b-gqa8', 'source_path': 'llama2-7b'}, None),
    'healing/llama3_8b_transfer.yaml': ({'model_path': 'llama3-8b-gqa2', 'source_path': 'llama3-8b'}, None),
    'healing/llama3_8b_kl.yaml': ({'model_path': 'llama3-8b-gqa2', 'source_path': 'llama3-8b'}, None),
    'mla/llama2_7b_ct.yaml': ({'model_path': 'llama2-7b-mla25'}, None),
    'mla/llama3_8b_ct.yaml': ({'model_path': 'llama3-8b-mla33'}, None),
    'moh/llama3-8b-continue.yaml': ({'model_path': 'llama3-8b'}, None),
    'moh/scratch-llm-s.yaml': ({'tokenizer': 'llama2-7b'}, None),
    'moh/scratch-llm-b.yaml': ({'tokenizer': 'llama2-7b'}, None),
}
SHIPPED = sorted(str(path.relative_to(REPO / 'yamls')) for path in (REPO / 'yamls').rglob('*.yaml')
                 if not ({'tiny', 'real', 'bench'} & set(path.relative_to(REPO / 'yamls').parts))
                 and not path.name.startswith('tiny'))


DEEP_LAYERS = 7  # deeper than the probes (3 and 4 layers) allow without extrapolating
DEEP_KINDS = ('uniform', 'per-layer MLA ranks', 'per-layer MLA ranks, no activation checkpointing')


def _deep_config(kind: str) -> dict:
    config = {**LLAMA2_7B, 'num_hidden_layers': DEEP_LAYERS}
    if kind == 'uniform':
        return config
    config = _mla(config, 0.25)
    config['mla_ranks'] = [256, 512, 768, 1024, 2048, 256, 3072]  # the last layers unlike the probes'
    return config


@pytest.fixture(scope='module')
def plans(tmp_path_factory) -> dict:
    """Every plan of this module, made in one fresh process (an in-process training test earlier in the session
    leaves Composer's process group behind, which would send each plan to a child process of its own)."""
    root = tmp_path_factory.mktemp('config-only')
    for name, config in {**FOLDERS, **{f'deep-{kind}': _deep_config(kind) for kind in DEEP_KINDS}}.items():
        (root / name).mkdir()
        (root / name / 'config.json').write_text(json.dumps(config))
    for name, head_map in HEAD_MAPS.items():
        (root / f'{name}.head_map.json').write_text(json.dumps(head_map))
    folders = [f'variables.data_root={root / "data"}', f'variables.save_root={root / "runs"}']
    jobs = {}
    for recipe, (variables, seq_len) in RECIPES.items():
        overrides = [f'variables.{key}=' + str(root / f'{value[4:]}.head_map.json' if value.startswith('map:')
                                                else root / value) for key, value in variables.items()]
        jobs[recipe] = {'recipe': str(REPO / 'yamls' / recipe), 'overrides': overrides + folders,
                        'options': {'world_size': 8, 'gpu': 'a100-80g', 'seq_len': seq_len, 'search_largest': False}}
    for kind in DEEP_KINDS:
        for exact in (False, True):
            jobs[f'deep {kind} exact={exact}'] = {
                'recipe': str(REPO / 'yamls' / 'pretrain' / 'llama2_7b_cpt.yaml'),
                'overrides': [f'variables.model_path={root / f"deep-{kind}"}', *folders, 'global_train_batch_size=16',
                              'device_train_microbatch_size=2',
                              f'model.activation_checkpointing={"no activation" not in kind}'],
                'options': {'search_largest': False, 'exact': exact}}
    done = subprocess.run([sys.executable, str(REPO / 'tests' / 'scripts' / 'plan_jobs.py')], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env={**os.environ, 'PYTHONPATH': os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_shipped_recipe_is_in_the_table():
    assert sorted(RECIPES) == SHIPPED


@pytest.mark.parametrize('recipe', sorted(RECIPES))
def test_a_shipped_recipe_plans_and_fits_on_8_a100_80g(recipe, plans):
    plan = plans[recipe]
    assert 'error' not in plan, plan.get('error')
    assert plan['fits'], (recipe, plan['needed_gib'], plan['usable_gib'])
    assert plan['peak_gib'] > 1.0 and plan['tokens_per_s'] > 0  # a 1B-8B model's shards and activations
    assert plan['world_size'] == 8 and plan['gpu'] == 'A100 80GB'


@pytest.mark.parametrize('kind', DEEP_KINDS)
def test_extrapolating_a_deep_model_equals_tracking_every_layer(kind, plans):
    extrapolated, tracked = plans[f'deep {kind} exact=False'], plans[f'deep {kind} exact=True']
    assert extrapolated['extrapolated_from'] == [3, 4] and tracked['extrapolated_from'] is None
    assert extrapolated['layers'] == tracked['layers'] == DEEP_LAYERS
    assert extrapolated['parameters'] == tracked['parameters']
    assert extrapolated['checkpoint_gib'] == pytest.approx(tracked['checkpoint_gib'], rel=1e-3)
    assert extrapolated['by_category_gib']['optimizer'] == pytest.approx(tracked['by_category_gib']['optimizer'],
                                                                         rel=1e-3)
    if kind == 'uniform':
        for category, value in tracked['by_category_gib'].items():
            assert extrapolated['by_category_gib'][category] == pytest.approx(value, rel=0.01, abs=0.01), category
        assert extrapolated['peak_gib'] == pytest.approx(tracked['peak_gib'], rel=0.01)
    else:  # the later layers are wider than the 4th: the second probe takes the widest (6), so the plan may say a
        # little more than tracking every layer, never less by more than 1%
        assert extrapolated['probe_layers'] == [0, 1, 2, 6]
        assert tracked['peak_gib'] * 0.99 <= extrapolated['peak_gib'] <= tracked['peak_gib'] * 1.15
