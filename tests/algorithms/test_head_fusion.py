"""HeadFusion: the fusion model equals MHA at init; a tiny fusion run drives L_fusion below the threshold."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.algorithms.head_fusion import OMEGA_GROUP, HeadFusion
from dha_train.models.fusion import FusedProjection
from dha_train.models.head_map import HeadMap
from dha_train.ops.fusion import group_members
from helpers import TINY_MAP, fusion_recipe, set_grouped_random_omega


def tiny_mha() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize('options', ['map', 'warmup', 'progressive'])
def test_fusion_model_at_init_equals_mha(tmp_path, options):
    mha = tiny_mha()
    fused = copy.deepcopy(mha)
    if options == 'warmup':
        algorithm = HeadFusion(warmup_groups=1)
    else:
        algorithm = HeadFusion(head_map=str(TINY_MAP.save(tmp_path / 'head_map.json')),
                               progressive=[2] if options == 'progressive' else None)
    omegas = algorithm.apply_surgery(fused)
    assert len(omegas) == 4 and all(isinstance(p, FusedProjection) for pair in algorithm.projections for p in pair)
    ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, mha(ids).logits, rtol=0, atol=1e-5)
    # At the Kronecker init a pair of a g-group differs by 2 d squared units over g d weights. Layer 0 of the map:
    # K and V pairs of g = 2 -> 1. Layer 1: 6 K pairs of g = 4 (64 weights each) and 2 V pairs of g = 2 (32 each):
    # (6 * 32 + 2 * 32) / (6 * 64 + 2 * 32) = 4 / 7. Warm-up (one group of 4 for K and V in both layers): 2 / 4.
    # Progressive [2]: the first stage counts only 2 sub-pairs of layer 1's K group: (2 * 32 + 2 * 32) / (2 * 64
    # + 2 * 32) = 2 / 3.
    expected = {'map': (1 + 4 / 7) / 2, 'warmup': 2 / 4, 'progressive': (1 + 2 / 3) / 2}[options]
    assert float(algorithm.fusion_loss()) == pytest.approx(expected, rel=1e-6)


def test_fusion_refuses_a_map_that_does_not_fit(tmp_path):
    algorithm = HeadFusion(head_map=str(HeadMap.gqa(3, 4, 2, 16).save(tmp_path / 'head_map.json')))
    with pytest.raises(Exception, match='3 layers'):
        algorithm.apply_surgery(tiny_mha())


@pytest.mark.slow
def test_tiny_fusion_run_drives_the_fusion_loss_below_threshold(tmp_path, data_root, tokenizer_dir):
    from dha_train.config import load_config
    from dha_train.train import train

    recipe = fusion_recipe(tmp_path, data_root, tokenizer_dir, save_folder=str(tmp_path / 'ckpt'),
                           save_interval='1000ba')
    trainer = train(load_config(recipe))
    try:
        fusion = next(a for a in trainer.state.algorithms if isinstance(a, HeadFusion))
        history = fusion.history
        assert history[0]['fusion_loss'] == pytest.approx((1 + 4 / 7) / 2, rel=1e-4)
        assert fusion.converged_at is not None and history[-1]['fusion_loss'] < 1e-3
        assert int(trainer.state.timestamp.batch) == fusion.converged_at < 120  # stopped cleanly at convergence
        # lambda grows while the constraint is violated (loss above the margin).
        violated = [i for i in range(1, len(history)) if history[i - 1]['fusion_loss'] > history[i - 1]['margin']]
        assert violated and all(history[i]['lambda'] > history[i - 1]['lambda'] for i in violated)
        names = [g.get('name') for g in trainer.state.optimizers[0].param_groups]
        assert OMEGA_GROUP in names
    finally:
        trainer.close()

    # The end-of-fusion checkpoint exports as the baked DHA model with the fusion's head map.
    from transformers import AutoModelForCausalLM

    from dha_train.export import export_hf

    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    assert HeadMap.load(out / 'head_map.json') == TINY_MAP
    dha = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(dha).__name__ == 'DhaLlamaForCausalLM'
    assert [(a.num_key_heads, a.num_value_heads) for a in (layer.self_attn for layer in dha.model.layers)] \
        == TINY_MAP.kv_heads()


def test_baked_dha_model_equals_the_fusion_model_when_groups_agree(tmp_path):
    from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM
    from dha_train.ops.fusion import bake_llama_state_dict

    fused = tiny_mha()
    algorithm = HeadFusion(head_map=str(TINY_MAP.save(tmp_path / 'head_map.json')))
    algorithm.apply_surgery(fused)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for pair in algorithm.projections:
            for projection in pair:  # random omega that agrees within every group
                omega = torch.rand(projection.omega.shape, generator=generator)
                for row in projection.members.tolist():
                    omega[row] = omega[row].mean(dim=0)
                projection.omega.copy_(omega)
    baked, key_partitions, value_partitions = bake_llama_state_dict(fused.state_dict(), head_dim=16)
    head_map = HeadMap.dha(key_partitions, value_partitions, num_heads=4, head_dim=16)
    assert head_map == TINY_MAP
    config = DhaLlamaConfig(head_map=head_map.to_dict(), **{k: v for k, v in fused.config.to_dict().items()
                                                             if k in ('vocab_size', 'hidden_size', 'intermediate_size',
                                                                      'num_hidden_layers', 'num_attention_heads',
                                                                      'max_position_embeddings')})
    dha = DhaLlamaForCausalLM(config).eval()
    dha.load_state_dict(baked)
    ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = fused(ids).logits
        assert float(algorithm.fusion_loss()) < 1e-12
        torch.testing.assert_close(dha(ids).logits, reference, rtol=0, atol=1e-5)



def tiny_gqa() -> LlamaForCausalLM:
    """8 query heads sharing 4 K/V heads (head dim 8)."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize('options', ['map', 'warmup'])
