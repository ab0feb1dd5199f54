"""Named parameter groups: decay/no_decay split, and algorithms adding their own group with its own lr."""

from __future__ import annotations

import pytest
import torch

from dha_train.builders import build_model
from dha_train.config import ModelConfig, OptimizerConfig
from dha_train.optim import add_param_group, build_optimizer


def test_named_groups_and_an_added_group_follow_their_own_lr():
    model = build_model(ModelConfig(config={'vocab_size': 64, 'hidden_size': 16, 'intermediate_size': 32,
                                            'num_hidden_layers': 1, 'num_attention_heads': 2,
                                            'num_key_value_heads': 2, 'max_position_embeddings': 8}))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=1e-4))
    groups = {g['name']: g for g in optimizer.param_groups}
    assert set(groups) == {'decay', 'no_decay'}
    no_decay_ids = {id(p) for p in groups['no_decay']['params']}
    for name, param in model.named_parameters():
        assert (id(param) in no_decay_ids) == ('norm' in name), name
    assert groups['no_decay']['weight_decay'] == 0.0 and groups['decay']['weight_decay'] == 1e-4

    extra = torch.nn.Parameter(torch.zeros(3))
    add_param_group(optimizer, 'fusion_weights', [extra], lr=5e-2)
    with pytest.raises(ValueError, match="already has a parameter group named 'fusion_weights'"):
        add_param_group(optimizer, 'fusion_weights', [torch.nn.Parameter(torch.zeros(1))])
    extra.grad = torch.ones(3)
    optimizer.step()
    # Adam's first step moves every coordinate by its group's lr.
    assert torch.allclose(extra.detach(), torch.full((3,), -5e-2), atol=1e-6)
