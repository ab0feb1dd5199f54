"""The DHA class across every source family: it is the family's own decoder with only the attention replaced, so a
head map that copies heads gives the source's logits (biases, q/k norms, Gemma 3's windows, scale and scaled
embeddings included); convert's non-uniform maps, DHA's Fusion and bake, and the head searches run on each family;
saved folders load back (with and without dha_train) and decode with a compact cache as without one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from family_models import (
    FAMILY_NAMES,
    logits_of,
    randomize_biases_and_norms,
    save_tiny_family_model,
    tiny_config,
    tiny_model,
)
from transformers import AutoModelForCausalLM, DynamicCache

import dha_train.models  # noqa: F401  (registers the Auto classes)
from dha_train import families, methods
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.cli import main
from dha_train.model_folders import load_causal_lm
from dha_train.models.head_map import HeadMap
from dha_train.models.modeling_dha import DhaLlamaAttention, DhaLlamaConfig, DhaLlamaForCausalLM
from dha_train.ops.fusion import groups_of
from helpers import WITHOUT_DHA_TRAIN

HEADS, WIDTH = 4, 16  # family_models' tiny shape: 4 query heads of 16 (64 / 4, or head_dim 16)
# K and V grouped differently, groups of unequal size, each group holding copies of one head under copies=2
COPY_MAP = HeadMap.dha(key_partitions=[[[0, 1], [2, 3]], [[0, 1], [2], [3]]],
                       value_partitions=[[[0, 1], [2], [3]], [[0, 1], [2, 3]]], num_heads=HEADS, head_dim=WIDTH)
# unequal groups, K and V differing, for models whose compact heads are random (no copies)
DHA_MAP = HeadMap.dha(key_partitions=[[[0, 2], [1, 3]], [[0, 1, 2, 3]]],
                      value_partitions=[[[0], [1, 2, 3]], [[0], [1], [2, 3]]], num_heads=HEADS, head_dim=WIDTH)
# equal groups (what Fusion fuses): layer 0 K in pairs, V all in one; layer 1 K interleaved pairs, V in pairs
FUSION_MAP = HeadMap.dha(key_partitions=[[[0, 1], [2, 3]], [[0, 2], [1, 3]]],
                         value_partitions=[[[0, 1, 2, 3]], [[0, 1], [2, 3]]], num_heads=HEADS, head_dim=WIDTH)


def dha_of(source, head_map: HeadMap, **overrides) -> DhaLlamaForCausalLM:
    config = DhaLlamaConfig.for_source(source.config, head_map.to_dict())
    for key, value in overrides.items():
        setattr(config, key, value)
    return DhaLlamaForCausalLM(config).float().eval()


@pytest.mark.parametrize('kv_heads', [HEADS, 2])
@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_a_head_map_of_the_source_grouping_gives_the_source_logits(model_type, kv_heads):
    """The DHA class over the source's own grouping (MHA, or GQA with 2 K/V heads) with the source's weights is the
    source: the family's decoder layers, norms, rotary embeddings (Gemma's local/global), scale and windows."""
    source = tiny_model(model_type, num_key_value_heads=kv_heads)
    dha = dha_of(source, HeadMap.from_hf_config(source.config))
    assert dha.config.source_model_type == model_type and dha.config.model_type == 'dha_llama'
    dha.load_state_dict(source.state_dict())
    layer = dha.model.layers[0]
    assert type(layer) is families.get(model_type).classes.decoder_layer
    assert isinstance(layer.self_attn, DhaLlamaAttention)
    family_attention = source.model.layers[0].self_attn
    assert layer.self_attn.scaling == family_attention.scaling
    assert (layer.self_attn.k_norm is None) == (not families.get(model_type).qk_norm)
    windows = [attention.sliding_window for attention in (layer.self_attn for layer in dha.model.layers)]
    assert windows == families.get(model_type).sliding_windows(source.config)
    torch.testing.assert_close(logits_of(dha), logits_of(source), rtol=0, atol=1e-5)


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_convert_to_a_non_uniform_map_of_copied_heads_gives_the_source_logits(tmp_path, model_type):
    """`dha-train convert --head-map` with K and V grouped differently (unequal groups) over K/V heads that are
    copies in pairs loses nothing: a DhaLlamaForCausalLM folder of the source's family with its logits."""
    source = tiny_model(model_type, copies=2)
    source.save_pretrained(tmp_path / 'source')
    COPY_MAP.save(tmp_path / 'map.json')
    assert main(['convert', str(tmp_path / 'source'), str(tmp_path / 'dha'), '--head-map',
                 str(tmp_path / 'map.json')]) == 0
    dha = load_causal_lm(tmp_path / 'dha', who='test').float().eval()
    assert type(dha) is DhaLlamaForCausalLM and dha.config.source_model_type == model_type
    assert [(a.num_key_heads, a.num_value_heads) for a in (layer.self_attn for layer in dha.model.layers)] \
        == COPY_MAP.kv_heads()
    if 'k_proj' in families.get(model_type).biased_projections(source.config):
        assert dha.model.layers[1].self_attn.k_proj.bias.shape == (3 * WIDTH,)
    torch.testing.assert_close(logits_of(dha), logits_of(source), rtol=0, atol=1e-5)


