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
    LlamaCppLayout,
    all_or_none_biases,
    always,
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


def _gguf_config(config, header: dict) -> dict:
    """What llama.cpp's gemma3 loader reads (src/models/gemma3.cpp) that transformers 4.53's GGUF mapping leaves to
    Gemma3TextConfig's defaults: the layer pattern (a per-layer array, a period, or every 6th layer full), the
    sliding layers' RoPE theta (10000 when absent), its own attention scale, the final soft-capping."""
    layers, window = config.num_hidden_layers, header.get('attention.sliding_window') or 0
    pattern = header.get('attention.sliding_window_pattern', 6)
    sliding = ([bool(pattern[index]) for index in range(layers)] if isinstance(pattern, list) else
               [window > 0 and (pattern == 0 or index % pattern < pattern - 1) for index in range(layers)])
    sliding = [window > 0 and kind for kind in sliding]
    why = "as llama.cpp's gemma3 loader reads the file"
    return {
        'layer_types': (['sliding_attention' if kind else 'full_attention' for kind in sliding], why),
        'rope_local_base_freq': (float(header.get('rope.freq_base_swa', 10000.0)), why),
        'query_pre_attn_scalar': (round(_engine_scale(config) ** -2), "llama.cpp's gemma3 scales queries by "
                                  '1/sqrt(head_dim) (1/sqrt(hidden/heads) at 62 layers), whatever the file says'),
        'final_logit_softcapping': (header.get('final_logit_softcapping') or None, why),
        'attn_logit_softcapping': (None, "llama.cpp's gemma3 has no attention soft-capping"),
    }


GEMMA_BLOCK = always("Gemma's scaled embeddings and sandwich norms")

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
    llama_cpp=GEMMA3_LAYOUT, gguf_config=_gguf_config,
)
