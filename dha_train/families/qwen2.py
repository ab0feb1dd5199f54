"""Qwen2 and Qwen2.5: biases on q/k/v (none on o), optional sliding windows on the layers past
``max_window_layers`` (transformers' ``layer_types``)."""

from __future__ import annotations

from dha_train.families.base import (
    PER_LAYER_KV_HEADS,
    SLIDING_WINDOW_LAYERS,
    Family,
    LlamaCppLayout,
    always,
    windows_by_layer_types,
)
from dha_train.models.family_classes import FAMILY_CLASSES

QKV_BIAS = always('q/k/v biases')

FAMILY = Family(
    model_type='qwen2', label='Qwen2', classes=FAMILY_CLASSES['qwen2'],
     llama_cpp_arch='qwen2',
    biased_projections=lambda config: ('q_proj', 'k_proj', 'v_proj'), sliding_windows=windows_by_layer_types,
    features=(QKV_BIAS, SLIDING_WINDOW_LAYERS, PER_LAYER_KV_HEADS),
    refusals={'mla_deepseek': {'q/k/v biases': "DeepseekV3's q_proj and kv_b_proj have no bias, and a key bias "
                                               'cannot pass through its normed latent',
                               'sliding-window layers': 'DeepseekV3ForCausalLM attends to every position'},
              'export_gguf': {'sliding-window layers': "llama.cpp's 'qwen2' architecture has no sliding window",
                              'per-layer K/V head counts': "llama.cpp's 'qwen2' architecture sizes every layer's "
                                                           'K/V projections alike'}},
    # NEOX RoPE (HF's halves); q/k/v biases, no attn_output bias
    llama_cpp=LlamaCppLayout(rope_pairs_adjacent=False, biases=('q_proj', 'k_proj', 'v_proj'), rope_freqs=False),
)
