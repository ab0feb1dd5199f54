"""The method registry: every method's algorithm exists, a checkpoint's tag picks its export (and an untagged one
from before the tag still exports alike), plain checkpoints pass through, and KV bytes follow the model type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dha_train.algorithms  # noqa: F401  (registers the algorithms)
from dha_train import methods, registry
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM
from dha_train.ops.heads import mean_pool_llama_state_dict
from helpers import TINY_MAP


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def test_every_method_names_a_registered_algorithm_and_a_loadable_model_type():
    for name in methods.names():
        method = methods.get(name)
        assert method.algorithm is None or method.algorithm in registry.algorithms.names(), name
        assert method.model_type in methods.trainable_model_types()
    with pytest.raises(methods.MethodError, match="unknown conversion method 'dhaa'"):
        methods.get('dhaa')


@pytest.mark.parametrize('tagged', [True, False], ids=['tagged', 'untagged (written before the tag)'])
def test_a_fusion_checkpoint_exports_as_the_baked_dha_model(tagged, tmp_path):
    model = _tiny_llama()
    HeadFusion(head_map=str(TINY_MAP.save(tmp_path / 'head_map.json'))).apply_surgery(model)
    assert getattr(model.config, methods.METHOD_TAG) == 'dha'
    if not tagged:
        delattr(model.config, methods.METHOD_TAG)
    config, weights = methods.export_model(model.config, model.state_dict())
    assert isinstance(config, DhaLlamaConfig) and not hasattr(config, methods.METHOD_TAG)
    exported = DhaLlamaForCausalLM(config)
    exported.load_state_dict(weights)  # strict: exactly the DHA model's weights
    # Omega is still the Kronecker delta, so baking (its group mean) gives each group the mean of its heads: the
    # mean-pool of the original weights to the same map.
    pooled = mean_pool_llama_state_dict(_tiny_llama().state_dict(), [layer.key for layer in TINY_MAP.layers],
                                        [layer.value for layer in TINY_MAP.layers], TINY_MAP.head_dim)
    assert weights.keys() == pooled.keys()
    for name, tensor in pooled.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert methods.kv_cache_bytes(config, seq_len=10, bytes_per_value=2) == TINY_MAP.kv_cache_bytes(1, 10, 2)


def test_a_plain_checkpoint_passes_through_unchanged():
    model = _tiny_llama()
    weights = model.state_dict()
    config, exported = methods.export_model(model.config, weights)
    assert config is model.config and exported is weights
    assert methods.kv_cache_bytes(config, seq_len=10) == 2 * 2 * 4 * 16 * 10 * 2  # K+V, layers, heads, dim, tokens
