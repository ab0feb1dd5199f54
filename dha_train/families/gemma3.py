"""Gemma 3 (text): per-head q/k RMSNorms with Gemma's (1 + w) weight, sliding-window layers with their own RoPE
theta (``rope_local_base_freq``) between full-attention ones, the attention scale ``query_pre_attn_scalar ** -0.5``,
embeddings scaled by sqrt(hidden_size), four norms a layer, tied embeddings."""

from __future__ import annotations

from dha_train.models.family_classes import FAMILY_CLASSES

from dha_train.families.base import (
    ATTENTION_BIAS,
    QK_NORM,
    SLIDING_WINDOW_LAYERS,
    Family,
    Feature,
    all_or_none_biases,
    windows_by_layer_types,
)
from dha_train.families.qwen3 import LATENT_VS_NORM, ROTATION_VS_NORM

GEMMA_BLOCK = Feature("Gemma's scaled embeddings and sandwich norms", lambda config: True)

FAMILY = Family(
    model_type='gemma3_text', label='Gemma 3', classes=FAMILY_CLASSES['gemma3_text'],
     llama_cpp_arch='gemma3',
    biased_projections=all_or_none_biases, qk_norm=True, sliding_windows=windows_by_layer_types,
    attention_scale=lambda config: config.query_pre_attn_scalar ** -0.5,
    features=(QK_NORM, ATTENTION_BIAS, SLIDING_WINDOW_LAYERS, GEMMA_BLOCK),
    refusals={'aligned_gqa': {'per-head q/k norms': ROTATION_VS_NORM},
              'mla_deepseek': {'per-head q/k norms': LATENT_VS_NORM,
                               "Gemma's scaled embeddings and sandwich norms":
                                   "DeepseekV3's decoder has neither"}},
)
