"""LLaMA (1, 2, 3.x) and SmolLM2: the reference family. Optional biases on all four projections; RoPE with the
``llama3`` and linear scalings; tied embeddings on the small models."""

from __future__ import annotations

from dha_train.families.base import (
    ATTENTION_BIAS,
    Family,
    Feature,
    LlamaCppLayout,
    all_or_none_biases,
    rope_type,
)
from dha_train.models.family_classes import FAMILY_CLASSES

LLAMA3_ROPE = Feature("'llama3' RoPE scaling", lambda config: rope_type(config) == 'llama3')

FAMILY = Family(
    model_type='llama', label='LLaMA', classes=FAMILY_CLASSES['llama'],
     llama_cpp_arch='llama',
    biased_projections=all_or_none_biases, features=(ATTENTION_BIAS, LLAMA3_ROPE),
    refusals={'mla_deepseek': {'attention biases': "DeepseekV3's kv_b_proj and q_proj have no bias"}},
    # llama.cpp's 'llama' rotates adjacent pairs (NORM RoPE); 'deci' is its LLaMA with per-layer head counts
    llama_cpp=LlamaCppLayout(per_layer_arch='deci'),
)
