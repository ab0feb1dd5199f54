"""Tiny models of every source family, built by transformers' own classes, for the tests that run a property across
families: nonzero Qwen2 q/k/v biases, non-trivial q/k norm weights (Qwen3, Gemma 3), and a Gemma 3 whose layers mix
sliding-window and full attention with a window shorter than the test sequence and its own attention scale."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from dha_train import families
from helpers import SEQ_LEN

FAMILY_NAMES = tuple(families.FAMILIES)
SHAPE = {'vocab_size': 384, 'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 2,
         'num_attention_heads': 4, 'num_key_value_heads': 4, 'max_position_embeddings': SEQ_LEN}
EXTRA = {
    'llama': {'rope_scaling': {'rope_type': 'llama3', 'factor': 4.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                               'original_max_position_embeddings': 16}, 'tie_word_embeddings': True},
    'mistral': {'sliding_window': None},
    'qwen2': {},
    'qwen3': {'head_dim': 16},
    'gemma3_text': {'head_dim': 16, 'query_pre_attn_scalar': 24, 'sliding_window': 6,
                    'layer_types': ['sliding_attention', 'full_attention'], 'rope_local_base_freq': 100.0,
                    'rope_theta': 10000.0},
}


def tiny_config(model_type: str, **overrides):
    family = families.get(model_type)
    return family.config_class(**{**SHAPE, **EXTRA[model_type], **overrides})


def randomize_biases_and_norms(model, model_type: str) -> None:
    """Nonzero biases and norm weights away from their init (Gemma's norms are 1 + w, so w around 0), so that a
    conversion that dropped or misplaced one would change the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith('.bias'):
                parameter.normal_(0.0, 0.3)
            elif 'norm' in name:
                parameter.normal_(0.0 if model_type == 'gemma3_text' else 1.0, 0.2)


def tiny_model(model_type: str, seed: int = 0, copies: int = 1, **overrides):
    """A random model of the family in float32 with nonzero biases and norm weights; with ``copies`` > 1 every
    group of ``copies`` consecutive K/V heads holds the same weights (so pooling them loses nothing)."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = families.get(model_type).causal_lm_class(config).float().eval()
    randomize_biases_and_norms(model, model_type)
    with torch.no_grad():
        if copies > 1:
            width = families.head_dim(config)
            for layer in model.model.layers:
                attention = layer.self_attn
                for projection in (attention.k_proj, attention.v_proj):
                    for tensor in [projection.weight] + ([projection.bias] if projection.bias is not None else []):
                        heads = tensor.data.reshape(-1, copies, width, *tensor.shape[1:])
                        heads.copy_(heads[:, :1].expand_as(heads))
    return model


def save_tiny_family_model(folder: Path, model_type: str, tokenizer_dir: Path | None = None, **kwargs) -> Path:
    tiny_model(model_type, **kwargs).save_pretrained(folder, safe_serialization=True)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def logits_of(model, seed: int = 1, length: int = 12) -> torch.Tensor:
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, length))
    with torch.no_grad():
        return model(input_ids=ids).logits
