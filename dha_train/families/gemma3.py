"""Gemma 3 (text): per-head q/k RMSNorms with Gemma's (1 + w) weight, sliding-window layers with their own RoPE
theta (``rope_local_base_freq``) between full-attention ones, the attention scale ``query_pre_attn_scalar ** -0.5``,
embeddings scaled by sqrt(hidden_size), four norms a layer, tied embeddings."""

from __future__ import annotations

from dha_train.families.base import (
    ATTENTION_BIAS,
    PER_LAYER_KV_HEADS,
    QK_NORM,
    SLIDING_WINDOW_LAYERS,
    Family,
    Feature,
    LlamaCppLayout,
    all_or_none_biases,
    head_dim,
    windows_by_layer_types,
)
from dha_train.families.qwen3 import LATENT_VS_NORM, QK_NORMS, ROTATION_VS_NORM
from dha_train.models.family_classes import FAMILY_CLASSES


def _engine_scale(config) -> float:
    """llama.cpp's gemma3 ignores query_pre_attn_scalar: 1/sqrt(head_dim), or 1/sqrt(n_embd / n_head) when the
    model has 62 layers (its 27B)."""
    width = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else head_dim(config)
    return width ** -0.5


# Four norms a layer (the two after the sublayers are Gemma's own) and the q/k norms, all (1 + w) in HF; NEOX RoPE;
# a per-layer sliding-window pattern with its own RoPE theta; q/k/v biases but no attn_output bias.
GEMMA3_LAYOUT = LlamaCppLayout(
    rope_pairs_adjacent=False,
    norms=(('input_layernorm', 'attn_norm'), ('post_attention_layernorm', 'post_attention_norm'),
           ('pre_feedforward_layernorm', 'ffn_norm'), ('post_feedforward_layernorm', 'post_ffw_norm')) + QK_NORMS[2:],
    norm_offset=1.0, biases=('q_proj', 'k_proj', 'v_proj'), rope_freqs=False,
    sliding_rope_theta=lambda config: config.rope_local_base_freq, engine_attention_scale=_engine_scale,
)
GEMMA_BLOCK = Feature("Gemma's scaled embeddings and sandwich norms", lambda config: True)

FAMILY = Family(
    model_type='gemma3_text', label='Gemma 3', classes=FAMILY_CLASSES['gemma3_text'],
     llama_cpp_arch='gemma3',
    biased_projections=all_or_none_biases, qk_norm=True, sliding_windows=windows_by_layer_types,
    attention_scale=lambda config: config.query_pre_attn_scalar ** -0.5,
    features=(QK_NORM, ATTENTION_BIAS, SLIDING_WINDOW_LAYERS, GEMMA_BLOCK, PER_LAYER_KV_HEADS),
    refusals={'aligned_gqa': {'per-head q/k norms': ROTATION_VS_NORM},
              'mla_deepseek': {'per-head q/k norms': LATENT_VS_NORM,
                               "Gemma's scaled embeddings and sandwich norms":
                                   "DeepseekV3's decoder has neither"},
              'export_gguf': {'attention biases': "llama.cpp's 'gemma3' architecture loads no attn_output bias",
                              'per-layer K/V head counts': "llama.cpp's 'gemma3' architecture sizes every layer's "
                                                           'K/V projections alike'}},
    llama_cpp=GEMMA3_LAYOUT,
)
