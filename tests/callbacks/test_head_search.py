"""HeadSearch (DHA Search stage): a head map that meets the K+V budget exactly, with K and V counts that follow each
layer's fusion loss (and not the scale of W_k or W_v), grouped by the head distances, from real (single-process)
Search runs on a model with planted head clusters."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.models.head_map import HeadMap
from dha_train.ops.budget import allocate_kv_heads, fusion_loss_costs
from helpers import SEQ_LEN, set_grouped_random_omega, tiny_recipe

HEADS, HEAD_DIM, HIDDEN = 8, 8, 64


def planted_mha(path, tokenizer_dir, rescale: float = 1.0, query_heads: int = HEADS):
    """2 layers x 8 heads. Layer 0: K heads near-copies of one head, V heads unrelated. Layer 1: K heads unrelated,
    V heads two interleaved clusters {0,2,4,6} and {1,3,5,7}.

    ``rescale`` c multiplies layer 0's W_k by c and divides its W_q by c (RoPE is linear, so every attention logit is
    unchanged), and divides layer 1's W_v by c and multiplies its W_o by c: the same function, other weight scales.

    ``query_heads`` > 8 makes it a GQA model whose 8 K/V heads (the planted ones) are shared by the query heads."""
    torch.manual_seed(0)
    head_dim = HIDDEN // query_heads
    config = LlamaConfig(vocab_size=384, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=query_heads, num_key_value_heads=HEADS, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)

    def heads_like(centres, assignment):
        noise = 0.01 * torch.randn(HEADS, head_dim, HIDDEN, generator=generator)
        return (centres[assignment] + noise).reshape(HEADS * head_dim, HIDDEN)

    distinct = lambda count: 0.3 * torch.randn(count, head_dim, HIDDEN, generator=generator)  # noqa: E731
    with torch.no_grad():
        first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        first.k_proj.weight.copy_(heads_like(distinct(1), [0] * HEADS))
        first.v_proj.weight.copy_(heads_like(distinct(HEADS), list(range(HEADS))))
        second.k_proj.weight.copy_(heads_like(distinct(HEADS), list(range(HEADS))))
        second.v_proj.weight.copy_(heads_like(distinct(2), [0, 1] * (HEADS // 2)))
        first.k_proj.weight.mul_(rescale)
        first.q_proj.weight.div_(rescale)
        second.v_proj.weight.div_(rescale)
        second.o_proj.weight.mul_(rescale)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def search_recipe(tmp_path, data_root, tokenizer_dir, out, rescale: float = 1.0, query_heads: int = HEADS,
                  **callback):
    # lambda starts high so that the fusion penalty pulls the omegas together within the 10 steps.
    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='10ba', optimizer={'lr': 1.0e-5},
                         algorithms={'head_fusion': {'warmup_groups': 1, 'stop_at_threshold': False,
                                                     'omega_lr': 0.05, 'lambda_lr': 0.05, 'lambda_init': 5.0,
                                                     'margin_warmup_steps': 0}},
                         callbacks={'head_search': {'out': str(out), 'kv_budget': 0.375, **callback},
                                    'fusion_monitor': {}})
    source = planted_mha(tmp_path / f'source-{rescale:g}-{query_heads}', tokenizer_dir, rescale, query_heads)
    recipe['model'] = {'pretrained_path': str(source)}
    return recipe


def test_search_meets_the_budget_and_gives_k_and_v_their_own_counts(tmp_path, data_root, tokenizer_dir):
    from composer.loggers import InMemoryLogger

    from dha_train.config import load_config
    from dha_train.train import train

    out = tmp_path / 'search'
    memory = InMemoryLogger()
    trainer = train(load_config(search_recipe(tmp_path, data_root, tokenizer_dir, out)), extra_loggers=[memory])
    trainer.close()

    head_map = HeadMap.load(out / 'head_map.json')
    counts = head_map.kv_heads()
    assert sum(k + v for k, v in counts) == 12  # exactly 37.5% of the 32 MHA K+V heads
    report = json.loads((out / 'search.json').read_text())
    assert report['recorded_batches'] == 10 and report['kv_heads_total'] == 12
    # The counts are the DP's answer for the layers' fusion losses (the Eq. 7 loss of the omegas, per kind) ...
    losses = [(layer['key_fusion_loss'], layer['value_fusion_loss']) for layer in report['layers']]
    assert [tuple(c) for c in allocate_kv_heads(fusion_loss_costs(losses, HEADS), 2, HEADS, 12)] == counts
    # ... which differ between K and V here (V resists fusing more), so K and V get their own counts.
    assert any(keys != values for keys, values in counts)
    # Groups follow the Eq. 6 distances: layer 1's V groups never mix the two planted (interleaved) clusters.
    assert all(len({head % 2 for head in group}) == 1 for group in head_map.layers[1].value_groups())
    # Eq. 6 distances: the planted near-copies sit far closer than unrelated heads.
    assert report['layers'][0]['key_mean_head_distance'] < 0.01 * report['layers'][0]['value_mean_head_distance']
    for name in ('kv_heads.png', 'head_distance_key.png', 'head_distance_value.png', 'distances.pt'):
        assert (out / name).is_file(), name
    logged = memory.data
    assert 'search/layer0/key_head_distance' in logged and 'search/layer1/value_omega_distance' in logged
    assert 'fusion/layer1/value_self_weight' in logged and 'fusion/lambda' in logged
    assert logged['search/layer0/key_heads'][-1][1] == counts[0][0]


def test_search_from_a_gqa_source_groups_its_shared_heads(tmp_path, data_root, tokenizer_dir):
    """16 query heads sharing the 8 planted K/V heads: the Search groups the 8 shared heads (the budget is a
    fraction of the source's K+V heads), and the map it writes is stated over the query heads."""
    from dha_train.config import load_config
    from dha_train.train import train

    out = tmp_path / 'search'
    train(load_config(search_recipe(tmp_path, data_root, tokenizer_dir, out, query_heads=16))).close()
    head_map = HeadMap.load(out / 'head_map.json')
    report = json.loads((out / 'search.json').read_text())
    assert head_map.num_query_heads == 16 and sum(k + v for k, v in head_map.kv_heads()) == 12
    assert report['kv_budget_fraction_of_source'] == pytest.approx(0.375)
    assert report['kv_budget_fraction'] == pytest.approx(12 / 64)
    source = HeadMap.gqa(2, 16, HEADS, HIDDEN // 16)
    head_map.source_partitions(source)  # whole source heads only
    # Layer 1's V groups keep the planted clusters apart: query head h reads source head h // 2.
    assert all(len({(head // 2) % 2 for head in group}) == 1 for group in head_map.layers[1].value_groups())


def test_allocation_is_invariant_to_rescaling_w_k_or_w_v(tmp_path, data_root, tokenizer_dir):
    """Rescaling layer 0's W_k by 30 (W_q by 1/30) and layer 1's W_v by 1/30 (W_o by 30) keeps the model's function
    and must keep the Search's allocation: costs come from the omega-space fusion loss, not weight magnitudes
    (which moved the old weight-distance allocation from [(2, 4), (4, 2)] to [(4, 4), (2, 2)] here)."""
    from dha_train.config import load_config
    from dha_train.train import train

    reports, logits = {}, {}
    ids = torch.randint(0, 384, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    for rescale in (1.0, 30.0):
        out = tmp_path / f'search-{rescale:g}'
        recipe = search_recipe(tmp_path, data_root, tokenizer_dir, out, rescale=rescale)
        with torch.no_grad():
            logits[rescale] = LlamaForCausalLM.from_pretrained(recipe['model']['pretrained_path'])(ids).logits
        train(load_config(recipe)).close()
        reports[rescale] = json.loads((out / 'search.json').read_text())
    torch.testing.assert_close(logits[30.0], logits[1.0], rtol=1e-4, atol=1e-4)  # the same function
    plain, scaled = reports[1.0], reports[30.0]
    # the weight-space distances did move with the scale (by 30^2) ...
    assert scaled['layers'][0]['key_mean_head_distance'] > 500 * plain['layers'][0]['key_mean_head_distance']
    assert scaled['layers'][1]['value_mean_head_distance'] < plain['layers'][1]['value_mean_head_distance'] / 500
    # ... but the fusion losses and the allocation did not
    for kind in ('key_fusion_loss', 'value_fusion_loss'):
        for layer in range(2):
            assert scaled['layers'][layer][kind] == pytest.approx(plain['layers'][layer][kind], rel=1e-2)
    assert scaled['allocation'] == plain['allocation']


def test_search_refuses_bad_budgets_and_setups(tmp_path, data_root, tokenizer_dir):
    from dha_train.config import load_config
    from dha_train.train import build_trainer

    recipe = search_recipe(tmp_path, data_root, tokenizer_dir, tmp_path / 'a', kv_budget=0.3)
    trainer = build_trainer(load_config(recipe))
    with pytest.raises(ValueError, match='not a whole number'):
        trainer.fit()
    trainer.close()

    recipe = search_recipe(tmp_path, data_root, tokenizer_dir, tmp_path / 'b')
    recipe['algorithms']['head_fusion'] = {'warmup_groups': 2, 'stop_at_threshold': False}
    trainer = build_trainer(load_config(recipe))
    with pytest.raises(ValueError, match='warmup_groups: 1'):
        trainer.fit()
    trainer.close()


def test_servable_search_shares_one_equal_grouping_per_layer_and_bakes_to_a_servable_model(tmp_path, data_root,
                                                                                           tokenizer_dir):
    """``servable: true``: every layer gets one count for K and V (the DP on K + V cost, 2 heads per unit) and one
    partition, so engines serve it as per-layer GQA after a permutation of the query heads. Removing the
    constraint gives the map of the first test, whose K and V counts differ. Fusion from the map bakes to a DHA
    model that computes what the fusion model computes."""
    import copy

    from composer.loggers import InMemoryLogger
    from transformers import LlamaForCausalLM

    from dha_train.algorithms.head_fusion import HeadFusion
    from dha_train.config import load_config
    from dha_train.methods import export_model
    from dha_train.models.modeling_dha import DhaLlamaForCausalLM
    from dha_train.train import train

    out = tmp_path / 'search'
    recipe = search_recipe(tmp_path, data_root, tokenizer_dir, out, servable=True)
    memory = InMemoryLogger()
    train(load_config(recipe), extra_loggers=[memory]).close()

    head_map = HeadMap.load(out / 'head_map.json')
    report = json.loads((out / 'search.json').read_text())
    assert report['servable'] is True and report['servable_problems'] == [] == head_map.servable_problems()
    counts = head_map.kv_heads()
    assert all(layer.key == layer.value for layer in head_map.layers)  # K and V grouped together ...
    assert all(len({len(g) for g in layer.key_groups()}) == 1 for layer in head_map.layers)  # ... equally
    assert sum(k + v for k, v in counts) == 12 and all(k == v for k, v in counts)
    # The counts are the shared DP's answer on the summed K and V fusion losses; 12 heads over 2 layers from the
    # divisors of 8 leave (2, 4) or (4, 2): the layers differ, the higher summed loss keeping 4.
    losses = [(layer['key_fusion_loss'], layer['value_fusion_loss']) for layer in report['layers']]
    assert allocate_kv_heads(fusion_loss_costs(losses, HEADS), 2, HEADS, 12, shared=True) == counts
    assert counts[0] != counts[1]
    assert (counts[0][0] > counts[1][0]) == (sum(losses[0]) > sum(losses[1]))
    # Layer 1's shared groups keep its planted V clusters apart (its K heads are unrelated: no pull either way).
    assert all(len({head % 2 for head in group}) == 1 for group in head_map.layers[1].key_groups())
    # per layer, a permutation of the query heads turns it into contiguous GQA
    permuted = head_map.permuted(head_map.contiguous_permutation())
    for layer, (keys, _) in zip(permuted.layers, counts):
        assert layer == HeadMap.gqa(1, HEADS, keys, head_map.head_dim).layers[0]
    assert memory.data['search/layer1/value_heads'][-1][1] == counts[1][1]

    # Fusion from the map (unchanged), omegas agreeing within the groups, bakes to the same function.
    source = LlamaForCausalLM.from_pretrained(recipe['model']['pretrained_path']).eval()
    algorithm = HeadFusion(head_map=str(out / 'head_map.json'))
    algorithm.apply_surgery(source)
    ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(3))
    set_grouped_random_omega(algorithm.projections)
    with torch.no_grad():
        reference = source(ids).logits
    config, weights = export_model(copy.deepcopy(source.config), source.state_dict())
    exported = HeadMap.from_hf_config(config)
    assert exported == head_map and exported.servable_problems() == []
    dha = DhaLlamaForCausalLM(config).eval()
    dha.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(dha(ids).logits, reference, rtol=0, atol=1e-5)

    # ... and that DHA model, exported to GGUF, runs in llama.cpp with the same logits (per-layer counts: `deci`).
    from dha_train.cli import main
    from dha_train.engine_process import EngineProcess
    from dha_train.llama_cpp_engine import LlamaCppModel

    dha.save_pretrained(tmp_path / 'dha')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'dha')
    assert main(['export-gguf', str(tmp_path / 'dha'), str(tmp_path / 'dha.gguf'), '--outtype', 'f32']) == 0
    with EngineProcess(LlamaCppModel, tmp_path / 'dha.gguf', n_ctx=64, all_logits=True, cache_type='f32',
                       flash_attention=False) as engine:
        found = torch.from_numpy(engine.logits(ids[0].tolist()))
    torch.testing.assert_close(found, reference[0], rtol=0, atol=1e-4)


def test_servable_search_refuses_budgets_it_cannot_meet(tmp_path, data_root, tokenizer_dir):
    from dha_train.callbacks.head_search import HeadSearch
    from dha_train.config import ConfigError, load_config
    from dha_train.train import build_trainer

    # 14 of 32 heads: 7 per kind, but one count per layer from {1, 2, 4, 8} sums to 6 or 8, never 7
    recipe = search_recipe(tmp_path, data_root, tokenizer_dir, tmp_path / 'a', kv_budget=0.4375, servable=True)
    trainer = build_trainer(load_config(recipe))
    with pytest.raises(ConfigError, match=r'servable kv_budget 0.4375 is 14 of the source\'s 32 K\+V heads.*'
                                          r'reachable totals are 4 to 12 in steps of 2, 16 to 20 in steps of 2, 24, '
                                          r'32; the nearest reachable kv_budget is 0.375 \(12 heads\) or 0.5 \(16'):
        trainer.fit()
    trainer.close()
    assert not (tmp_path / 'a').exists()
    # SmolLM2's shape, 30 layers of 3 K/V heads: counts 1 or 3, so an odd total, or half the cache, is unreachable
    search = HeadSearch(str(tmp_path / 'b'), kv_budget=0.5, servable=True)
    for total in (89, 90):
        with pytest.raises(ConfigError, match=rf'{total} of the source\'s 180 K\+V heads.*60 to 180 in steps of 4'):
            search._check_servable(30, 3, total)
    search._check_servable(30, 3, 120)  # kv2: 15 layers keep 3 heads, 15 keep 1
    with pytest.raises(ConfigError, match=r'allowed counts \[2\] do not divide the source\'s 3 K/V heads'):
        HeadSearch(str(tmp_path / 'b'), kv_budget=0.5, servable=True, allowed=[1, 2])._check_servable(30, 3, 120)
    with pytest.raises(ConfigError, match='servable must be true or false'):
        HeadSearch(str(tmp_path / 'b'), kv_budget=0.5, servable='yes')
