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
from helpers import SEQ_LEN, tiny_recipe

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