def _short_fusion(model, fusion: HeadFusion, steps: int = 3) -> None:
    """A few optimizer steps of the LM loss plus the fusion loss: the weights, biases and omega all move."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss + fusion.fusion_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_fusion_starts_at_the_source_and_bakes_to_the_fused_model_with_its_biases(tmp_path, model_type):
    """Fusion's surgery on the family's own class equals the source at the Kronecker start (q/k norms act after the
    fused projection); after a short fusion, with omega agreeing within each group, the bake is a DHA model of the
    family equal to the fused model, its compact k/v biases (Qwen2) fused like the weights."""
    source = tiny_model(model_type)
    expected = logits_of(source)
    fusion = HeadFusion(head_map=str(FUSION_MAP.save(tmp_path / 'map.json')))
    fusion.apply_surgery(source)
    torch.testing.assert_close(logits_of(source), expected, rtol=0, atol=1e-5)

    _short_fusion(source, fusion)
    with torch.no_grad():  # the groups agree, as when the fusion loss reaches 0: the bake is then exact
        for pair in fusion.projections:
            for projection in pair:
                for group in groups_of(projection.members):
                    projection.omega[group] = projection.omega[group].mean(dim=0)
    fused = logits_of(source)
    config, weights = methods.export_model(source.config, source.state_dict())
    assert isinstance(config, DhaLlamaConfig) and config.source_model_type == model_type
    assert HeadMap.from_dict(config.head_map) == FUSION_MAP
    baked = DhaLlamaForCausalLM(config).float().eval()
    baked.load_state_dict(weights)
    biased = families.get(model_type).biased_projections(source.config)
    assert [name for name in weights if name.startswith('model.layers.0.self_attn.v_proj.')] \
        == [f'model.layers.0.self_attn.v_proj.{kind}' for kind in ['weight'] + (['bias'] if biased else [])]
    if 'v_proj' in biased:
        assert weights['model.layers.0.self_attn.v_proj.bias'].shape == (WIDTH,)  # one compact V head
        assert weights['model.layers.1.self_attn.k_proj.bias'].shape == (2 * WIDTH,)
    torch.testing.assert_close(logits_of(baked), fused, rtol=0, atol=1e-5)


def _random_dha(model_type: str) -> DhaLlamaForCausalLM:
    """A DHA model of the family on DHA_MAP with random weights (wide, so greedy tokens do not hinge on rounding),
    nonzero biases and non-trivial norms."""
    torch.manual_seed(0)
    config = DhaLlamaConfig.for_source(tiny_config(model_type, initializer_range=0.2, eos_token_id=None),
                                       DHA_MAP.to_dict())
    model = DhaLlamaForCausalLM(config).float().eval()
    randomize_biases_and_norms(model, model_type)
    return model


@pytest.fixture(scope='module')
def saved_models(tmp_path_factory) -> dict[str, tuple]:
    """Per family, a random DHA model saved with save_pretrained, and its logits on fixed ids."""
    folder = tmp_path_factory.mktemp('family_dha')
    saved = {}
    for model_type in FAMILY_NAMES:
        model = _random_dha(model_type)
        model.save_pretrained(folder / model_type)
        saved[model_type] = (folder / model_type, model.config, logits_of(model))
    return saved


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_saved_folders_load_back_and_decode_with_a_compact_cache_as_without(saved_models, model_type):
    """save_pretrained + AutoModelForCausalLM (no trust_remote_code) gives the same config and logits; cached greedy
    decoding (grouped by compact head, also past Gemma's sliding window) equals recomputing without a cache."""
    folder, config, expected = saved_models[model_type]
    assert {'modeling_dha.py', 'family_classes.py'} <= {path.name for path in folder.iterdir()}
    saved = json.loads((folder / 'config.json').read_text())
    assert saved['model_type'] == 'dha_llama' and saved['source_model_type'] == model_type
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is DhaLlamaForCausalLM
    assert {**loaded.config.to_dict(), '_name_or_path': ''} == config.to_dict()
    torch.testing.assert_close(logits_of(loaded), expected, rtol=0, atol=1e-5)

    ids = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    grouped_calls = []
    original = DhaLlamaAttention.grouped_attention

    def spy(self, *args):
        grouped_calls.append(self.layer_idx)
        return original(self, *args)
    new_tokens = 9  # 5 + 9 positions: past the window of 6 on Gemma's sliding layer
    try:
        DhaLlamaAttention.grouped_attention = spy
        out = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              use_cache=True, return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            cache = DynamicCache()
            steps = [loaded(out.sequences[:, :5], past_key_values=cache, use_cache=True).logits]
            steps += [loaded(out.sequences[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                      for t in range(5, out.sequences.shape[1])]
    finally:
        DhaLlamaAttention.grouped_attention = original
    assert grouped_calls == [0, 1] * (2 * new_tokens - 1)  # every decode step of both runs, never a prefix
    recomputed = ids
    with torch.no_grad():
        for _ in range(new_tokens):
            step = loaded(recomputed, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            recomputed = torch.cat([recomputed, step], dim=1)
        uncached = loaded(out.sequences, use_cache=False).logits
    assert torch.equal(out.sequences, recomputed)
    # float32 sums in another order (one cached row against the whole window): CI saw 1.25e-5 on Qwen3's logits of
    # order 3; a cache read wrong differs by order 1
    torch.testing.assert_close(torch.cat(steps, dim=1), uncached, rtol=0, atol=5e-5)
    assert [(layer[0].shape[1], layer[1].shape[1]) for layer in out.past_key_values] == DHA_MAP.kv_heads()


_REMOTE_LOAD_ALL = WITHOUT_DHA_TRAIN + textwrap.dedent('''
    import torch
    from transformers import AutoModelForCausalLM
    ids, logits = torch.load(sys.argv[1]), {}
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__
        with torch.no_grad():
            logits[folder] = model(ids, use_cache=False).logits
    torch.save(logits, sys.argv[2])
''')


@pytest.mark.slow
def test_exported_folders_of_every_family_load_with_trust_remote_code_without_dha_train(saved_models, tmp_path):
    """A fresh interpreter where dha_train cannot be imported, offline, loads each family's folder with
    trust_remote_code (its modeling file and the family table copied beside the weights) to the same logits."""
    copies = {model_type: shutil.copytree(folder, tmp_path / model_type)
              for model_type, (folder, _, _) in saved_models.items()}
    torch.manual_seed(1)  # logits_of's ids
    torch.save(torch.randint(0, 384, (2, 12)), tmp_path / 'ids.pt')
    env = {key: value for key, value in os.environ.items() if key not in ('PYTHONPATH', 'PYTHONHOME')}
    env.update(PYTHONNOUSERSITE='1', HF_HOME=str(tmp_path / 'hf_home'), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    result = subprocess.run([sys.executable, '-c', _REMOTE_LOAD_ALL, str(tmp_path / 'ids.pt'),
                             str(tmp_path / 'logits.pt'), *map(str, copies.values())],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    remote = torch.load(tmp_path / 'logits.pt')
    for model_type, copy in copies.items():
        torch.testing.assert_close(remote[str(copy)], saved_models[model_type][2], rtol=0, atol=1e-5)


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_a_config_missing_family_settings_takes_the_family_defaults(model_type):
    """Settings the family's config class defines and a DHA config's arguments lack come from the family's
    defaults (Gemma 3's query_pre_attn_scalar and layer_types), derived from the settings given."""
    given = {'vocab_size': 64, 'hidden_size': 32, 'intermediate_size': 48, 'num_hidden_layers': 3,
             'num_attention_heads': 2, 'head_dim': 16}
    config = DhaLlamaConfig(source_model_type=model_type, **given)
    family = families.get(model_type).config_class(**given)
    for key, value in family.to_dict().items():
        if key not in ('model_type', 'transformers_version', 'num_key_value_heads', 'architectures'):
            assert getattr(config, key) == value, key
    with pytest.raises(ValueError, match='source_model_type gpt2 is not one of'):
        DhaLlamaConfig(source_model_type='gpt2', **given)


# similarity and AsymGQA on every family; servable (the similarity search with one more constraint, naming no
# family) on the families with q/k norms
SEARCHES = [(method, model_type) for method in ('similarity', 'asym') for model_type in FAMILY_NAMES] + [
    ('servable', 'qwen3'), ('servable', 'gemma3_text')]


@pytest.mark.parametrize('method, model_type', SEARCHES)
def test_head_searches_run_on_every_family_and_find_the_copied_heads(tmp_path, data_root, tokenizer_dir, model_type,
                                                                     method):
    """`dha-train search` (similarity, AsymGQA, servable) on a family folder whose K/V heads are copies in pairs
    groups the copies (the asym fitness pools biases with the weights, so its pooled model is the source)."""
    save_tiny_family_model(tmp_path / 'source', model_type, tokenizer_dir, copies=2)
    args = {'similarity': ['--method', 'similarity'], 'servable': ['--method', 'similarity', '--servable'],
            'asym': ['--method', 'asym', '--iterations', '4', '--fitness-batches', '1', '--fitness', 'kl',
                     '--sample-tokens', '64']}[method]
    assert main(['search', str(tmp_path / 'source'), str(tmp_path / 'search'), '--kv-heads', '2', '--data',
                 str(data_root), '--tokens', '256', '--batch-size', '2', *args]) == 0
    head_map = HeadMap.load(tmp_path / 'search' / 'head_map.json')
    report = json.loads((tmp_path / 'search' / 'search.json').read_text())
    if method == 'asym':
        # the copies' grouping is among the candidates; whatever it keeps cannot lose to MHA by more than rounding
        assert report['asym']['neighbour_loss'] == pytest.approx(0.0, abs=1e-6)
    else:
        assert [layer.key_groups() for layer in head_map.layers] == [[[0, 1], [2, 3]]] * 2
        assert [layer.value_groups() for layer in head_map.layers] == [[[0, 1], [2, 3]]] * 2


def test_the_asym_fitness_pools_k_and_v_biases_with_the_weights():
    """AsymGQA's fitness model is what mean-pooling serves: a group's K and V heads, biases included, are replaced
    by their mean; restoring gives the source back."""
    from dha_train.conversion.search import _PooledLayerFitness

    model = tiny_model('qwen2')
    before = [tensor.detach().clone() for tensor in (model.model.layers[1].self_attn.k_proj.bias,
                                                     model.model.layers[1].self_attn.v_proj.bias)]
    pooled = _PooledLayerFitness(model, [torch.zeros(1, 4, dtype=torch.long)], WIDTH, 'loss')
    pooled.set_layer(1, [[0, 3], [1], [2]])
    for tensor, original in zip((model.model.layers[1].self_attn.k_proj.bias,
                                 model.model.layers[1].self_attn.v_proj.bias), before):
        heads, source = tensor.detach().reshape(HEADS, WIDTH), original.reshape(HEADS, WIDTH)
        torch.testing.assert_close(heads[0], (source[0] + source[3]) / 2)
        torch.testing.assert_close(heads[3], heads[0])
        torch.testing.assert_close(heads[1:3], source[1:3])
    pooled.set_layer(1, None)
    assert all(torch.equal(tensor, original) for tensor, original in
               zip((model.model.layers[1].self_attn.k_proj.bias, model.model.layers[1].self_attn.v_proj.bias), before))


@pytest.mark.parametrize('model_type', ['qwen2', 'gemma3_text'])
def test_search_then_fusion_then_export_on_a_family_folder(tmp_path, data_root, tokenizer_dir, model_type):
    """DHA's chain on a family folder (Qwen2's biases; Gemma 3's norms, windows and scale), single process: the
    Search run (head_fusion warm-up + head_search) meets the budget, a short Fusion run on its map trains the
    family's own class, and the export bakes it into a DHA model of the family with the searched map, its compact
    k/v biases included, that decodes with a cache of that map."""
    from dha_train.config import load_config
    from dha_train.export import export_hf
    from dha_train.train import train
    from helpers import tiny_recipe

    source = save_tiny_family_model(tmp_path / 'source', model_type, tokenizer_dir)
    search_out = tmp_path / 'search'
    search = tiny_recipe(data_root, tokenizer_dir, max_duration='4ba', optimizer={'lr': 1.0e-5},
                         algorithms={'head_fusion': {'warmup_groups': 1, 'stop_at_threshold': False,
                                                     'lambda_init': 5.0, 'margin_warmup_steps': 0}},
                         callbacks={'head_search': {'out': str(search_out), 'kv_budget': 0.5}})
    search['model'] = {'pretrained_path': str(source)}
    train(load_config(search)).close()
    searched = HeadMap.load(search_out / 'head_map.json')
    assert sum(k + v for k, v in searched.kv_heads()) == 8  # half of 2 layers x 4 heads x (K + V)

    fusion = tiny_recipe(data_root, tokenizer_dir, max_duration='3ba', save_folder=str(tmp_path / 'ckpt'),
                         save_interval='1000ba', algorithms={'head_fusion': {'head_map': str(search_out / 'head_map.json')}})
    fusion['model'] = {'pretrained_path': str(source)}
    trainer = train(load_config(fusion))
    assert type(trainer.state.model.model) is families.get(model_type).causal_lm_class
    trainer.close()

    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    dha = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(dha) is DhaLlamaForCausalLM and dha.config.source_model_type == model_type
    assert HeadMap.from_dict(dha.config.head_map) == searched
    biased = 'k_proj' in families.get(model_type).biased_projections(dha.config)
    for attention, (keys, values) in zip((layer.self_attn for layer in dha.model.layers), searched.kv_heads()):
        assert (attention.num_key_heads, attention.num_value_heads) == (keys, values)
        assert (attention.k_proj.bias is not None) == biased and (attention.v_proj.bias is not None) == biased
        if biased:
            assert attention.k_proj.bias.shape == (keys * WIDTH,) and bool(attention.k_proj.bias.abs().sum() > 0)
    ids = torch.randint(0, 384, (1, 4), generator=torch.Generator().manual_seed(0))
    generated = dha.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             use_cache=True, return_dict_in_generate=True, pad_token_id=0)
    assert [(k.shape[1], v.shape[1]) for k, v in generated.past_key_values] == searched.kv_heads()


def test_head_distances_count_a_k_or_v_bias_as_a_column_of_the_projection():
    """Two heads with equal weight rows and different biases compute different keys: Eq. 6's distance on
    ``[W | b]`` sees it (the Search groups what heads compute), and without a bias nothing changes."""
    from dha_train.ops.fusion import group_members, head_distances, kronecker_omega, with_bias_column

    weight = torch.randn(WIDTH, 8, generator=torch.Generator().manual_seed(0)).repeat(2, 1)  # heads 0, 1 alike
    bias = torch.cat([torch.zeros(WIDTH), torch.ones(WIDTH)])
    members = group_members([[0, 1]], 2)
    omega = kronecker_omega(members, WIDTH)
    assert float(head_distances(weight, omega, members)[0][0, 1]) == pytest.approx(0.0, abs=1e-9)
    assert float(head_distances(with_bias_column(weight, bias), omega, members)[0][0, 1]) == pytest.approx(WIDTH / 2, rel=1e-6)
    assert with_bias_column(weight, None) is weight


def test_a_decode_step_past_the_window_without_a_4d_mask_takes_the_kernel_given_the_window():
    """The grouped decode reads a sliding window from the mask alone: eager's and SDPA's 4-D masks hold it, a
    flash-attention padding mask (2-D) or none does not, so such a step past the window takes the expanded kernel,
    which is passed ``sliding_window``; full-attention layers and steps within the window stay grouped."""
    model = _random_dha('gemma3_text')
    sliding, full = (layer.self_attn for layer in model.model.layers)
    assert (sliding.sliding_window, full.sliding_window) == (6, None) and sliding.is_sliding and not full.is_sliding
    four_d = torch.zeros(1, 1, 1, 10)
    assert sliding._mask_holds_window(four_d, 10) and sliding._mask_holds_window(None, 6)
    assert not sliding._mask_holds_window(None, 10) and not sliding._mask_holds_window(torch.ones(1, 10), 10)
    assert full._mask_holds_window(None, 10) and full._mask_holds_window(torch.ones(1, 10), 10)


@pytest.mark.parametrize('cache', ['static', 'hybrid', 'sliding_window'])
def test_preallocated_caches_are_refused_on_a_gemma_dha_model(cache):
    """Gemma 3's own generation may ask for a hybrid (preallocated) cache; DHA layers have their own K/V head counts,
    which only the dynamic cache holds, so every preallocated kind is refused naming the static cache."""
    model = _random_dha('gemma3_text')
    with pytest.raises(ValueError, match='static'):
        model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2, cache_implementation=cache,
                       pad_token_id=0)
