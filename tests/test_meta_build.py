"""The model a rank other than 0 builds under ``model.load_on_rank0``: the loaded model's structure on the meta
device, and the algorithms' Event.INIT surgery applies to it (the 2-process launches are in
tests/launches/test_load_on_rank0.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.algorithms.kv_head_transfer import KVHeadTransfer
from dha_train.algorithms.mixture_of_heads import MixtureOfHeads
from dha_train.builders import build_model
from dha_train.config import ModelConfig
from helpers import SEQ_LEN, TINY_MAP


@pytest.fixture
def pretrained(tmp_path):
    torch.manual_seed(0)
    # Dynamic RoPE reads the rotary module's original_inv_freq, a tensor outside its buffers.
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN,
                         rope_scaling={'rope_type': 'dynamic', 'factor': 2.0})
    LlamaForCausalLM(config).save_pretrained(tmp_path / 'llama')
    return ModelConfig(pretrained_path=str(tmp_path / 'llama'))


def test_the_meta_model_is_the_loaded_model_without_weights(pretrained):
    loaded = build_model(pretrained)
    empty = build_model(pretrained, on_meta_device=True)
    assert type(empty) is type(loaded) and empty.fsdp_wrap_fn is loaded.fsdp_wrap_fn
    assert empty.config._attn_implementation == loaded.config._attn_implementation
    shapes = {name: (p.shape, p.dtype) for name, p in loaded.named_parameters()}
    assert {name: (p.shape, p.dtype) for name, p in empty.named_parameters()} == shapes
    assert all(p.is_meta for p in empty.parameters())
    assert [name for name, _ in empty.named_buffers()] == [name for name, _ in loaded.named_buffers()]
    rotary = empty.model.rotary_emb
    assert not rotary.original_inv_freq.is_meta  # no broadcast reaches it: built from the config
    torch.testing.assert_close(rotary.original_inv_freq, loaded.model.rotary_emb.original_inv_freq)


@pytest.mark.parametrize('algorithm', ['progressive_fusion', 'kv_head_transfer', 'moh_learned_router'])
def test_init_surgery_applies_to_the_meta_model(pretrained, tmp_path, algorithm):
    model = build_model(pretrained, on_meta_device=True)
    if algorithm == 'progressive_fusion':
        fusion = HeadFusion(head_map=str(TINY_MAP.save(tmp_path / 'head_map.json')), progressive=[2])
        created = fusion.apply_surgery(model)
        assert fusion.stage_subgroups is None  # taken from rank 0 at Event.INIT
    elif algorithm == 'kv_head_transfer':
        masks, group_heads = KVHeadTransfer(num_groups=2).apply_surgery(model)
        created = masks + group_heads
    else:
        created = MixtureOfHeads(router='learned', shared_heads=2, top_k=1).apply_surgery(model)
    assert created and all(p.is_meta for p in created)
    assert all(p.is_meta for p in model.parameters())  # Composer's FSDP2 requires rank 1 all on meta