def test_fusion_from_a_gqa_source_equals_it_at_init_and_bakes_to_the_map(tmp_path, options):
    """Fusion weights mix the source's shared K/V heads (4 per layer here, never expanded to the 8 query heads);
    at the Kronecker init the model is the GQA source, and once the groups agree the exported DHA model computes
    what the fusion model computes, its map stated over the query heads."""
    from dha_train.methods import export_model
    from dha_train.models.modeling_dha import DhaLlamaForCausalLM

    gqa = tiny_gqa()
    source = HeadMap.from_hf_config(gqa.config)
    target = HeadMap.from_source_partitions(source, [[[0, 1], [2, 3]], [[0, 1, 2, 3]]],
                                            [[[0, 2], [1, 3]], [[0], [1], [2], [3]]])
    fused = copy.deepcopy(gqa)
    algorithm = (HeadFusion(warmup_groups=1) if options == 'warmup'
                 else HeadFusion(head_map=str(target.save(tmp_path / 'head_map.json'))))
    algorithm.apply_surgery(fused)
    for pair in algorithm.projections:
        for projection in pair:
            assert projection.weight.shape[0] == 4 * 8 and projection.omega.shape[:1] == (4,)
    ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, gqa(ids).logits, rtol=0, atol=1e-5)
    if options == 'warmup':
        return
    set_grouped_random_omega(algorithm.projections)
    with torch.no_grad():
        reference = fused(ids).logits
    config, weights = export_model(copy.deepcopy(fused.config), fused.state_dict())
    assert HeadMap.from_hf_config(config) == target
    dha = DhaLlamaForCausalLM(config).eval()
    dha.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(dha(ids).logits, reference, rtol=0, atol=1e-5)


def test_progressive_fusion_stage_state_round_trips_and_must_match_the_recipe(tmp_path):
    head_map = str(TINY_MAP.save(tmp_path / 'head_map.json'))
    algorithm = HeadFusion(head_map=head_map, progressive=[2])
    algorithm.apply_surgery(tiny_mha())
    key_pairs = algorithm.stage_subgroups[1][0]  # layer 1's K group of 4, split into the 2 closest pairs
    assert len(key_pairs) == 2 and sorted(h for pair in key_pairs for h in pair) == [0, 1, 2, 3]
    algorithm.stage_subgroups[1][0] = [[0, 3], [1, 2]] if key_pairs != [[0, 3], [1, 2]] else [[0, 1], [2, 3]]
    algorithm.stage, algorithm.stage_started = 0, 7
    saved = algorithm.state_dict()

    resumed = HeadFusion(head_map=head_map, progressive=[2])
    resumed.apply_surgery(tiny_mha())
    resumed.load_state_dict(saved)
    assert resumed.stage_subgroups == algorithm.stage_subgroups and resumed.stage_started == 7
    expected = group_members(algorithm.stage_subgroups[1][0], 4)
    assert torch.equal(resumed.projections[1][0].fusion_pairs, expected)
    plain = HeadFusion(head_map=head_map)
    plain.apply_surgery(tiny_mha())
    with pytest.raises(ValueError, match='progressive'):
        plain.load_state_dict(saved)
    with pytest.raises(ValueError, match='progressive'):
        HeadFusion(warmup_groups=1, progressive=[2])
    with pytest.raises(ValueError, match='progressive'):
        HeadFusion(head_map=head_map, progressive=[4, 2])


