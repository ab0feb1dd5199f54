"""Mistral: LLaMA's attention without biases, with an optional sliding window on every layer (Mistral 7B v0.1;
later releases set none)."""

from __future__ import annotations

from dha_train.families.base import Family, Feature, LlamaCppLayout
from dha_train.models.family_classes import FAMILY_CLASSES

SLIDING_WINDOW = Feature('sliding-window attention', lambda config: getattr(config, 'sliding_window', None) is not None)

FAMILY = Family(
    model_type='mistral', label='Mistral', classes=FAMILY_CLASSES['mistral'],

    # llama.cpp's own converter writes Mistral checkpoints as its 'llama' architecture
    llama_cpp_arch='llama', biased_projections=lambda config: (),
    sliding_windows=lambda config: [getattr(config, 'sliding_window', None)] * config.num_hidden_layers,
    features=(SLIDING_WINDOW,),
    refusals={'mla_deepseek': {'sliding-window attention': 'DeepseekV3ForCausalLM attends to every position'},
              'export_gguf': {'sliding-window attention': "llama.cpp's 'llama' architecture has no sliding window"}},
    llama_cpp=LlamaCppLayout(per_layer_arch='deci'),
)
