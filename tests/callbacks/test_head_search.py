"""HeadSearch (DHA Search stage): a head map that meets the K+V budget exactly, with K and V counts that follow the
head distances, from a real (single-process) Search run on a model with planted head clusters."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.models.head_map import HeadMap
from helpers import SEQ_LEN, tiny_recipe

HEADS, HEAD_DIM, HIDDEN = 8, 8, 64


def planted_mha(path, tokenizer_dir):
    """2 layers x 8 heads. Layer 0: K heads near-copies of one head, V heads unrelated. Layer 1: K heads unrelated,
    V heads two interleaved clusters {0,2,4,6} and {1,3,5,7}."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)

    def heads_like(centres, assignment):
        noise = 0.01 * torch.randn(HEADS, HEAD_DIM, HIDDEN, generator=generator)
        return (centres[assignment] + noise).reshape(HEADS * HEAD_DIM, HIDDEN)

    distinct = lambda count: 0.3 * torch.randn(count, HEAD_DIM, HIDDEN, generator=generator)  # noqa: E731
    with torch.no_grad():
        first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        first.k_proj.weight.copy_(heads_like(distinct(1), [0] * HEADS))
        first.v_proj.weight.copy_(heads_like(distinct(HEADS), list(range(HEADS))))
        second.k_proj.weight.copy_(heads_like(distinct(HEADS), list(range(HEADS))))
        second.v_proj.weight.copy_(heads_like(distinct(2), [0, 1] * (HEADS // 2)))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def search_recipe(tmp_path, data_root, tokenizer_dir, out, **callback):
    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='6ba', optimizer={'lr': 1.0e-5},
                         algorithms={'head_fusion': {'warmup_groups': 1, 'stop_at_threshold': False,
                                                     'omega_lr': 1.0e-3}},  # distances follow the weights
                         callbacks={'head_search': {'out': str(out), 'kv_budget': 0.375, **callback},
                                    'fusion_monitor': {}})
    recipe['model'] = {'pretrained_path': str(planted_mha(tmp_path / 'mha', tokenizer_dir))}
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
    # The clustered K of layer 0 and V of layer 1 fuse down to 2 heads each (4 query heads per K/V head); the
    # unrelated heads keep 4 each: the cheapest way to spend 12 heads. So K and V differ within each layer.
    assert counts == [(2, 4), (4, 2)]
    assert head_map.layers[1].value_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the planted (interleaved) clusters
    report = json.loads((out / 'search.json').read_text())
    assert report['recorded_batches'] == 6 and report['kv_heads_total'] == 12
    # Eq. 6 distances: the planted near-copies sit far closer than unrelated heads.
    assert report['layers'][0]['key_mean_head_distance'] < 0.01 * report['layers'][0]['value_mean_head_distance']
    for name in ('kv_heads.png', 'head_distance_key.png', 'head_distance_value.png', 'distances.pt'):
        assert (out / name).is_file(), name
    logged = memory.data
    assert 'search/layer0/key_head_distance' in logged and 'search/layer1/value_omega_distance' in logged
    assert 'fusion/layer1/value_self_weight' in logged and 'fusion/lambda' in logged
    assert logged['search/layer0/key_heads'][-1][1] == 2


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