@pytest.mark.slow
def test_tiny_progressive_fusion_run_fuses_pairs_first_then_the_whole_groups(tmp_path, data_root, tokenizer_dir):
    from dha_train.config import load_config
    from dha_train.train import train

    recipe = fusion_recipe(tmp_path, data_root, tokenizer_dir)
    recipe['algorithms']['head_fusion']['progressive'] = [2]
    trainer = train(load_config(recipe))
    try:
        fusion = next(a for a in trainer.state.algorithms if isinstance(a, HeadFusion))
        history = fusion.history
        stages = [record["stage"] for record in history]
        switch = stages.index(1)
        assert stages == [0] * switch + [1] * (len(history) - switch)
        assert history[0]['fusion_loss'] == pytest.approx((1 + 2 / 3) / 2, rel=1e-4)
        # Stage 0 ended below the threshold on its sub-pairs; stage 1 adds the cross-pair terms of layer 1's K
        # group, so its loss starts above the threshold, under a fresh lambda and margin.
        assert history[switch - 1]['fusion_loss'] < 1e-3 < history[switch]['fusion_loss']
        assert history[switch]['margin'] == pytest.approx(history[0]['margin'])
        assert history[switch]['lambda'] < history[switch - 1]['lambda']
        assert fusion.converged_at is not None and history[-1]['fusion_loss'] < 1e-3
        assert fusion.stage_subgroups[1][0] == [[0, 1, 2, 3]]
    finally:
        trainer.close()


@pytest.mark.slow
def test_fusion_with_the_layerwise_attention_loss_fuses_and_trains_only_attention(tmp_path, data_root,
                                                                                 tokenizer_dir):
    # Fusion's data term made local: attention_transfer from the same source replaces the LM loss (README, DHA)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dha_train.algorithms.attention_transfer import AttentionTransfer
    from dha_train.config import load_config
    from dha_train.export import export_hf
    from dha_train.train import train
    from helpers import save_tiny_llama

    save_tiny_llama(tmp_path / 'source', tokenizer_dir, seed=5, num_attention_heads=4, num_key_value_heads=4)
    recipe = fusion_recipe(tmp_path, data_root, tokenizer_dir, save_folder=str(tmp_path / 'ckpt'),
                           save_interval='1000ba', max_duration='24ba')
    recipe['model'] = {'pretrained_path': str(tmp_path / 'source')}
    recipe['algorithms']['head_fusion']['lambda_lr'] = 20.0
    recipe['algorithms']['attention_transfer'] = {'source_path': str(tmp_path / 'source')}
    trainer = train(load_config(recipe))
    try:
        fusion = next(a for a in trainer.state.algorithms if isinstance(a, HeadFusion))
        transfer = next(a for a in trainer.state.algorithms if isinstance(a, AttentionTransfer))
        losses = [step['fusion_loss'] for step in fusion.history]
        assert losses[-1] < 0.5 * losses[0]
        assert float(transfer._terms.mean()) > 0  # pulled away from the source (equal to it at init)
    finally:
        trainer.close()
    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == 'DhaLlamaForCausalLM'
    baked, source = load_file(out / 'model.safetensors'), load_file(tmp_path / 'source' / 'model.safetensors')
    assert not [name for name in baked if 'transfer' in name]
    for name, tensor in source.items():  # only the attention trained
        if 'self_attn' not in name:
            assert torch.equal(baked[name], tensor), name
