"""Qwen3 (dense): per-head RMSNorm on queries and keys (``q_norm``, ``k_norm``, over head_dim, before RoPE), no
biases by default, an explicit ``head_dim``."""

from __future__ import annotations

from dha_train.families.base import (
    ATTENTION_BIAS,
    LLAMA_NORMS,
    PER_LAYER_KV_HEADS,
    QK_NORM,
    SLIDING_WINDOW_LAYERS,
    Family,
    LlamaCppLayout,
    all_or_none_biases,
    windows_by_layer_types,
)
from dha_train.models.family_classes import FAMILY_CLASSES

# A rotation of key heads (aligned GQA's Procrustes fold) does not commute with a norm's per-dimension weight.
ROTATION_VS_NORM = "a Procrustes rotation of the key heads does not commute with k_norm's per-dimension weight"
# the per-head q/k norms as llama.cpp names them (Qwen3, Gemma 3)
QK_NORMS = LLAMA_NORMS + (('self_attn.q_norm', 'attn_q_norm'), ('self_attn.k_norm', 'attn_k_norm'))
LATENT_VS_NORM = "DeepseekV3's keys come from a latent shared by every head and have no per-head k_norm"

FAMILY = Family(
    model_type='qwen3', label='Qwen3', classes=FAMILY_CLASSES['qwen3'],
     llama_cpp_arch='qwen3',
    biased_projections=all_or_none_biases, qk_norm=True, sliding_windows=windows_by_layer_types,
    features=(QK_NORM, ATTENTION_BIAS, SLIDING_WINDOW_LAYERS, PER_LAYER_KV_HEADS),
    refusals={'aligned_gqa': {'per-head q/k norms': ROTATION_VS_NORM},
              'mla_deepseek': {'per-head q/k norms': LATENT_VS_NORM,
                               'attention biases': "DeepseekV3's kv_b_proj has no bias",
                               'sliding-window layers': 'DeepseekV3ForCausalLM attends to every position'},
              'export_gguf': {'sliding-window layers': "llama.cpp's 'qwen3' architecture has no sliding window",
                              'attention biases': "llama.cpp's 'qwen3' architecture loads no attn_output bias",
                              'per-layer K/V head counts': "llama.cpp's 'qwen3' architecture sizes every layer's "
                                                           'K/V projections alike'}},
    llama_cpp=LlamaCppLayout(rope_pairs_adjacent=False, norms=QK_NORMS, biases=('q_proj', 'k_proj', 'v_proj'),
                             rope_freqs=False),
)
